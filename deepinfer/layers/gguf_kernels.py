"""GGUF block-quantized weights used as they are, for small-batch decode on x86 CPUs.

A step that decodes a few sequences is bound by reading weights from memory. Keeping the
GGUF file's Q4_1 / Q8_0 blocks (5-6x fewer bytes than float32) and multiplying them with
the AVX2 kernels in `gguf_gemm.c` makes those steps several times faster. Larger batches
are compute-bound and keep using the float32 weights with the BLAS matmul.

The C file is compiled once with the system's gcc into the deepinfer cache dir and loaded
with ctypes (which releases the GIL during the call). Where that is impossible (no gcc,
no AVX2), `load_library()` returns None and everything runs on the float32 path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("gguf_gemm.c")
QK = 32
_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2 " in flags and " fma " in flags


def load_library() -> ctypes.CDLL | None:
    """Compile (once, cached by source hash) and load the kernels; None where unavailable."""
    global _lib
    if _lib is not False:
        return _lib  # type: ignore[return-value]
    _lib = None
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_avx2() or shutil.which("gcc") is None:
        logger.info("GGUF kernels unavailable (needs x86-64 with AVX2 and gcc); using float32 weights")
        return None
    from deepinfer.weights.loader import cache_root

    digest = hashlib.blake2b(_SOURCE.read_bytes(), digest_size=8).hexdigest()
    target = cache_root() / "kernels" / f"gguf_gemm-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = ["gcc", "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(_SOURCE), "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            logger.warning("could not compile GGUF kernels: %s", result.stderr[-500:])
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    f32p, u8p = ctypes.POINTER(ctypes.c_float), ctypes.c_void_p
    lib.q4_1_gemm.argtypes = [f32p, ctypes.c_int, ctypes.c_int, u8p, f32p, f32p, f32p, ctypes.c_int, f32p]
    lib.q8_0_gemm.argtypes = [f32p, ctypes.c_int, ctypes.c_int, u8p, f32p, f32p, ctypes.c_int]
    lib.max_rows.restype = ctypes.c_int
    _lib = lib
    return lib


def _ptr(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))


@dataclass
class QuantizedWeight:
    """One [N, K] weight in GGUF blocks: `qs` packed quants, `d` scales, `mn` offsets (Q4_1 only)."""

    kind: str  # "q4_1" | "q8_0"
    qs: torch.Tensor
    d: torch.Tensor
    mn: torch.Tensor | None
    n: int
    k: int

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along output rows (fused Q/K/V or gate/up projections)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.k for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different quantization or width")
        return cls(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                   None if parts[0].mn is None else torch.cat([p.mn for p in parts]), sum(p.n for p in parts),
                   parts[0].k)

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        idx = torch.from_numpy(order)
        return QuantizedWeight(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                               None if self.mn is None else self.mn[idx].contiguous(), self.n, self.k)

    def dequantize(self) -> torch.Tensor:
        """Float32 [N, K] (used by tests to check the kernels and the layout)."""
        nb = self.k // QK
        if self.kind == "q4_1":
            q = self.qs.view(self.n, nb, 16)
            vals = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
            return (vals * self.d.unsqueeze(-1) + self.mn.unsqueeze(-1)).view(self.n, self.k)
        return (self.qs.view(torch.int8).view(self.n, nb, QK).float() * self.d.unsqueeze(-1)).view(self.n, self.k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 with M <= 8 -> [M, N] float32."""
        lib = load_library()
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.float32)
        if self.kind == "q4_1":
            scratch = torch.empty(m * (self.k // QK), dtype=torch.float32)
            lib.q4_1_gemm(_ptr(x), m, self.k, self.qs.data_ptr(), _ptr(self.d), _ptr(self.mn), _ptr(y), self.n,
                          _ptr(scratch))
        else:
            lib.q8_0_gemm(_ptr(x), m, self.k, self.qs.data_ptr(), _ptr(self.d), _ptr(y), self.n)
        return y


def max_rows() -> int:
    lib = load_library()
    return lib.max_rows() if lib is not None else 0


def read_quantized_tensors(gguf_path: Path) -> dict[str, QuantizedWeight]:
    """The Q4_1 and Q8_0 tensors of a GGUF file by GGUF name (other types are skipped)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind not in ("q4_1", "q8_0"):
            continue
        k, n = (int(v) for v in t.shape[:2])  # GGUF lists dims innermost first
        nb = k // QK
        raw = np.asarray(t.data, dtype=np.uint8).reshape(n, nb, -1)
        d = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, nb))
        if kind == "q4_1":
            mn = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, nb))
            qs = torch.from_numpy(raw[:, :, 4:20].copy().reshape(n, nb * 16))
        else:
            mn = None
            qs = torch.from_numpy(raw[:, :, 2:34].copy().reshape(n, k))
        out[t.name] = QuantizedWeight(kind, qs, d, mn, n, k)
    return out


def llama_unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's Q/K permutation (rotary pairs interleaved) for HF's layout."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)
