"""nn.Linear with CPU fast paths: GGUF quantized blocks for a few rows (see gguf_kernels); for
larger batches the weights packed in panels for `panel_gemm.c` (float32 on AVX2-only CPUs, bfloat16 on
CPUs with AVX-512 BF16, on AMX tiles where there are any), else oneDNN's pre-packed bf16 / fp32 weights; and a row-invariant mode
(`--deterministic`) where every batch size goes through the block kernel, whose result for a
row does not depend on the other rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.cpu_kernels import load_library
from deepinfer.layers.gguf_kernels import KIND_CODES, QuantizedWeight, max_rows

if TYPE_CHECKING:
    from deepinfer.lora.layers import LoRASite

PANEL = 16  # output features per float32 panel of panel_gemm.c
BF16_PANEL = 32  # output features per bfloat16 panel


def _can_pack(weight: torch.Tensor) -> bool:
    if not (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # oneDNN's bf16 reorder refuses CPUs without AVX-512 BW/VL/DQ (or AVX-NE-CONVERT): on an AVX2-only CPU
    # an explicit --dtype bfloat16 takes F.linear (torch emulates bf16 there)
    return weight.dtype != torch.bfloat16 or torch.backends.cpu.get_cpu_capability() == "AVX512"


def _panel_kernel_for(weight: torch.Tensor) -> bool:
    """Whether `panel_gemm.c` serves this weight: float32 where the kernels are built (AVX2, or AVX-512
    with 32-feature tiles), output features a multiple of PANEL; bfloat16 on a CPU with AVX-512 BF16 (on AMX tiles
    where the CPU has them and Linux grants them), output features a multiple of BF16_PANEL and an even input
    width."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    n, k = weight.shape
    if weight.dtype == torch.float32:
        if n % PANEL:
            return False
        lib = load_library()
        return lib is not None and bool(lib.panel_gemm_preferred())
    if weight.dtype == torch.bfloat16:
        if n % BF16_PANEL or k % 2:
            return False
        lib = load_library()
        return lib is not None and bool(lib.panel_gemm_bf16_preferred())
    return False


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> [N/16, K, 16]: panel j holds features 16j..16j+15, each k's 16 weights together.
    bfloat16 [N, K] -> [N/32, K/2, 32, 2]: panel j holds features 32j..32j+31, each pair of k's 32 weight
    pairs together (the operand layout of vdpbf16ps)."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        if n % BF16_PANEL or k % 2:
            raise ValueError(f"bf16 panels need output features a multiple of {BF16_PANEL} and an even width, "
                             f"got {n}x{k}")
        return w.reshape(n // BF16_PANEL, BF16_PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if n % PANEL:
        raise ValueError(f"float32 panels need output features a multiple of {PANEL}, got {n}")
    return w.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None,
                 prefetch: bool = False) -> torch.Tensor:
    """x [M, K] times the weight packed by `pack_panels`, plus `bias` -> [M, N], in the panels' dtype
    (the kernels must be loaded; bf16 panels need a CPU with AVX-512 BF16). A bf16 bias is added to
    the float32 sums before the one rounding to bf16. `prefetch` (bf16 only; the same bits either way):
    whether each thread asks for its next panel while its first tile computes (see `panel_gemm_bf16`; off in
    the engine: the requests made the products slower on the 2-core Zen 4; `benchmarks/panel_gemm.py`
    compares both)."""
    x = x.contiguous()
    if x.dim() != 2 or x.dtype != panels.dtype:
        raise ValueError(f"panel_matmul needs 2-D {panels.dtype} activations, got {x.dtype} {tuple(x.shape)}")
    lib = load_library()
    if panels.dtype == torch.bfloat16:
        groups, pairs = panels.shape[:2]
        k, n = 2 * pairs, groups * BF16_PANEL
    else:
        groups, k, _ = panels.shape
        n = groups * PANEL
    if x.shape[1] != k:
        raise ValueError(f"panel_matmul: activations of width {x.shape[1]} for a weight of width {k}")
    y = torch.empty((x.shape[0], n), dtype=x.dtype)
    if not x.shape[0]:
        return y if bias is None else y + bias
    if panels.dtype == torch.bfloat16:
        b = None if bias is None else bias.detach().float().contiguous()
        if not lib.panel_gemm_bf16(x.data_ptr(), x.shape[0], k, panels.data_ptr(),
                                   None if b is None else b.data_ptr(), y.data_ptr(), n, int(prefetch)):
            raise ValueError("bf16 panels need a CPU with AVX-512 BF16")
        return y
    lib.panel_gemm_f32(x.data_ptr(), x.shape[0], k, panels.data_ptr(), y.data_ptr(), n)
    return y if bias is None else y.add_(bias)


