"""Content identity of a model: which KV a set of weights produces, independent of where the files are.

Owns the model identity that seeds every KV block hash (`deepinfer.kvcache.hashing.root_hash`) and
names a store segment's model: a BLAKE2b digest of the weight files' bytes, the model config and
the compute dtype. Two hosts with the same model at different paths therefore share a store, and
a file rewritten in place (same size, same mtime) never passes for the old one. The KV layout
(KV dtype, block size, layers, heads, head dim) is not part of it: `root_hash` mixes the layout key
in separately, and the store checks it in every segment header.

Hashing ~100 MB takes a fraction of a second, a multi-GB checkpoint seconds, so per-file digests
are cached under ``<cache dir>/identity/``, keyed by the file's resolved path, size, mtime_ns,
inode, device and ctime_ns. ctime is what makes the cache safe against an in-place rewrite: a
writer can put the mtime back with utime(), but utime() itself sets ctime to now, and nothing short
of changing the clock sets ctime back. A cache entry whose stat does not match is ignored and the
file hashed again; a cache directory that cannot be written just means hashing every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from deepinfer.fileio import write_atomic

# config.json keys that record how or where a checkpoint was saved, not what it computes
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path"})
_CHUNK = 8 << 20
IDENTITY_VERSION = "deepinfer-model-v2"


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
            "dev": st.st_dev, "ctime_ns": st.st_ctime_ns}


def hash_file(path: Path) -> str:
    """BLAKE2b-256 of a file's bytes (read in large chunks)."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_digest(path: str | os.PathLike, cache_dir: Path | None) -> str:
    """Digest of a file's content, from `cache_dir` when an entry's stat matches the file's, else hashed
    (and the entry written). `cache_dir=None` always hashes."""
    path = Path(path)
    if cache_dir is None:
        return hash_file(path)
    key = _stat_key(path)
    name = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    entry = cache_dir / f"{name}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(entry.read_text())
        if cached["stat"] == key:
            return cached["digest"]
    digest = hash_file(path)
    # stat again: a file written to while we read it must not be cached under either state's key
    if _stat_key(path) != key:
        return digest
    with contextlib.suppress(OSError):  # a read-only cache dir costs a re-hash next start, nothing else
        write_atomic(entry, [json.dumps({"stat": key, "digest": digest}).encode()])
    return digest


def canonical_config(config_path: Path) -> str:
    """config.json as sorted-key JSON without the keys that only record the saving tool or path."""
    config = json.loads(config_path.read_text())
    return json.dumps({k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}, sort_keys=True)


def content_digest(file_digests: Iterable[str], config_path: Path) -> str:
    """Digest of the weight files' digests (in load order) and the canonical config. File names do not
    enter it: a renamed copy computes the same KV."""
    h = hashlib.blake2b(digest_size=16)
    h.update(IDENTITY_VERSION.encode())
    for digest in file_digests:
        h.update(f"|{digest}".encode())
    h.update(b"|config:" + canonical_config(config_path).encode())
    return h.hexdigest()


def kv_identity(digest: str, dtype: object) -> str:
    """The model identity for KV: the content digest plus the dtype the model computes in (the same weights
    in bfloat16 and float32 produce different KV)."""
    return hashlib.blake2b(f"{digest}|{str(dtype).removeprefix('torch.')}".encode(), digest_size=16).hexdigest()
