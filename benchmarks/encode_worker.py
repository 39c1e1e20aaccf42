"""An encode worker's footprint: start-up time, resident memory and seconds per tile, for one checkpoint.

Starts `deepinfer serve --role encode` on a vision-language checkpoint (default: `benchmarks/vision.py`'s
SmolVLM-256M-shaped one), waits for its /internal/load, then posts `--calls` encode calls of one new random image
each (one 512 x 512 tile) and reports: seconds from launch to the first answered load poll, the resident memory
(RSS, summed over the worker's process tree) once ready, after the calls and after `--settle` idle seconds, and the
median seconds of a call.
Run from two checkouts with `benchmarks/ab.py` to compare them:

    python benchmarks/ab.py --a /tmp/before --b . --rounds 3 -- benchmarks/encode_worker.py --json-out {json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def one_tile(model: str, seed: int) -> dict:
    """The wire form of one new random image's tile, as the router sends it."""
    from transformers import AutoConfig
    from vision import image

    from deepinfer.models.registry import image_facts
    from deepinfer.multimodal.processor import MultiModalProcessor

    processor = MultiModalProcessor(Path(model), *image_facts(AutoConfig.from_pretrained(model)))
    _, inputs = processor("<image>Describe it.", [image(seed)], add_special_tokens=True)
    return inputs.to_wire()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="A vision-language checkpoint (default: vision.py's).")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--settle", type=float, default=20.0, help="Seconds idle after the calls, then RSS again.")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.model is None:
        from vision import build_checkpoint

        args.model = str(build_checkpoint(Path.home() / ".cache/deepinfer/bench-smolvlm-256m-shape"))
    bodies = [{"multi_modal": one_tile(args.model, 5000 + i)} for i in range(args.calls)]
    base = f"http://127.0.0.1:{args.port}"
    started = time.monotonic()
    worker = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "--log-level", "WARNING", "serve", "--role",
                               "encode", "--model", args.model, "--port", str(args.port), "--dtype", "float32",
                               "--num-threads", "2"])
    try:
        while True:
            if worker.poll() is not None:
                raise SystemExit(f"the encode worker exited ({worker.returncode})")
            try:
                if httpx.get(f"{base}/internal/load", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ready = time.monotonic() - started
        rss_ready = tree_rss(worker.pid)
        seconds = []
        for body in bodies:
            t = time.monotonic()
            httpx.post(f"{base}/internal/encode", json=body, timeout=120).raise_for_status()
            seconds.append(time.monotonic() - t)
        rss_after = tree_rss(worker.pid)
        time.sleep(args.settle)  # an engine keeps touching memory for a while after it answers
        rss_settled = tree_rss(worker.pid)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    out = {"ready_seconds": ready, "rss_ready_mib": rss_ready / 2**20, "rss_after_mib": rss_after / 2**20,
           "rss_settled_mib": rss_settled / 2**20,
           "call_seconds_median": statistics.median(seconds)}
    print(json.dumps(out))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
