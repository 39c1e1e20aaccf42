"""Everything that holds, finds, moves or stores KV blocks.

Device side:
- `spec`     -- KV specs per layer group (full attention, sliding window) a model declares
- `hashing`  -- chained block hashes: the one name a prefix has in every tier and process
- `pool`     -- `BlockPool`: refcounted device blocks, LRU free queue, hash -> block index
- `manager`  -- `KVCacheManager`: per-request block tables of every layer group, prefix lookup through
                the tiers, admission, registration, freeing
- `blocks`   -- gather / scatter one block between the paged device cache and a payload (imports torch)
- `exchange` -- export / import named blocks between engines (prefill/decode disaggregation)

Below the device, behind one interface (`tier.KVTier`: lookup / load / put):
- `host`     -- `HostKVCache`: a byte-bounded LRU map in host memory
- `store`    -- `KVBlockStore`: validated, content-addressed blocks on a filesystem path
- `format`   -- KV layout, retention classes, the on-disk segment header
- `space`    -- directory layout, the cross-process capacity bound, scan / gc / clear
- `tiered`   -- `TieredKVStore`: the chaining rule across host tier + store
- `writer`   -- `StoreWriter`: store writes on a background thread behind a byte-bounded queue
- `prefetch` -- `StorePrefetcher`: store reads ahead of admission on a background thread
- `engine_tiers` -- `KVTiers`: the tiers wired to one engine's device cache (write, evict, load)

Nothing outside this package reads a pool's or a tier's private state.
"""

from deepinfer.kvcache.format import KVLayout, RetentionPolicy
from deepinfer.kvcache.host import HostKVCache
from deepinfer.kvcache.store import KVBlockStore
from deepinfer.kvcache.tier import KVTier
from deepinfer.kvcache.tiered import TieredKVStore

__all__ = ["HostKVCache", "KVBlockStore", "KVLayout", "KVTier", "RetentionPolicy", "TieredKVStore"]
