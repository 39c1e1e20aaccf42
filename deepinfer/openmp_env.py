"""How the OpenMP thread pools wait between parallel regions: passive (sleep) unless the user says otherwise.

torch (intra-op threads, MKL, oneDNN) and deepinfer's C kernels (`deepinfer/layers/*.c`, built with
`-fopenmp`) share one OpenMP runtime, GNU libgomp. By default its idle workers spin at every barrier
for ~300,000 iterations (several milliseconds) before sleeping, and a decode step runs hundreds of
parallel regions. That is fine on cores nobody else wants; when another process keeps a core busy,
the spinning worker and the other process time-share that core, each region waits for the
descheduled worker's turn, and throughput collapsed: 10x slower with one `while True: pass`
beside it on 2 cores, while a passive pool lost nothing (`benchmarks/BENCHMARKS.md`, issue #22).

libgomp reads its wait policy once, when the library loads (at `import torch`), and offers no call
to change it later, so `apply()` runs from `deepinfer/__init__.py` before anything imports torch,
and also sets it for every process this one starts (the server's engine process, cluster workers),
which inherit the environment. A user's own `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` wins. Where
torch was imported before deepinfer, this process keeps the spinning pool (a log line says so);
its child processes still get the passive one.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose a wait policy. True when this process's
    OpenMP runtime will use the value set here (torch not imported yet)."""
    if any(v in os.environ for v in WAIT_POLICY_VARS):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if "torch" in sys.modules:
        logger.info("torch was imported before deepinfer: this process's OpenMP threads keep spinning "
                    "while idle (slow when other processes share the cores); set OMP_WAIT_POLICY=PASSIVE "
                    "before starting Python, or import deepinfer first")
        return False
    return True
