"""Stable names for full KV blocks: h_i = H(h_{i-1}, tokens of block i), rooted in H(extra).

`extra` covers what makes two identical token prefixes produce different KV, or must
keep them apart: the model's identity, the KV layout (dtype, block size), the tenant
(the server derives it from the API key; a client cannot choose it), the request's
`cache_salt` (chosen by the client, within its tenant) and its LoRA adapter's content. BLAKE2b over bytes: the same prefix has the same name in every
process and after a restart (never Python's randomized `hash()`). The device
prefix cache, the persistent store, the router and KV transfer share this name.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping

DIGEST_SIZE = 16


def root_hash(model_identity: str, kv_layout: str, cache_salt: str | None = None,
              tenant: str | None = None, adapter: str | None = None) -> bytes:
    """The chain's seed for one (model, KV layout, tenant, cache salt, LoRA adapter).

    Tenant and salt are separate length-prefixed fields, so no salt a client sends can name another
    tenant's blocks (nor the tenant-less namespace's). Without a tenant the seed is the one this
    function always gave, so stores written before tenants existed stay valid. `adapter`: the content digest
    of the LoRA adapter the KV was computed with (`lora.AdapterWeights.digest`; None: the base model)."""
    salt = "" if cache_salt is None else cache_salt
    text = f"deepinfer-kv-v1|{model_identity}|{kv_layout}|{len(salt)}:{salt}"
    if tenant is not None:
        # the salt's length prefix ends it exactly, so this suffix cannot be spelled by a salt
        text += f"|tenant|{len(tenant)}:{tenant}"
    if adapter is not None:
        text += f"|lora|{len(adapter)}:{adapter}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...], extra: bytes | None = None) -> bytes:
    """`extra`: what else the block's KV depends on (the digests of image tiles whose placeholder tokens
    start in it); it follows the block's fixed-size token bytes, so no token sequence can spell it."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, root: bytes,
                        extra: Mapping[int, bytes] | None = None) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes` (in place); `extra`: block
    index -> that block's extra key (`hash_block`)."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra.get(i) if extra else None)
        hashes.append(parent)
