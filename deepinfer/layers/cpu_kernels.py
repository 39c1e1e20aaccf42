"""The C kernels for x86 CPUs: compiled once with the system's gcc, loaded with ctypes.

Sources: `gguf_gemm.c` (matmuls from GGUF quantized blocks), `panel_gemm.c` (float32 matmuls on
weights packed in 16-feature panels, AVX2 CPUs), `paged_attention.c` (decode
attention reading the paged KV cache in place; its bf16 path on AMX tiles in `paged_attention_amx.c`) and `elementwise.c` (fused residual + RMSNorm,
rotary, SiLU-and-multiply, row argmax, categorical sampling, grammar token masks), and `decode_layer.c` (a whole decoder layer for a few
decoding sequences, composed of the others, and the whole layer stack in one call). They are built into one shared
library with `-march=native`, so the cache key holds the sources, the flags and the CPU's
model and feature flags: a cache directory moved to another machine rebuilds. The library goes to
`<cache dir>/kernels` ($DEEPINFER_CACHE_DIR or ~/.cache/deepinfer), never next to the sources, so an
installed (read-only) package works; a log line at INFO names the library loaded. ctypes
releases the GIL during each call. Where building is impossible (not x86-64, no AVX2, no
gcc) `load_library()` returns None and callers use their pure-torch path.
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
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_NAMES = ("gguf_gemm.c", "panel_gemm.c", "paged_attention.c", "paged_attention_amx.c", "elementwise.c",
                "decode_layer.c")
HEADER_NAMES = ("cpu_common.h",)
_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


def _cpu_identity() -> str | None:
    """The CPU's model and flags lines, or None when the CPU lacks AVX2/FMA."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    flags = lines[-1] if lines else ""
    if " avx2 " not in f"{flags} " or " fma " not in f"{flags} ":
        return None
    return "\n".join(lines)


