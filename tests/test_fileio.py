"""`write_atomic`: a file is replaced whole or not at all, and no temporary file is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deepinfer.fileio import write_atomic


def test_the_new_content_replaces_the_old_whole_and_the_directory_is_made(tmp_path: Path):
    path = tmp_path / "a" / "b" / "entry.bin"
    write_atomic(path, [b"old"])
    write_atomic(path, [b"new ", b"content"])
    assert path.read_bytes() == b"new content"
    assert os.listdir(path.parent) == ["entry.bin"]


def test_a_writer_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    path = tmp_path / "entry.bin"
    write_atomic(path, [b"old"])

    def chunks():
        yield b"half of it"
        raise RuntimeError("the producer died")

    with pytest.raises(RuntimeError):
        write_atomic(path, chunks())
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["entry.bin"]


def test_a_path_that_cannot_be_made_raises_oserror(tmp_path: Path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        write_atomic(tmp_path / "file" / "entry.bin", [b"x"])  # its "directory" is a file
