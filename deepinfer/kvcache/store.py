"""The persistent KV block store: content-addressed segments on a (shared) filesystem path.

Owns reading and writing KV blocks by chained block hash (see
`deepinfer.kvcache.hashing`), validation of everything read, retention
(TTL per class) and graceful failure. Capacity and layout live in `space.py`,
the on-disk format in `format.py`.

Segments, not one file per block. A chain is cut into aligned groups of
`segment_blocks` (default 16) positions; the blocks of one group that one
writer stores go into one object, in a directory named by the hash of the
group's first block, the file named by the hash of its last block and its
block count. A reader that knows the chain therefore finds a full group with
one `open` (the name is computable), and a partial group with one `listdir` of
a small directory: a name ending with one of its own hashes is on its chain;
other names are branches that share the group's first block, and reading one
header tells how many leading blocks are shared. Writers store only what is not
there yet, so an agent's growing history adds one small segment per turn
instead of rewriting its prefix. Trade-off, measured by
`benchmarks/kvstore_layout.py` (SmolLM2-135M float32, 720 KiB blocks, a
128-block = 2048-token prefix, local disk, fsync on)::

                      files  write ms/block  lookup: ms, opens+listdirs  get ms/block
    file per block      128            1.81            4.25, 128               0.71
    segments of 4        32            1.07            1.62, 32                0.95
    segments of 16        8            0.90            0.41, 8                 0.64

("file per block" is this code with segment_blocks=1, so it also pays a group
directory per block; a flat fan-out layout would save that mkdir but not the
per-file create, fsync and rename.) Locally the difference is small in absolute
terms; on NFS / Lustre / 3FS every open, listdir and rename is a server round
trip, and a 32k-token prefix is 128 objects instead of 2048. The price:
eviction and TTL act on whole segments, and a group where many conversations
diverge holds one small segment per branch (found with one listdir; at most
MAX_BRANCH_PROBES branch headers are read per group, so past that many
branches a reader may miss a shared head and recompute up to a group).
Two writers racing on the same new blocks may both store them; LRU drops
the copy nobody reads.

A TTL counts from when a segment was written (headers are immutable, so a hit
costs no write); a hot prefix is rewritten once per TTL by the request that
finds it expired.

Every read is validated (header digest, file length, model identity, layout,
per-block CRC, expiry); anything wrong is counted, removed and treated as a
miss. Writes go to a temp file in the same directory and are renamed into
place (fsynced first with `fsync=True`; without it a crash can leave a torn
object under its final name, which validation drops), so a crash never leaves
a loadable partial object; any OSError on
the write path (ENOSPC, EROFS, EACCES, EFBIG ...) drops the write and counts
it: the caller is never raised at.

LRU across processes uses file mtime: writes and loads set it to the store
clock, minus a microsecond per chain position so that, within one access, a
prefix's tail looks older than its head and is evicted first (the head is what
other prefixes share).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from deepinfer.kvcache.format import CorruptSegment, KVLayout, RetentionPolicy, SegmentHeader, block_crc
from deepinfer.kvcache.space import (
    StoreSpace,
    gc,
    group_dir,
    parse_segment_name,
    read_header,
    scan,
    segment_name,
)
from deepinfer.kvcache.space import clear as clear_dir
from deepinfer.kvcache.tier import KVTier

logger = logging.getLogger(__name__)

# header reads spent on branch segments (names not on our chain) per group and walk: bounds
# the work at a popular group where many conversations diverge
MAX_BRANCH_PROBES = 8
# parsed group listings kept per store (a popular group, e.g. a chat template's first block, holds one
# segment per stored conversation: thousands of names)
LISTING_CACHE_DIRS = 1024
# a listing taken this soon after its directory's last change is not kept: a change in the same
# timestamp tick would leave the mtime as it was
RACY_LISTING_NS = 1_000_000_000


class GroupListing:
    """One group directory's segment names, parsed once: by last block hash, and in listing order."""

    def __init__(self, names: list[str], mtime_ns: int = -1) -> None:
        self.mtime_ns = mtime_ns
        self.entries: list[tuple[bytes, int, str]] = []
        self.by_hash: dict[bytes, list[tuple[int, str]]] = {}
        for name in names:
            parsed = parse_segment_name(name)
            if parsed is not None:
                self.entries.append((parsed[0], parsed[1], name))
                self.by_hash.setdefault(parsed[0], []).append((parsed[1], name))