def _build(target: Path, sources: list[Path]) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    result = subprocess.run(["gcc", *_FLAGS, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        logger.warning("could not compile the CPU kernels: %s", result.stderr[-500:])
        return False
    os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    return True


def load_library() -> ctypes.CDLL | None:
    """Compile (once per sources + CPU) and load the kernels; None where unavailable."""
    global _lib
    if _lib is False:
        _lib = load_library_from(Path(__file__).parent)
    return _lib  # type: ignore[return-value]


def load_library_from(directory: Path) -> ctypes.CDLL | None:
    """Compile (once per sources + CPU) and load the kernels whose sources lie in `directory`, uncached
    (load_library serves this package's; benchmarks/kernels_ab.py loads a second build beside it)."""
    sources = [directory / n for n in SOURCE_NAMES]
    cpu = _cpu_identity()
    if platform.machine() not in ("x86_64", "AMD64") or cpu is None or shutil.which("gcc") is None:
        logger.info("CPU kernels unavailable (need x86-64 with AVX2 and gcc); using torch ops")
        return None
    from deepinfer.weights.loader import cache_root

    key = hashlib.blake2b(digest_size=8)
    for src in sources + [directory / n for n in HEADER_NAMES]:
        key.update(src.read_bytes())
    key.update(" ".join(_FLAGS).encode())
    key.update(cpu.encode())
    target = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()}.so"
    if not target.exists():
        if not _build(target, sources):
            return None
        logger.info("compiled the CPU kernels from %s", directory)
    lib = ctypes.CDLL(str(target))
    logger.info("CPU kernels loaded from %s", target)
    # pointers travel as plain ints (tensor.data_ptr()): ctypes.cast per argument cost ~1.5 us a call
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.q4_1_gemm.argtypes = [vp, i, i, vp, vp, vp, vp, i, vp, i]
    lib.q8_0_gemm.argtypes = [vp, i, i, vp, vp, vp, i, vp, i]
    if hasattr(lib, "gguf_amx_gemm"):  # AMX builds only
        lib.gguf_amx_gemm.argtypes = [vp, i, i, i, vp, vp, vp, vp, i]
        lib.gguf_amx_gemm.restype = i
        lib.gguf_amx_gemm_silu.argtypes = [vp, i, i, i, vp, vp, vp, vp, i]
        lib.gguf_amx_gemm_silu.restype = i
    lib.dense_gemm.argtypes = [vp, i, i, vp, vp, i, vp, i]
    lib.max_rows.restype = i
    if hasattr(lib, "gguf_rows_take_fmas"):  # AVX-512 BF16 builds only
        lib.gguf_rows_take_fmas.restype = i
    lib.panel_gemm_f32.argtypes = [vp, i, i, vp, vp, i]
    lib.panel_gemm_f32_silu.argtypes = [vp, i, i, vp, vp, i]
    lib.panel_gemm_f32_silu.restype = i
    lib.panel_gemm_bf16_silu.argtypes = [vp, i, i, vp, vp, i]
    lib.panel_gemm_bf16_silu.restype = i
    lib.panel_gemm_preferred.restype = i
    lib.panel_gemm_bf16.argtypes = [vp, i, i, vp, vp, vp, i, i]
    lib.panel_gemm_bf16.restype = i
    lib.panel_gemm_bf16_vector.argtypes = [vp, i, i, vp, vp, vp, i, i]
    lib.panel_gemm_bf16_vector.restype = i
    lib.amx_tiles_granted.restype = i
    lib.panel_gemm_bf16_preferred.restype = i
    lib.panel_gemm_bf16_supported.restype = i
    lib.paged_decode_attention.argtypes = [vp, vp, vp, vp, vp, i, vp, i, i, i, i, i, ctypes.c_float, i,
                                           ctypes.c_int64, vp]
    lib.paged_decode_attention.restype = i
    lib.paged_decode_attention_vector.argtypes = lib.paged_decode_attention.argtypes
    lib.paged_decode_attention_vector.restype = i
    lib.rms_norm.argtypes = [vp, vp, vp, vp, i, i, ctypes.c_float, i]
    lib.rotary_qk.argtypes = [vp, ctypes.c_int64, i, vp, ctypes.c_int64, i, i, i, vp, vp, i]
    lib.rope_kv_write.argtypes = [vp, i, i, i, i, vp, vp, vp, vp, vp, vp, i]
    lib.silu_mul.argtypes = [vp, vp, i, i, i]
    lib.argmax_rows.argtypes = [vp, i, i, vp, i]
    lib.sample_rows.argtypes = [vp, i, vp, i, i, vp, vp, i, vp]
    lib.apply_token_bitmask.argtypes = [vp, i, vp, i, vp, i, i]
    lib.decode_layer.argtypes = [vp, vp, vp, i, i, vp, vp, vp, vp, i, vp, vp, vp, i]
    lib.decode_layer.restype = i
    lib.decode_layers.argtypes = [vp, i, vp, vp, vp, vp, vp, i, vp, vp, vp, vp, i, vp, vp, i, vp, vp, vp, i, vp,
                                  vp, ctypes.c_float, vp, i, vp]
    lib.decode_layers.restype = i
    lib.decode_steps.argtypes = [vp, i, vp, vp, vp, vp, vp, i, vp, vp, vp, vp, i, vp, vp, i, vp, vp, vp, i, vp,
                                 vp, ctypes.c_float, vp, vp, vp, vp, i, vp, i, vp]
    lib.decode_steps.restype = i
    lib.ngram_lookup.argtypes = [vp, ctypes.c_int64, i, i, ctypes.c_int64, vp]
    lib.ngram_lookup.restype = i
    lib.spec_decode_steps.argtypes = [vp, i, vp, vp, vp, i, vp, vp, vp, vp, vp, vp, i, vp, vp, ctypes.c_float, vp, vp,
                                      vp, i, vp, vp, vp, vp, vp, vp, i, i, vp, vp, i, i, ctypes.c_int64, vp, i, vp,
                                      vp, vp, vp]
    lib.spec_decode_steps.restype = i
    return lib


def dtype_code(dtype: torch.dtype) -> int | None:
    """The kernels' element-type code, or None for a dtype they do not handle."""
    return {torch.float32: 0, torch.bfloat16: 1}.get(dtype)


def kernels_for(t: torch.Tensor) -> tuple[ctypes.CDLL, int] | None:
    """The loaded kernels and `t`'s element-type code when they can take `t` (a CPU tensor of a
    dtype they handle); None otherwise, and the caller uses its torch path."""
    code = dtype_code(t.dtype)
    if code is None or t.device.type != "cpu":
        return None
    lib = load_library()
    return None if lib is None else (lib, code)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> bool:
    """Set logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in `rows` (in place; xgrammar's
    packing). False, untouched, where the kernel cannot take these tensors: the caller falls back.
    xgrammar's own CPU apply took 6-10 ms for 32 x 49152 logits on a 2-core Xeon; this loop skips
    fully-allowed words and fills fully-forbidden ones."""
    lib = load_library()
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not logits.is_contiguous() or bitmask.dtype != torch.int32 or not bitmask.is_contiguous()
            or bitmask.device.type != "cpu" or bitmask.shape[0] < logits.shape[0]
            or bitmask.shape[1] * 32 < min(vocab, logits.shape[1])):
        return False
    idx = torch.tensor(rows, dtype=torch.long)
    lib.apply_token_bitmask(logits.data_ptr(), logits.shape[1], bitmask.data_ptr(), bitmask.shape[1],
                            idx.data_ptr(), len(rows), min(vocab, logits.shape[1]))
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for a 2-D float32 or bfloat16 CPU tensor (the first index on ties; NaNs are
    skipped unless a row starts with one); the kernel splits rows over threads and scans 16 values
    per instruction (64 x 49152 float32 logits: torch's argmax 3.5 ms on a 2-core Xeon, the scalar
    kernel 1.9 ms on one Zen 5 core, the vector one ~0.2 ms). A bfloat16 row gives the answer its
    float32 copy would (widening is exact), reading half the bytes."""
    lib = load_library()
    code = dtype_code(x.dtype)
    if lib is None or x.device.type != "cpu" or code is None or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), code)
    return out


def sample_rows(x: torch.Tensor, rows: list[int], uniforms: torch.Tensor,
                inv_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """One token per listed row of a 2-D float32 tensor, drawn by inverse CDF with the row's uniform
    in [0, 1) (`uniforms`, float64, one per listed row).

    With `inv_temperature` (float32, one per listed row) `x` holds logits and the distribution is
    softmax(x * inv_temperature); without it `x` holds unnormalised probabilities. Tokens of weight
    0 (-inf logits, zero probabilities) are never drawn. One uniform per row, rather than noise over
    the whole vocabulary, is what makes this cheap: torch's exponential_ over 32 x 49152 took 39 ms
    on a 2-core Xeon, the kernel about 1 ms for the whole draw."""
    if not rows:
        return torch.empty(0, dtype=torch.long)
    lib = load_library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return _sample_rows_torch(x, rows, uniforms, inv_temperature)
    index = torch.tensor(rows, dtype=torch.long)
    u = uniforms.to(torch.float64).contiguous()
    temp = None if inv_temperature is None else inv_temperature.to(torch.float32).contiguous()
    out = torch.empty(len(rows), dtype=torch.long)
    lib.sample_rows(x.data_ptr(), x.stride(0), index.data_ptr(), len(rows), x.shape[1],
                    None if temp is None else temp.data_ptr(), u.data_ptr(), int(temp is not None), out.data_ptr())
    return out


def _sample_rows_torch(x: torch.Tensor, rows: list[int], uniforms: torch.Tensor,
                       inv_temperature: torch.Tensor | None) -> torch.Tensor:
    sub = x[rows].float()
    if inv_temperature is not None:
        weights = torch.softmax(sub * inv_temperature.float().unsqueeze(1), dim=-1)
    else:
        weights = sub.clamp_min(0.0).nan_to_num(0.0)
    cdf = weights.double().cumsum(dim=-1)
    target = uniforms.double().unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # rounding can put the target at the very end; a zero-weight row falls back to its largest value
    picked = torch.minimum(picked, (weights > 0).int().cumsum(-1).argmax(-1))
    return torch.where(cdf[:, -1] > 0, picked, sub.argmax(dim=-1))