class Linear(nn.Linear):
    """Float weights present until `release_dense()` (then panels or oneDNN's copy serve every product); `quantized`,
    when attached, serves CPU float32 / bfloat16 inputs of at most `max_rows()` rows; `pack()` adds a oneDNN-blocked
    copy of the weight, which skips the per-call weight reorder. bf16: measured 25-40% faster at 64 rows on an AMX
    Xeon, bit-identical output. fp32: torch's MKL sgemm repacks the weight every call and is slow at mid-size
    batches (576->3072 on a 2-core AVX-512 Xeon: 2.05 ms at 32 rows, slower than 1.67 ms at 64); packed, 0.69 ms at
    32 rows and never slower at 8-200 rows; the sums are reassociated (differences ~1e-6 relative). float32:
    `pack()` builds 16-feature panels for `panel_gemm.c` instead (AVX2-only, 2 threads, 64 rows, on a 2-core EPYC:
    185-192 GFLOP/s against oneDNN's 101-134; AVX-512, pairs of panels, weights from memory, 2-core Zen 5: 441-484
    against oneDNN's packed 341-445 at 64 rows). bfloat16 on a CPU with AVX-512 BF16 but no AMX: `pack()` builds
    32-feature bf16 panels instead (no synchronisation inside a product, weights streamed by the hardware
    prefetcher; the four projections of SmolLM2-135M's 30 layers at 64 rows, weights from memory, 2 threads on a
    2-core Zen 5: 14.9 ms against oneDNN's packed 19.2 ms; at or above oneDNN from 9 to 1024 rows). With AMX the
    same panels feed AMX tiles (`amx_gemm_bf16`): SmolLM2-135M's layer products at 64 rows, 30 layers' weights from
    memory, 2 threads of a 2-core Xeon: 0.70-0.94 of oneDNN's packed time, and a row's bits never depend on the
    batch (oneDNN's do: benchmarks/BENCHMARKS.md, session 52)."""

    quantized: QuantizedWeight | None = None
    _rows: int = 0
    _packed: torch.Tensor | None = None
    _panels: torch.Tensor | None = None
    row_invariant: bool = False
    dense_twin: QuantizedWeight | None = None  # row-invariant bf16: the same values dense (see _bf16_twin)
    # LoRA adapters of this projection (deepinfer/lora/layers.py), added to the rows of a step that run with them
    lora: LoRASite | None = None

    @property
    def pads_rows(self) -> bool:
        """Whether batches past the GGUF kernels' rows run at `padded_rows` (oneDNN's packed weights): the
        step time is then a staircase in the row count (speculative decoding's price, `spec/step_price.py`)."""
        return self._packed is not None

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
        if self.dense_released:
            raise ValueError("the dense weight was released (release_dense); reload it before packing again")
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

    @property
    def has_packed_copy(self) -> bool:
        """Whether `pack()` gave the weight a packed copy (panels or oneDNN's) that serves 2-D products."""
        return self._panels is not None or self._packed is not None

    @property
    def dense_released(self) -> bool:
        return self.weight.numel() == 0 and self.in_features * self.out_features > 0

    def release_dense(self) -> bool:
        """Free the dense weight's memory where the packed copy (panels or oneDNN's) serves every product that
        does not take the GGUF blocks: a CPU model then holds its float weights once, not twice. The parameter
        keeps its dtype and device (an empty tensor); `in_features` / `out_features` keep the shape. The
        caller must not release a weight another module shares (a tied embedding). Returns whether it freed."""
        if not self.has_packed_copy or self.row_invariant or self.dense_released:
            return False
        self.weight.data = self.weight.data.new_empty(0)
        return True

    def _quantized_serves(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes x to the GGUF block kernels (`quantized`) rather than to panels or oneDNN."""
        return self.quantized is not None and x.dim() == 2 and (self.row_invariant or x.shape[0] <= self._rows) \
            and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_forward(x)
        return y if self.lora is None else self.lora.add_to(x, y)

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 and self.has_packed_copy:
            # the packed paths take rows: other ranks as their rows (a released dense weight has no other path)
            return self._base_forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        q = self.quantized
        if self._quantized_serves(x):
            if self.dense_twin is not None and x.shape[0] > self._rows and x.dtype == torch.bfloat16:
                q = self.dense_twin
            y = q.matmul(x)
            return y if self.bias is None else y + self.bias
        if self._panels is not None and x.dim() == 2 and x.dtype == self._panels.dtype:
            return panel_matmul(x, self._panels, self.bias)
        if self._packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            m = x.shape[0]
            rows = padded_rows(m)
            if rows == m:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
            xp = x.new_zeros((rows, x.shape[1]))
            xp[:m] = x
            return torch.ops.mkldnn._linear_pointwise(xp, self._packed, self.bias, "none", [], "")[:m]
        if self.dense_released:
            raise TypeError(f"{self.weight.dtype} packed weights cannot take {x.dtype} input on {x.device}")
        return F.linear(x, self.weight, self.bias)

    def silu_mul_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """For a gate/up projection (the gate's features first, then the up's): out = silu(gate) * up of x in
        one pass over the panels, with the bits of `forward` followed by the kernels' `silu_mul`. False, with
        out untouched, where `forward` would not take x to panels (GGUF blocks, oneDNN, a bias), the step has rows
        with LoRA adapters, or the build has no such tile: the caller then runs the two steps. out: [rows, features / 2] in x's dtype,
        contiguous."""
        panels = self._panels
        if (panels is None or self.bias is not None or x.dim() != 2 or x.dtype != panels.dtype
                or self._quantized_serves(x) or (self.lora is not None and self.lora.owner.active)):
            return False
        bf16 = panels.dtype == torch.bfloat16
        width = BF16_PANEL if bf16 else PANEL
        k = 2 * panels.shape[1] if bf16 else panels.shape[1]
        inter = panels.shape[0] * width // 2
        if inter % width or x.shape[1] != k or out.shape != (x.shape[0], inter) or out.dtype != x.dtype \
                or not out.is_contiguous():
            return False
        if not x.shape[0]:
            return True
        x = x.contiguous()
        if self._blocks_on_amx(x, out):
            return True
        lib = load_library()
        fused = lib.panel_gemm_bf16_silu if bf16 else lib.panel_gemm_f32_silu
        return bool(fused(x.data_ptr(), x.shape[0], k, panels.data_ptr(), out.data_ptr(), inter))

    def _blocks_on_amx(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """silu_mul_into from the GGUF blocks on AMX tiles (`gguf_amx_gemm_silu`: the blocks dequantized a few
        features at a time in the core's cache, multiplied there), with the panels' bits: 1.2-1.4x the AMX panels'
        speed for SmolLM2-135M's gate/up product at 16-128 rows on a 2-core Xeon, which read 2 bytes a weight from
        memory where the blocks hold 0.625 (the other projections, whose dequantizing costs more than it saves,
        stay on the panels: benchmarks/BENCHMARKS.md, session 54). x and out as silu_mul_into checked them (x
        contiguous). False where it does not apply (no blocks, not bf16, no AMX, past 512 rows) or did not run."""
        q = self.quantized
        if q is None or q.kind not in KIND_CODES or x.dtype != torch.bfloat16 or self.row_invariant:
            return False
        lib = load_library()
        if not hasattr(lib, "gguf_amx_gemm_silu") or not lib.amx_tiles_granted():
            return False
        return bool(lib.gguf_amx_gemm_silu(x.data_ptr(), x.shape[0], q.k, KIND_CODES[q.kind], q.qs.data_ptr(),
                                           q.d.data_ptr(), q.mn.data_ptr() if q.mn is not None else None,
                                           out.data_ptr(), q.n // 2))


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