def as_buffer(payload: Any) -> memoryview:
    """A flat byte view of a payload: bytes, bytearray, memoryview, numpy array, or CPU uint8 torch tensor."""
    try:
        view = memoryview(payload)
    except TypeError:
        view = memoryview(payload.numpy())  # torch tensors do not export the buffer protocol
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class KVBlockStore(KVTier):
    """Persistent, shared, validated KV blocks for one (model identity, KV layout)."""

    def __init__(self, path: str | os.PathLike, model_identity: str, layout: KVLayout, max_bytes: int,
                 retention: RetentionPolicy | None = None, clock: Callable[[], float] = time.time,
                 segment_blocks: int = 16, fsync: bool = True) -> None:
        if segment_blocks <= 0:
            raise ValueError(f"segment_blocks must be positive, got {segment_blocks}")
        self.root = Path(path)
        self.model_identity = model_identity
        self.layout = layout
        self.retention = retention or RetentionPolicy()
        self.clock = clock
        self.segment_blocks = segment_blocks
        self.fsync = fsync
        self.space = StoreSpace(self.root, max_bytes)
        self.counters: Counter[str] = Counter()
        self._listings: OrderedDict[Path, GroupListing] = OrderedDict()
        self._listings_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # reads of an existing store may still work; writes will count errors
            logger.warning("KV store %s is not writable: %s", self.root, e)

    # ------------------------------------------------------------------ reading

    def _discard(self, path: Path, reason: str, fd: int | None = None) -> None:
        """Count and remove a segment that must not be served. With `fd`, only if the path still names
        the file we read: a writer may have just replaced a bad object with a good one."""
        self.counters[reason] += 1
        try:
            st = os.stat(path)
            if fd is not None and os.fstat(fd).st_ino != st.st_ino:
                return
            path.unlink()
            self.space.release(st.st_size)
        except OSError:
            pass

    def _open_valid(self, path: Path) -> tuple[BinaryIO, SegmentHeader] | None:
        """(open file, header) of a segment that is intact and ours, or None (counted and removed if bad)."""
        try:
            f = open(path, "rb")  # noqa: SIM115 -- handed to the caller, which closes it
        except FileNotFoundError:
            return None
        except OSError:
            self.counters["read_errors"] += 1
            return None
        try:
            hdr = read_header(f)
            if (hdr.model_identity, hdr.kv_layout, hdr.dtype) != (
                    self.model_identity, self.layout.key, self.layout.dtype) or any(
                    hdr.size(i) != self.layout.nbytes(hdr.first_pos + i) for i in range(hdr.nblocks)):
                raise CorruptSegment("segment of another model identity or KV layout")
            if self.clock() >= hdr.expires:
                self._discard(path, "expired", f.fileno())
                f.close()
                return None
            return f, hdr
        except CorruptSegment as e:
            logger.warning("KV store: dropping %s: %s", path, e)
            self._discard(path, "corrupt", f.fileno())
        except OSError:
            self.counters["read_errors"] += 1
        f.close()
        return None

    def _listing(self, gdir: Path) -> GroupListing:
        """`gdir`'s parsed listing: the cached one while the directory's mtime is unchanged (one stat),
        else listed and parsed again. Other processes' writes and removals change the mtime; a listing
        that is stale anyway (a change within the mtime's tick) costs a miss or a failed open, never a
        wrong block: every segment is validated when opened."""
        try:
            mtime = os.stat(gdir).st_mtime_ns
        except OSError:
            return GroupListing([])
        with self._listings_lock:  # lookups also run on the tiers' staging thread
            cached = self._listings.get(gdir)
            if cached is not None and cached.mtime_ns == mtime:
                self._listings.move_to_end(gdir)
                return cached
        try:
            listing = GroupListing(os.listdir(gdir), mtime)
        except OSError:
            return GroupListing([])
        with self._listings_lock:
            if time.time_ns() - mtime > RACY_LISTING_NS:
                self._listings[gdir] = listing
                self._listings.move_to_end(gdir)
                if len(self._listings) > LISTING_CACHE_DIRS:
                    self._listings.popitem(last=False)
            else:
                self._listings.pop(gdir, None)
        return listing

    def _candidates(self, hashes: Sequence[bytes], a: int, p: int, end: int,
                    listings: dict[int, GroupListing]) -> Iterator[Path]:
        """Segment paths that may hold position p of the group starting at a, most promising first:
        the full segment ending at the group's last position, segments ending at a position of the
        chain that cover p (latest end first), then up to MAX_BRANCH_PROBES others (branches: they may
        share blocks with the chain before they part)."""
        gdir = group_dir(self.root, hashes[a])
        n = self.segment_blocks
        full = segment_name(hashes[a + n - 1], n) if end == a + n else None
        if full is not None:
            yield gdir / full
        if a not in listings:
            listings[a] = self._listing(gdir)
        listing = listings[a]
        known = sorted(((i, name) for i in range(max(a, p), end) for nblocks, name in listing.by_hash.get(hashes[i], ())
                        if name != full and i + 1 - nblocks <= p), reverse=True)
        for _, name in known:
            yield gdir / name
        pos = set(hashes[a:end])
        branches = 0
        for h, _, name in listing.entries:
            if branches == MAX_BRANCH_PROBES:
                break
            if h not in pos and name != full:
                branches += 1
                yield gdir / name

    def _iter_runs(self, hashes: Sequence[bytes], start: int,
                   limit: int) -> Iterator[tuple[Path, BinaryIO, SegmentHeader, int, int]]:
        """Yield (path, file, header, p, e) for consecutive validated runs covering hashes[start:e]; the
        file is open while the consumer holds the item. Stops at the first position no segment covers."""
        p = start
        listings: dict[int, GroupListing] = {}
        while p < limit:
            a = p - p % self.segment_blocks
            end = min(limit, a + self.segment_blocks)
            e = p
            for path in self._candidates(hashes, a, p, end, listings):
                opened = self._open_valid(path)
                if opened is None:
                    continue
                f, hdr = opened
                with f:
                    s = hdr.first_pos
                    if not s <= p < s + hdr.nblocks or hdr.hashes[p - s] != hashes[p]:
                        continue
                    e = p + 1
                    while e < min(end, s + hdr.nblocks) and hdr.hashes[e - s] == hashes[e]:
                        e += 1
                    yield path, f, hdr, p, e
                break
            if e == p:
                return
            p = e

    def lookup(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """How many consecutive blocks from position `start` of the chain `hashes` are stored and valid
        (headers checked; payload CRCs are checked by `get`)."""
        n = self._covered(hashes, start, len(hashes))
        self.counters["lookups"] += 1
        self.counters["lookup_hit_blocks"] += n
        return n

    def _covered(self, hashes: Sequence[bytes], start: int, limit: int) -> int:
        end = start
        for run in self._iter_runs(hashes, start, limit):
            end = run[4]
        return end - start

    def load(self, hashes: Sequence[bytes], start: int = 0, count: int | None = None) -> list[memoryview]:
        """Payloads of the longest valid run of blocks from position `start` (at most `count`), in
        order; [] on a miss. Each payload is a view of `layout.nbytes(position)` fresh bytes (the caller's)."""
        limit = len(hashes) if count is None else min(len(hashes), start + count)
        out: list[memoryview] = []
        now = self.clock()
        nbytes = 0
        try:
            for path, f, hdr, p, e in self._iter_runs(hashes, start, limit):
                lo = p - hdr.first_pos
                sizes = [hdr.size(lo + i) for i in range(e - p)]
                buf = bytearray(sum(sizes))
                f.seek(hdr.header_len + hdr.offset(lo))
                if f.readinto(buf) != len(buf):
                    self._discard(path, "corrupt", f.fileno())
                    break
                view = memoryview(buf)  # writable: torch.frombuffer can wrap it without a copy
                offs = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
                blocks = [view[offs[i]:offs[i + 1]] for i in range(e - p)]
                if any(block_crc(b) != hdr.crcs[p - hdr.first_pos + i] for i, b in enumerate(blocks)):
                    logger.warning("KV store: dropping %s: payload CRC mismatch", path)
                    self._discard(path, "corrupt", f.fileno())
                    break
                out.extend(blocks)
                nbytes += len(buf)
                self._touch(f.fileno(), now, p)
        except OSError:
            self.counters["read_errors"] += 1
        self.counters["get_blocks"] += len(out)
        self.counters["get_misses" if not out else "gets"] += 1
        self.counters["bytes_read"] += nbytes
        return out

    def _touch(self, fd: int, now: float, pos: int) -> None:
        t = now - pos * 1e-6
        with contextlib.suppress(OSError):  # a read-only mount still serves; LRU order just goes stale
            os.utime(fd, (t, t))

    # ------------------------------------------------------------------ writing

    def put(self, hashes: Sequence[bytes], payloads: Sequence[Any], retention_class: str | None = None,
            start: int = 0) -> int:
        """Store blocks start .. start+len(payloads)-1 of the chain `hashes` (which must reach at least that
        far; positions before `start` are only used to name groups). Blocks already stored are skipped.
        Returns the number of blocks written; failures are counted, never raised. Stops at the first
        segment that cannot be written: blocks after a gap could never be found by a lookup."""
        end = start + len(payloads)
        if end > len(hashes):
            raise ValueError(f"{len(payloads)} payloads from position {start} need {end} hashes, got {len(hashes)}")
        have = self._covered(hashes, start, end)
        written = 0
        p = start + have
        # one put may fill at most the eviction target: beyond it, its own tail would evict its own head
        budget = int(self.space.max_bytes * self.space.low_water)
        cls = self.retention.resolve(retention_class)
        while p < end:
            a = p - p % self.segment_blocks
            e = min(end, a + self.segment_blocks)
            budget -= self.layout.run_nbytes(p, e - p) + SegmentHeader.length_for(
                e - p, self.model_identity, self.layout.key, self.layout.dtype, cls, not self.layout.uniform)
            if budget < 0:
                self.counters["dropped_capacity"] += 1
                break
            if not self.put_run(hashes[a], p, hashes[p:e], payloads[p - start:e - start], cls,
                                check_present=False):
                break
            written += e - p
            p = e
        return written

    def put_run(self, group_hash: bytes, first_pos: int, hashes: Sequence[bytes], payloads: Sequence[Any],
                retention_class: str | None = None, check_present: bool = True) -> bool:
        """Store one run of consecutive blocks that lies inside one group: `first_pos` is the chain
        position of hashes[0], `group_hash` the hash at the group's first position. True if written."""
        n = len(hashes)
        if n == 0 or len(payloads) != n:
            raise ValueError("put_run needs one payload per hash, at least one")
        if first_pos // self.segment_blocks != (first_pos + n - 1) // self.segment_blocks:
            raise ValueError(f"run {first_pos}..{first_pos + n - 1} crosses a group boundary")
        bufs = [as_buffer(p) for p in payloads]
        sizes = [self.layout.nbytes(first_pos + i) for i in range(n)]
        if any(b.nbytes != size for b, size in zip(bufs, sizes, strict=True)):
            raise ValueError(f"payloads of {[b.nbytes for b in bufs]} bytes, not {sizes} ({self.layout.key})")
        bn = self.layout.block_nbytes
        gdir = group_dir(self.root, group_hash)
        path = gdir / segment_name(hashes[-1], n)
        if check_present and path.exists():
            return False
        now = self.clock()
        cls = self.retention.resolve(retention_class)
        hdr = SegmentHeader(self.model_identity, self.layout.key, self.layout.dtype, cls, now,
                            now + self.retention.ttl(cls), first_pos, bn, list(hashes), [block_crc(b) for b in bufs],
                            sizes=None if self.layout.uniform else sizes)
        head = hdr.encode()
        try:
            made = self.space.reserve(hdr.file_len, lambda: self._mkstemp(gdir, path.name, hdr.file_len))
        except OSError as e:
            return self._write_failed(e)
        if made is None:
            self.counters["dropped_capacity"] += 1
            return False
        fd, tmp = made
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                for b in bufs:
                    f.write(b)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            # after the rename: a temp file with an old (clock) mtime would look abandoned to evictors
            t = now - first_pos * 1e-6
            with contextlib.suppress(OSError):  # already evicted or replaced: nothing to date
                os.utime(path, (t, t))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.space.release(hdr.file_len)
            return self._write_failed(e)
        self.counters["writes"] += 1
        self.counters["written_blocks"] += n
        self.counters["bytes_written"] += hdr.file_len
        return True

    @staticmethod
    def _mkstemp(gdir: Path, name: str, size: int) -> tuple[int, str]:
        # an evictor may remove an emptied group directory between our mkdir and mkstemp: retry
        for attempt in range(3):
            gdir.mkdir(parents=True, exist_ok=True)
            try:
                return tempfile.mkstemp(dir=gdir, prefix=f".{name}.", suffix=f".{size}.tmp")
            except FileNotFoundError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _write_failed(self, e: OSError) -> bool:
        self.counters["write_errors"] += 1
        if self.counters["write_errors"] == 1 or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            logger.warning("KV store %s: write dropped: %s", self.root, e)
        return False

    # ------------------------------------------------------------------ maintenance

    def gc(self, verify: bool = False) -> dict:
        """Remove expired and corrupt segments and stale temp files, evict down to max_bytes."""
        return gc(self.root, self.space.max_bytes, self.clock, verify)

    def scan(self) -> dict:
        return scan(self.root, self.clock)

    def clear(self) -> dict:
        return clear_dir(self.root)

    def stats(self) -> dict[str, int]:
        """This process's counters: hits, misses, corrupt, expired, write_errors, evictions, bytes."""
        keys = ("lookups", "lookup_hit_blocks", "gets", "get_misses", "get_blocks", "bytes_read", "writes",
                "written_blocks", "bytes_written", "corrupt", "expired", "read_errors", "write_errors",
                "dropped_capacity")
        out = {k: self.counters[k] for k in keys}
        out.update(evicted=self.space.evicted, evicted_bytes=self.space.evicted_bytes)
        return out

    def close(self) -> None:
        self.space.close()
