"""Writing a file so that readers never see it half written: the one atomic-write helper the caches use
(the model identity's digests, the GGUF blocks' cache). The KV store writes its segments its own way (its
temporary files are reserved against a capacity budget and fsynced on request, `kvcache/store.py`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def write_atomic(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to `path` through a temporary file in its directory, renamed over it once complete:
    a reader (or a concurrent writer's reader) finds the old file, the whole new one or none, never a torn
    one. Creates the directory. Raises OSError, leaving no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
