"""Where segments live in a store directory, and how much room they may take.

Owns the directory layout, the capacity bound shared by every process using the
directory, and whole-store maintenance that needs no model identity (`scan`,
`gc`, `clear`, used by ``deepinfer cache``)::

    <root>/lock                              POSIX-locked by writers; holds the usage counter
    <root>/objects/<g[:2]>/<g>/<h>-<n>.kvs   a segment: n blocks ending with block hash h, in
                                             the group whose first block hash is g
    <root>/objects/<g[:2]>/<g>/.<..>.<bytes>.tmp   a write in flight (intended size in its name)

Capacity, across processes: a writer reserves a segment's bytes before writing
it, under an exclusive `lockf` on ``lock`` whose content is the byte count of all
segments plus in-flight writes. A reservation that would pass `max_bytes` first
evicts least-recently-used segments (file mtime = last use; readers refresh it)
down to `low_water` x `max_bytes`, then resets the counter from that scan. So
the bound holds continuously, even under a write storm from many processes,
and the scan (O(objects)) is paid once per ~10% of capacity written. Reads never
take the lock. Removals outside the lock (corrupt or expired objects found by
readers) are subtracted at the process's next reservation; until then the
counter overestimates, which only makes eviction early, never late. Anything
that bypasses the counter (files deleted by hand, a crashed writer's
reservation) is corrected by the next eviction scan or `gc`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from deepinfer.kvcache.format import CorruptSegment, SegmentHeader, block_crc

OBJECTS = "objects"
SEGMENT_SUFFIX = ".kvs"
TMP_SUFFIX = ".tmp"
LOCK_NAME = "lock"
# a temp file this old belongs to a writer that died; younger ones may still be in flight
STALE_TMP_SECONDS = 3600.0
_COUNTER = struct.Struct("<QQ")  # usage, usage ^ _CHECK: a torn or garbage counter forces a rescan
_CHECK = 0x5EED_CAFE_F00D_D1CE
T = TypeVar("T")


def group_dir(root: Path, group_hash: bytes) -> Path:
    g = group_hash.hex()
    return root / OBJECTS / g[:2] / g


def segment_name(last_hash: bytes, nblocks: int) -> str:
    return f"{last_hash.hex()}-{nblocks}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> tuple[bytes, int] | None:
    """`<hex>-<n>.kvs` -> (last block hash, n); None for anything else (temp files, strays)."""
    if not name.endswith(SEGMENT_SUFFIX) or name.startswith("."):
        return None
    stem, _, n = name[:-len(SEGMENT_SUFFIX)].rpartition("-")
    try:
        return bytes.fromhex(stem), int(n)
    except ValueError:
        return None


def tmp_intended_size(name: str) -> int:
    try:
        return int(name.rsplit(".", 2)[-2])
    except (IndexError, ValueError):
        return 0


@dataclass
class FileEntry:
    path: Path
    size: int
    mtime: float
    tmp: bool


def iter_files(root: Path) -> Iterator[FileEntry]:
    """Every segment and temp file under `root`; files vanishing mid-walk are skipped."""
    def entries(d: Path) -> list[os.DirEntry]:
        try:
            with os.scandir(d) as it:
                return list(it)
        except (FileNotFoundError, NotADirectoryError):
            return []

    for fan in entries(root / OBJECTS):
        for grp in entries(Path(fan.path)):
            for f in entries(Path(grp.path)):
                tmp = f.name.endswith(TMP_SUFFIX)
                if not tmp and parse_segment_name(f.name) is None:
                    continue
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                yield FileEntry(Path(f.path), tmp_intended_size(f.name) if tmp else st.st_size, st.st_mtime, tmp)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _prune_dir(d: Path) -> None:
    """Remove an emptied group directory (and its fan-out parent); a concurrent writer recreates them."""
    for p in (d, d.parent):
        try:
            p.rmdir()
        except OSError:
            return


class StoreSpace:
    """The capacity bound and the usage counter of one store directory, shared by all its users."""

    def __init__(self, root: Path, max_bytes: int, low_water: float = 0.9) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.low_water = low_water
        self._tlock = threading.Lock()  # lockf locks belong to the process: threads need their own
        self._fd: int | None = None
        self._pending_release = 0
        self.evicted = 0
        self.evicted_bytes = 0
        self.rescans = 0

    def _lock_fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        return self._fd

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The lock file's descriptor, held exclusively by this thread of this process."""
        with self._tlock:
            fd = self._lock_fd()
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read_counter(self, fd: int) -> int | None:
        data = os.pread(fd, _COUNTER.size, 0)
        if len(data) != _COUNTER.size:
            return None
        usage, check = _COUNTER.unpack(data)
        return usage if usage ^ _CHECK == check else None

    def _write_counter(self, fd: int, usage: int) -> None:
        usage = max(0, usage)
        os.pwrite(fd, _COUNTER.pack(usage, usage ^ _CHECK), 0)

    def release(self, nbytes: int) -> None:
        """Bytes removed without the lock; subtracted from the counter at the next reservation."""
        with self._tlock:
            self._pending_release += nbytes

    def reserve(self, nbytes: int, create_tmp: Callable[[], T]) -> T | None:
        """Account for a write of `nbytes` and create its temp file (`create_tmp`, whose name must carry
        the size) under the lock: a rescan by another writer then sees every reservation on disk.
        Returns what `create_tmp` returned, or None if the write cannot fit even after eviction.
        Raises OSError if the lock or the temp file cannot be made (the caller counts a write error)."""
        if nbytes > self.max_bytes * self.low_water:
            return None
        with self._locked() as fd:
            usage = self._read_counter(fd)
            if usage is None:
                self.rescans += 1
                usage = sum(e.size for e in iter_files(self.root))
            usage = max(0, usage - self._pending_release)
            self._pending_release = 0
            if usage + nbytes > self.max_bytes:
                usage = self._evict_locked(int(self.max_bytes * self.low_water) - nbytes)
                if usage + nbytes > self.max_bytes:
                    self._write_counter(fd, usage)
                    return None
            try:
                tmp = create_tmp()
            except OSError:
                self._write_counter(fd, usage)
                raise
            self._write_counter(fd, usage + nbytes)
            return tmp

    def _evict_locked(self, target: int) -> int:
        """Delete least-recently-used segments until usage <= target; returns the new true usage."""
        self.rescans += 1
        now = time.time()
        files, total = [], 0
        for e in iter_files(self.root):
            if e.tmp and now - e.mtime > STALE_TMP_SECONDS:
                _unlink(e.path)
                continue
            total += e.size
            if not e.tmp:
                files.append(e)
        files.sort(key=lambda e: e.mtime)
        for e in files:
            if total <= target:
                break
            if _unlink(e.path):
                self.evicted += 1
                self.evicted_bytes += e.size
                _prune_dir(e.path.parent)
            total -= e.size
        return total

    def enforce(self, max_bytes: int | None = None) -> int:
        """Evict down to `max_bytes` (default: the bound) and reset the counter from disk; returns usage."""
        with self._locked() as fd:
            usage = self._evict_locked(self.max_bytes if max_bytes is None else max_bytes)
            self._pending_release = 0
            self._write_counter(fd, usage)
            return usage


