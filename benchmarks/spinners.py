"""Co-located load for the contention benchmarks: N processes that each keep one core busy.

`spinning(n)` starts n `python -c "while True: pass"` processes (what issue #22 measured with) and stops
them when the block ends, however it ends. Standard library only: `baselines/vllm_runner.py` imports
it from the vLLM venv too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def spinning(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.3)  # let them start spinning before the timed region
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
