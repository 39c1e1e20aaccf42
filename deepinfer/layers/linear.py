"""nn.Linear with CPU fast paths: GGUF quantized blocks for a few rows (see gguf_kernels); for
larger batches oneDNN's pre-packed bf16 / fp32 weights, or on AVX2-only CPUs in float32 the weights in
16-feature panels for `panel_gemm.c`; and a row-invariant mode
(`--deterministic`) where every batch size goes through the block kernel, whose result for a
row does not depend on the other rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.cpu_kernels import load_library
from deepinfer.layers.gguf_kernels import QuantizedWeight, max_rows

PANEL = 16  # output features per panel of panel_gemm.c


def _can_pack(weight: torch.Tensor) -> bool:
    if not (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # oneDNN's bf16 reorder refuses CPUs without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT): on an AVX2-only CPU
    # an explicit --dtype bfloat16 takes F.linear (torch emulates bf16 there)
    return weight.dtype != torch.bfloat16 or torch.backends.cpu.get_cpu_capability() == "AVX512"


def _panel_kernel_for(weight: torch.Tensor) -> bool:
    """Whether `panel_gemm.c` serves this weight: float32 on a CPU whose kernels prefer it (AVX2
    without AVX-512), output features a multiple of PANEL."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] % PANEL:
        return False
    lib = load_library()
    return lib is not None and bool(lib.panel_gemm_preferred())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]: panel j holds features 16j..16j+15, each k's 16 weights together."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def panel_matmul(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 times the weight packed by `pack_panels` -> [M, N] (the kernels must be loaded)."""
    x = x.contiguous()
    groups, k, _ = panels.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or panels.dtype != torch.float32:
        raise ValueError(f"panel_matmul needs float32 [M, {k}] activations, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty((x.shape[0], groups * PANEL), dtype=torch.float32)
    if x.shape[0]:
        load_library().panel_gemm_f32(x.data_ptr(), x.shape[0], k, panels.data_ptr(), y.data_ptr(), groups * PANEL)
    return y


class Linear(nn.Linear):
    """Float weights always present (reference path); `quantized`, when attached, serves CPU
    float32 / bfloat16 inputs of at most `max_rows()` rows; `pack()` adds a oneDNN-blocked
    copy of the weight, which skips the per-call weight reorder. bf16: measured 25-40% faster
    at 64 rows on an AMX Xeon, bit-identical output. fp32: torch's MKL sgemm repacks the weight
    every call and is slow at mid-size batches (576->3072 on a 2-core AVX-512 Xeon: 2.05 ms at
    32 rows, slower than 1.67 ms at 64); packed, 0.69 ms at 32 rows and never slower at 8-200
    rows; the sums are reassociated (differences ~1e-6 relative). float32 on an AVX2-only CPU: `pack()`
    builds 16-feature panels for `panel_gemm.c` instead (2 threads, 64 rows, on a 2-core EPYC: 185-192
    GFLOP/s against oneDNN's 101-134)."""

    quantized: QuantizedWeight | None = None
    _rows: int = 0
    _packed: torch.Tensor | None = None
    _panels: torch.Tensor | None = None
    row_invariant: bool = False
    dense_twin: QuantizedWeight | None = None  # row-invariant bf16: the same values dense (see _bf16_twin)

    def attach(self, weight: QuantizedWeight) -> None:
        if (weight.n, weight.k) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {weight.n}x{weight.k} != {tuple(self.weight.shape)}")
        self.quantized = weight
        self._rows = max_rows()

    def make_row_invariant(self) -> None:
        """Serve every batch size with the block kernel (its dense kind where no GGUF blocks are
        attached): each output row then depends on its input row alone, never on the batch.
        ValueError where the kernel cannot take this weight."""
        if self.quantized is None:
            self.quantized = QuantizedWeight.dense(self.weight)
        elif self.weight.dtype == torch.bfloat16:
            self.dense_twin = self._bf16_twin(self.quantized)
        self.row_invariant = True
        self._packed = self._panels = None

    def _bf16_twin(self, q: QuantizedWeight) -> QuantizedWeight:
        """The bf16 dense weight as the kernel's dense kind, for batches past max_rows(): the kernel
        sums it in the same order as the blocks rounded to bf16, so the result is bit-identical and
        the blocks are not dequantized once per max_rows() rows. The dense copy must hold exactly
        those values (it does when both come from one GGUF file); a sample of rows is checked."""
        rows = sorted({0, q.n // 3, q.n // 2, q.n - 1})
        sample = QuantizedWeight(q.kind, q.qs[rows], q.d[rows], None if q.mn is None else q.mn[rows], len(rows), q.k)
        if not torch.equal(sample.dequantize().to(torch.bfloat16), self.weight.detach()[rows]):
            raise ValueError("the dense weight does not hold the GGUF blocks' values rounded to bf16")
        return QuantizedWeight.dense(self.weight)

    def pack(self, batch_hint: int = 64) -> bool:
        """Pre-pack the weight for oneDNN (bf16 / fp32 on CPU only), or in panels for `panel_gemm.c`
        (see the class docstring); call again after changing the weight."""
        self._packed = self._panels = None
        if self.row_invariant:
            return False
        if _panel_kernel_for(self.weight):
            self._panels = pack_panels(self.weight)
            return True
        if not _can_pack(self.weight):
            return False
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is not None and x.dim() == 2 and (self.row_invariant or x.shape[0] <= self._rows) \
                and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            if self.dense_twin is not None and x.shape[0] > self._rows and x.dtype == torch.bfloat16:
                q = self.dense_twin
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        if self._panels is not None and x.dim() == 2 and x.dtype == torch.float32:
            y = panel_matmul(x, self._panels)
            return y if self.bias is None else y.add_(self.bias)
        if self._packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            m = x.shape[0]
            rows = padded_rows(m)
            if rows == m:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
            xp = x.new_zeros((rows, x.shape[1]))
            xp[:m] = x
            return torch.ops.mkldnn._linear_pointwise(xp, self._packed, self.bias, "none", [], "")[:m]
        return F.linear(x, self.weight, self.bias)


def padded_rows(m: int) -> int:
    """The row count a packed product runs at: m up to 16, above that rounded up to one of 16 sizes per
    power of two (multiples of 16 up to 256, then steps of m's octave / 16: at most 1/16 extra rows).
    oneDNN keeps memory for every distinct shape it ran (kernels, primitives, ~0.5 MiB each at
    576x1536 bf16 and not returned by its cache limit or malloc_trim), and prefill steps bring a new row
    count almost every step: unbucketed, a server's memory grew ~1.8 MiB per new row count for 4
    shapes. With these sizes a 2048-token step budget has at most 80 row counts."""
    if m <= 16:
        return m
    step = max(16, (1 << (m.bit_length() - 1)) // 16)
    return -(-m // step) * step