def read_header(f: BinaryIO) -> SegmentHeader:
    """Header of an open segment file, checked against the file's length; raises CorruptSegment or OSError."""
    head = f.read(4096)
    need = SegmentHeader.length(head)
    if need > len(head):
        head += f.read(need - len(head))
    hdr = SegmentHeader.decode(head)
    size = os.fstat(f.fileno()).st_size
    if size != hdr.file_len:
        raise CorruptSegment(f"file is {size} bytes, header says {hdr.file_len} (truncated or extended)")
    return hdr


def verify_payload(f: BinaryIO, hdr: SegmentHeader) -> None:
    f.seek(hdr.header_len)
    for i, crc in enumerate(hdr.crcs):
        if block_crc(f.read(hdr.size(i))) != crc:
            raise CorruptSegment("payload CRC mismatch")


def _walk(root: Path, clock: Callable[[], float], verify: bool = False
          ) -> Iterator[tuple[FileEntry, SegmentHeader | None, str]]:
    """Every file under `root` with its header and state: tmp, corrupt, expired or live."""
    now = clock()
    for e in iter_files(root):
        if e.tmp:
            yield e, None, "tmp"
            continue
        try:
            with open(e.path, "rb") as f:
                hdr = read_header(f)
                if verify:
                    verify_payload(f, hdr)
        except CorruptSegment:
            yield e, None, "corrupt"
            continue
        except FileNotFoundError:
            continue
        yield e, hdr, "expired" if now >= hdr.expires else "live"


def scan(root: Path, clock: Callable[[], float] = time.time) -> dict:
    """Summary of a store directory (reads every header; no payloads)."""
    out: dict = {"path": str(root), "objects": 0, "bytes": 0, "blocks": 0, "expired": 0, "expired_bytes": 0,
                 "corrupt": 0, "tmp_files": 0, "by_class": {}}
    for e, hdr, state in _walk(root, clock):
        if hdr is None:
            out["tmp_files" if state == "tmp" else "corrupt"] += 1
            continue
        out["objects"] += 1
        out["bytes"] += e.size
        out["blocks"] += hdr.nblocks
        cls = out["by_class"].setdefault(hdr.retention_class, {"objects": 0, "bytes": 0})
        cls["objects"] += 1
        cls["bytes"] += e.size
        if state == "expired":
            out["expired"] += 1
            out["expired_bytes"] += e.size
    return out


def gc(root: Path, max_bytes: int | None = None, clock: Callable[[], float] = time.time,
       verify: bool = False) -> dict:
    """Remove expired, corrupt (header, length; payload CRCs too if `verify`) and stale temp segments,
    then evict LRU segments down to `max_bytes` if given. Returns what was removed and what is left."""
    wall = time.time()
    removed = {"expired": 0, "corrupt": 0, "tmp": 0, "evicted": 0, "freed_bytes": 0}
    objects = nbytes = 0
    for e, _, state in _walk(root, clock, verify):
        if state == "live":
            objects += 1
            nbytes += e.size
        elif state == "tmp":
            if wall - e.mtime > STALE_TMP_SECONDS and _unlink(e.path):
                removed["tmp"] += 1
        elif _unlink(e.path):
            removed[state] += 1
            removed["freed_bytes"] += e.size
            _prune_dir(e.path.parent)
    if max_bytes is not None and root.is_dir():
        space = StoreSpace(root, max(1, max_bytes))
        try:
            space.enforce(max_bytes)
        finally:
            space.close()
        removed["evicted"] = space.evicted
        removed["freed_bytes"] += space.evicted_bytes
        objects -= space.evicted
        nbytes -= space.evicted_bytes
    return {**removed, "objects": objects, "bytes": nbytes}


def clear(root: Path) -> dict:
    """Remove every segment. The objects tree is renamed away first, so users see it vanish at once."""
    objects = root / OBJECTS
    before = scan(root)
    if objects.is_dir():
        trash = root / f".trash-{uuid.uuid4().hex}"
        os.replace(objects, trash)
        shutil.rmtree(trash, ignore_errors=True)
    if (root / LOCK_NAME).exists():
        space = StoreSpace(root, 1)
        try:
            space.enforce()
        finally:
            space.close()
    return {"removed_objects": before["objects"], "freed_bytes": before["bytes"]}
