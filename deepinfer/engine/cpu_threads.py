"""The model's CPU thread count, following the cores other processes leave free.

torch's OpenMP pool (libgomp, shared with deepinfer's C kernels) runs hundreds of parallel regions per
decode step, each ending at a barrier where the workers spin until the slowest thread arrives. When
another process keeps one of the cores busy, one of our threads time-shares that core and every barrier
waits for its turn: offline chat 64x128 on 2 cores fell from ~1,100 to ~300 tok/s beside one
`while True: pass` (issue #22). Making the pool wait passively (OMP_WAIT_POLICY=PASSIVE) avoids the
collapse but pays a futex wake-up per region on an idle machine: single stream 150 -> 55 tok/s there. So
the wait policy stays libgomp's and the thread count follows the free cores instead (measured side by
side in benchmarks/BENCHMARKS.md, "Co-located load").

Every `interval` seconds the governor reads the machine's busy CPU time (/proc/stat) and this process's
own (`time.process_time`); what other processes used is the difference. threads = the cores they leave
free (rounded up from 0.7 of a core, at least 1, at most the starting count), applied once consecutive
windows that agree cover `2 * interval` seconds, so a burst shorter than that does not flip it. A window
is the time between two ticks: one tick per forward, so a window is at least one step long, and one long
step (a 2,048-token prefill takes ~1.3 s on 2 cores) is evidence enough on its own; counting two windows
instead held the wrong count for two whole long steps (measured under guidellm, whose own start-up keeps
~0.6 of a core busy for the first ~6 s: the server's first wave of 32 prompts; BENCHMARKS.md, "Server:
the cold first wave"). Between steps the engine loop ticks while it waits for work (`idle_tick`), so the
first step after an idle spell starts from what other processes do now, not from an average reaching
back to the last step. It is called on the thread that runs the forward (torch's OpenMP thread count is
per calling thread). Off where /proc/stat is missing, and for a user's explicit `num_threads` or
deterministic mode (a row's numerics must not depend on when others ran).
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

# another process using more than this share of a core takes that core away from us
FREE_CORE_SLACK = 0.3


def threads_for(others_cores: float, cpu_count: int, max_threads: int) -> int:
    """Threads to run when other processes used `others_cores` cores on average (of `cpu_count`)."""
    free = cpu_count - max(0.0, others_cores)
    return max(1, min(max_threads, int(free + FREE_CORE_SLACK)))


def _busy_seconds() -> float | None:
    """All CPUs' non-idle time since boot, in seconds (None without /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    # guest time is already counted in user / nice
    busy = sum(v[:8]) - idle if len(v) >= 8 else sum(v) - idle
    return busy / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Adjusts `torch.set_num_threads` on the forward's thread from what other processes use."""

    def __init__(self, max_threads: int | None = None, interval: float = 0.25, enabled: bool = True) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.cpu_count = os.cpu_count() or self.max_threads
        self.interval = interval
        self.enabled = enabled and self.max_threads > 1 and _busy_seconds() is not None
        self.threads = self.max_threads
        self.changes = 0
        self.others: float | None = None  # cores other processes used over the last window (None: none yet)
        self._last: tuple[float, float, float] | None = None  # wall, machine busy, own cpu
        self._candidate: int | None = None
        self._evidence = 0.0  # seconds of consecutive windows that proposed `_candidate`

    def tick(self) -> int:
        """Call before each forward; returns the thread count in force."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        busy, own = _busy_seconds(), time.process_time()
        if busy is None:
            return self.threads
        if self._last is not None:
            wall0, busy0, own0 = self._last
            self.others = ((busy - busy0) - (own - own0)) / (now - wall0)
            self._propose(threads_for(self.others, self.cpu_count, self.max_threads), self.others, now - wall0)
        self._last = (now, busy, own)
        return self.threads

    def _propose(self, target: int, others: float, window: float) -> None:
        if target == self.threads:
            self._candidate = None
            return
        if self._candidate != target:
            self._candidate, self._evidence = target, 0.0
        self._evidence += window
        if self._evidence < 2 * self.interval:  # wait until the agreeing windows outlast a burst
            return
        logger.info("other processes use %.1f of %d cores: model threads %d -> %d", others, self.cpu_count,
                    self.threads, target)
        torch.set_num_threads(target)
        self.threads = target
        self.changes += 1
        self._candidate = None
