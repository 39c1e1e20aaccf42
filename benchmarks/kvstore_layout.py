"""KV store object layout: one file per block vs segments of N blocks, side by side.

For each ``--segment-blocks`` value, on a fresh store directory, with real KV block
sizes (default: SmolLM2-135M in float32, 720 KiB per 16-token block):

* ``one put``  -- a ``--blocks``-block prefix written by one `put`, then looked up and read back;
* ``8 turns``  -- the same prefix written as an agent's growing history: 8 puts, each
  extending the previous one (only new blocks are written).

It prints files and directories created, write time per block (fsync included
unless ``--no-fsync``), and for a lookup (`contains_prefix`) and a read (`get`) of
the whole prefix: time and metadata operations (open + listdir calls). Times are
on the local filesystem with a warm page cache; on NFS / Lustre / 3FS each
metadata operation is a server round trip, so the op counts are what scales.

    python benchmarks/kvstore_layout.py --blocks 128 --segment-blocks 1,4,16
"""

from __future__ import annotations

import argparse
import builtins
import os
import shutil
import tempfile
import time
from pathlib import Path

from deepinfer.kvcache import KVBlockStore, KVLayout
from deepinfer.kvcache import store as store_mod
from deepinfer.kvcache.hashing import extend_block_hashes, root_hash


class OpCounter:
    """Counts open() and os.listdir() calls made by the store module while active."""

    def __init__(self) -> None:
        self.ops = 0

    def __enter__(self) -> OpCounter:
        real_open, real_listdir = builtins.open, os.listdir

        def counting_open(*a, **kw):
            self.ops += 1
            return real_open(*a, **kw)

        def counting_listdir(*a, **kw):
            self.ops += 1
            return real_listdir(*a, **kw)

        self._restore = (real_listdir,)
        store_mod.open = counting_open  # module global shadows the builtin
        os.listdir = counting_listdir
        return self

    def __exit__(self, *exc) -> None:
        del store_mod.open
        os.listdir = self._restore[0]


def run(root: Path, layout: KVLayout, blocks: int, segment_blocks: int, turns: int, fsync: bool) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(blocks * layout.block_size)), layout.block_size,
                        root_hash("bench", layout.key))
    payloads = [os.urandom(64) * (layout.block_nbytes // 64) for _ in range(min(blocks, 8))]
    payloads = [payloads[i % len(payloads)] for i in range(blocks)]
    store = KVBlockStore(root, "bench", layout, 1 << 40, segment_blocks=segment_blocks, fsync=fsync)
    cuts = [round(blocks * (t + 1) / turns) for t in range(turns)]
    t0 = time.perf_counter()
    prev = 0
    for cut in cuts:
        store.put(hashes[:cut], payloads[prev:cut], start=prev)
        prev = cut
    write_s = time.perf_counter() - t0
    files = sum(len(f) for _, _, f in os.walk(root / "objects"))
    dirs = sum(len(d) for _, d, _ in os.walk(root / "objects"))
    with OpCounter() as lookup_ops:
        t0 = time.perf_counter()
        found = store.lookup(hashes)
        lookup_s = time.perf_counter() - t0
    with OpCounter() as get_ops:
        t0 = time.perf_counter()
        got = store.load(hashes)
        get_s = time.perf_counter() - t0
    assert found == blocks and len(got) == blocks, (found, len(got))
    return {"files": files, "dirs": dirs, "write_ms_per_block": write_s / blocks * 1e3,
            "lookup_ms": lookup_s * 1e3, "lookup_ops": lookup_ops.ops, "get_ms_per_block": get_s / blocks * 1e3,
            "get_ops": get_ops.ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=128, help="Blocks in the prefix (default 128 = 2048 tokens).")
    ap.add_argument("--segment-blocks", default="1,16", help="Comma-separated segment sizes to compare.")
    ap.add_argument("--layout", default="float32,16,30,3,64",
                    help="dtype,block_size,layers,kv_heads,head_dim (default: SmolLM2-135M float32).")
    ap.add_argument("--dir", default=None, help="Where to create the stores (default: a temp dir).")
    ap.add_argument("--no-fsync", action="store_true", help="Skip fsync on writes.")
    args = ap.parse_args()
    dtype, *sizes = args.layout.split(",")
    layout = KVLayout(dtype, *map(int, sizes))
    base = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir))
    print(f"layout {layout.key}: {layout.block_nbytes / 2**10:.0f} KiB per block, {args.blocks} blocks, "
          f"fsync {'off' if args.no_fsync else 'on'}, dir {base}")
    header = (f"{'layout':<16}{'workload':<10}{'files':>7}{'dirs':>7}{'write ms/blk':>14}"
              f"{'lookup ms':>11}{'lookup ops':>12}{'get ms/blk':>12}{'get ops':>9}")
    print(header)
    print("-" * len(header))
    try:
        for n in map(int, args.segment_blocks.split(",")):
            name = "file per block" if n == 1 else f"segments of {n}"
            for workload, turns in (("one put", 1), ("8 turns", 8)):
                r = run(base / f"s{n}", layout, args.blocks, n, turns, not args.no_fsync)
                print(f"{name:<16}{workload:<10}{r['files']:>7}{r['dirs']:>7}{r['write_ms_per_block']:>14.2f}"
                      f"{r['lookup_ms']:>11.2f}{r['lookup_ops']:>12}{r['get_ms_per_block']:>12.2f}{r['get_ops']:>9}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
