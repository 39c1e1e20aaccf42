"""The thread governor (`deepinfer/engine/cpu_threads.py`): the model's thread count follows the cores
other processes leave free, read from the real /proc/stat with a real spinning process beside it."""

import os
import subprocess
import sys
import time

import pytest
import torch

from deepinfer.engine.cpu_threads import ThreadGovernor, threads_for


def test_threads_for_leaves_the_cores_others_use():
    assert threads_for(0.0, 2, 2) == 2
    assert threads_for(0.5, 2, 2) == 1  # half a core taken: a barrier would wait on it
    assert threads_for(0.2, 2, 2) == 2  # a little background work does not cost a thread
    assert threads_for(1.0, 2, 2) == 1
    assert threads_for(5.0, 2, 2) == 1  # never below one
    assert threads_for(3.0, 16, 8) == 8  # enough free cores: the configured count
    assert threads_for(10.0, 16, 8) == 6


def _others_busy(seconds: float = 1.0) -> float:
    """Cores other processes used over `seconds` (the governor's own measure, taken by a second one)."""
    before = torch.get_num_threads()
    probe = ThreadGovernor(max_threads=2, interval=0.0)
    probe.tick()
    time.sleep(seconds)
    probe.tick()  # one window of `seconds` is evidence enough for it to set torch's count: put it back
    torch.set_num_threads(before)
    return probe.others


def _settle(gov: ThreadGovernor, want: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and gov.tick() != want:
        time.sleep(0.05)
    return gov.threads


@pytest.mark.skipif(not os.path.exists("/proc/stat") or (os.cpu_count() or 1) != 2,
                    reason="reads /proc/stat; the thresholds below are for a 2-core machine")
def test_a_spinning_process_takes_a_thread_and_gives_it_back():
    if _others_busy() > 0.3:  # the governor would rightly keep one thread: nothing here to observe
        pytest.skip("other processes keep a core of this machine busy")
    before = torch.get_num_threads()
    gov = ThreadGovernor(max_threads=2, interval=0.25)
    assert gov.enabled and gov.threads == 2
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert _settle(gov, 1) == 1
        assert torch.get_num_threads() == 1
    finally:
        spinner.kill()
        spinner.wait()
    try:
        if _settle(gov, 2) != 2 and _others_busy() > 0.3:
            pytest.skip("another process started keeping a core busy during the test")
        assert gov.threads == 2
        assert gov.changes == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat") or (os.cpu_count() or 1) != 2,
                    reason="reads /proc/stat; the thresholds below are for a 2-core machine")
def test_evidence_is_counted_in_seconds_not_windows():
    """One window as long as a long prefill step decides on its own; windows shorter than 2 x interval
    must add up first (a burst does not flip the count)."""
    if _others_busy() > 0.3:
        pytest.skip("other processes keep a core of this machine busy")
    before = torch.get_num_threads()
    gov = ThreadGovernor(max_threads=2, interval=0.25)
    gov.tick()  # opens the first window
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.8)
        gov.tick()
        assert gov.threads == 1 and gov.changes == 1  # one 0.8 s window with a core taken
    finally:
        spinner.kill()
        spinner.wait()
    try:
        gov.tick()  # the window the spinner ended in
        time.sleep(0.3)
        gov.tick()  # 0.3 s free: not yet evidence enough
        if _others_busy(0.3) > 0.3:
            pytest.skip("another process started keeping a core busy during the test")
        assert gov.threads == 1
        time.sleep(0.3)
        gov.tick()  # 0.6 s of agreeing windows
        assert gov.threads == 2 and gov.changes == 2
    finally:
        torch.set_num_threads(before)


def test_on_by_default_off_for_an_explicit_thread_count(tiny_models):
    from deepinfer import LLM

    before = torch.get_num_threads()
    common = dict(model=str(tiny_models["llama"]), kv_store="none", kv_cache_memory="16MiB",
                  profile_cost_model=False)
    try:
        for extra, on in (({}, before > 1), ({"num_threads": 1}, False)):
            llm = LLM(**common, **extra)
            try:
                assert llm.engine.core.runner.threads.enabled is on, extra
            finally:
                llm.close()
    finally:
        torch.set_num_threads(before)


def test_an_idle_engine_keeps_measuring(tiny_models):
    """Between requests the engine loops call `idle_tick`: the governor's window then ends now, not at the
    last step (cpu_threads.py)."""
    from deepinfer import LLM

    before = torch.get_num_threads()
    llm = LLM(model=str(tiny_models["llama"]), kv_store="none", kv_cache_memory="16MiB", profile_cost_model=False)
    try:
        gov = llm.engine.core.runner.threads
        if not gov.enabled:
            pytest.skip("the governor is off here (one thread or no /proc/stat)")
        llm.engine.core.idle_tick()
        time.sleep(gov.interval + 0.05)
        llm.engine.core.idle_tick()
        assert gov.others is not None  # a window was measured without any step running
    finally:
        llm.close()
        torch.set_num_threads(before)
