"""Co-located load for the contention benchmarks: N processes that each keep one core busy.

`spinning(n)` starts n processes running a pure-Python busy loop (issue #22 measured with
`python3 -c "while True: pass"`) and stops them when the block ends. Each also checks every ~50 ms
that its parent lives and exits when not, so a benchmark killed by a signal leaves none behind. Standard library only: `baselines/vllm_runner.py` imports
it from the vLLM venv too.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


@contextmanager
def spinning(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.3)  # let them start spinning before the timed region
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
