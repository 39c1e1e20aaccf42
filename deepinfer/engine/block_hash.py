"""Stable names for full KV blocks: h_i = H(h_{i-1}, tokens of block i), rooted in H(extra).

`extra` covers what makes two identical token prefixes produce different KV: the
model's identity, the KV layout (dtype, block size) and the request's cache salt
(tenant isolation). BLAKE2b over bytes: the same prefix has the same name in every
process and after a restart (never Python's randomized `hash()`). The device
prefix cache, the persistent store, the router and KV transfer share this name.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_SIZE = 16


def root_hash(model_identity: str, kv_layout: str, cache_salt: str | None = None) -> bytes:
    """The chain's seed for one (model, KV layout, tenant)."""
    salt = "" if cache_salt is None else cache_salt
    return hashlib.blake2b(f"deepinfer-kv-v1|{model_identity}|{kv_layout}|{len(salt)}:{salt}".encode(),
                           digest_size=DIGEST_SIZE).digest()


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, root: bytes) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes` (in place)."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
