"""KV block tiers below the device pool: a host-memory LRU tier and a persistent, shared store.

- `format`  -- KV layout, retention classes, the on-disk segment header
- `space`   -- directory layout, the cross-process capacity bound, scan / gc / clear
- `store`   -- `KVBlockStore`: validated, content-addressed blocks on a filesystem path
- `host`    -- `HostKVCache`: a byte-bounded LRU map in host memory
- `tiers`   -- `TieredKVStore`: lookup / load / offload across host tier + store
- `blocks`  -- gather / scatter one block between the paged device cache and a payload (imports torch)
- `writer`  -- `StoreWriter`: store writes on a background thread behind a byte-bounded queue

Blocks are named by the chained hashes of `deepinfer.engine.block_hash`.
"""

from deepinfer.kvstore.format import KVLayout, RetentionPolicy
from deepinfer.kvstore.host import HostKVCache
from deepinfer.kvstore.store import KVBlockStore
from deepinfer.kvstore.tiers import TieredKVStore

__all__ = ["HostKVCache", "KVBlockStore", "KVLayout", "RetentionPolicy", "TieredKVStore"]
