"""deepinfer makes the OpenMP pool wait passively (`deepinfer/openmp_env.py`): measured by what an
idle pool costs, in fresh processes (libgomp reads the policy once, when torch loads)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# 200 small parallel regions 2 ms apart: a spinning pool burns CPU in every gap, a passive one sleeps.
# Prints the wait policy in the environment and CPU seconds per wall second over the loop.
PROBE = """
import os, sys, time
{first}
import torch
torch.set_num_threads(2)
x = torch.zeros(1 << 21)
x.add_(1)
w0, c0 = time.perf_counter(), time.process_time()
for _ in range(200):
    x.add_(1)
    time.sleep(0.002)
print(os.environ.get("OMP_WAIT_POLICY"), (time.process_time() - c0) / (time.perf_counter() - w0))
"""


def probe(first: str, **env: str) -> tuple[str, float]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                         env={**base, "PYTHONPATH": str(ROOT), **env}, timeout=120, check=True).stdout.split()
    return out[0], float(out[1])


def test_import_makes_the_pool_passive_and_a_user_choice_wins():
    policy, passive = probe("import deepinfer")
    assert policy == "PASSIVE"
    policy, active = probe("import deepinfer", OMP_WAIT_POLICY="ACTIVE")
    assert policy == "ACTIVE"  # the user's setting is kept
    # on an idle machine ~0.1 vs ~1.0 CPU s/s; the margin leaves room for a loaded one
    assert passive < 0.6 * active, (passive, active)


@pytest.mark.slow
def test_torch_imported_first_keeps_spinning_here():
    """The environment is set (child processes get it) but this process's runtime already loaded."""
    _, passive = probe("import deepinfer")
    policy, late = probe("import torch\nimport deepinfer")
    assert policy == "PASSIVE"
    assert late > 1.5 * passive, (passive, late)
