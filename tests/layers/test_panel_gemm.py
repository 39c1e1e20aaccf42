"""`panel_gemm.c` (float32 products on weights packed in 16-feature panels, bfloat16 ones in 32-feature panels)
against a float64 reference, and the `Linear` that picks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers import cpu_kernels
from deepinfer.layers.linear import Linear, pack_panels, panel_matmul

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="needs x86-64 with AVX2 and gcc")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 11, 12, 13, 23, 64, 131])
@pytest.mark.parametrize("k,n", [(32, 16), (100, 48), (576, 960), (1536, 576), (100, 2064)])
def test_panel_product_matches_float64(rows, k, n):
    # tail tiles of the AVX2 kernel's 6-row tiles and the AVX-512 kernel's 12-row ones, several tiles, K not a
    # multiple of anything, one panel, an odd count (AVX-512: pairs and a single last panel) and many; 2064
    # features: the AVX-512 kernel's x packed per tile (N >= 2048), with an odd last panel
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    y = panel_matmul(x, pack_panels(w))
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [96, 2048])
def test_a_rows_result_does_not_depend_on_the_other_rows(n):
    # the sums run in k order for every tile position and row count: a row alone equals the same row in a batch
    # (2048 features: x packed per tile on AVX-512, in tiles whose sizes depend on the row count)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, 576, generator=gen)
    panels = pack_panels(torch.randn(n, 576, generator=gen))
    full = panel_matmul(x, panels)
    for r in (0, 5, 6, 30, 36):
        assert torch.equal(panel_matmul(x[r:r + 1], panels)[0], full[r])
    assert torch.equal(panel_matmul(x[6:19], panels), full[6:19])


@pytest.mark.parametrize("rows", [1, 16, 64, 131])
def test_packed_and_plain_x_give_the_same_bits(rows):
    # from 2048 features the AVX-512 kernel reads x packed per tile, below it as it is: the same weights'
    # first 96 features agree bit for bit either way
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    w = torch.randn(2080, 576, generator=gen) / 24
    wide = panel_matmul(x, pack_panels(w))
    assert torch.equal(wide[:, :96], panel_matmul(x, pack_panels(w[:96])))
    assert torch.equal(wide[:, 2000:], panel_matmul(x, pack_panels(w[2000:])))


def test_a_product_too_tall_to_pack_gives_the_packed_rows_bits():
    # x of more than 8 MB is read as it is even at 2048 features: its rows equal the same rows of a packed
    # 64-row product
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3700, 576, generator=gen)
    panels = pack_panels(torch.randn(2048, 576, generator=gen) / 24)
    tall = panel_matmul(x, panels)
    assert torch.equal(tall[100:164], panel_matmul(x[100:164], panels))
    assert torch.equal(tall[-64:], panel_matmul(x[-64:], panels))


def test_zero_rows_and_bad_input():
    panels = pack_panels(torch.randn(32, 64))
    assert panel_matmul(torch.empty(0, 64), panels).shape == (0, 32)
    with pytest.raises(ValueError, match="width 48"):
        panel_matmul(torch.randn(3, 48), panels)
    with pytest.raises(ValueError, match="float32"):
        panel_matmul(torch.randn(3, 64, dtype=torch.bfloat16), panels)


@pytest.mark.skipif(not (cpu_kernels.load_library() and cpu_kernels.load_library().panel_gemm_preferred()),
                    reason="needs the CPU kernels")
@pytest.mark.parametrize("bias", [False, True])
def test_linear_serves_float32_batches_from_panels(bias):
    gen = torch.Generator().manual_seed(3)
    lin = Linear(576, 960, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(960, 576, generator=gen) / 24)
        if bias:
            lin.bias.copy_(torch.randn(960, generator=gen))
    assert lin.pack()
    assert lin._panels is not None and lin._packed is None
    x = torch.randn(40, 576, generator=gen)
    expected = _reference(x, lin.weight) + (lin.bias if bias else 0)
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a column slice) takes the same path
    wide = torch.randn(40, 600, generator=gen)
    torch.testing.assert_close(lin(wide[:, 10:586]), lin(wide[:, 10:586].contiguous()), rtol=0, atol=0)


def test_linear_without_panels_where_features_do_not_fill_them():
    # 100 output features are not a multiple of 16: oneDNN (or torch) keeps serving the layer
    lin = Linear(64, 100, bias=False)
    lin.pack()
    assert lin._panels is None
    x = torch.randn(20, 64)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_row_invariant_linear_drops_its_panels():
    lin = Linear(64, 32, bias=False)
    lin.pack()
    lin.make_row_invariant()
    assert lin._panels is None and lin._packed is None
    assert not lin.pack()


@pytest.mark.parametrize("k,n", [(576, 960), (64, 100)])
def test_a_released_dense_weight_changes_no_product(k, n):
    # 960 features take panels, 100 oneDNN's packed copy (where torch has mkldnn): with the dense copy freed,
    # every row count and a 3-D input give the bits they gave before
    gen = torch.Generator().manual_seed(k + n)
    lin = Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k ** 0.5)
        lin.bias.copy_(torch.randn(n, generator=gen))
    if not lin.pack():
        pytest.skip("neither panels nor oneDNN packing on this machine")
    xs = [torch.randn(rows, k, generator=gen) for rows in (1, 9, 40)] + [torch.randn(2, 7, k, generator=gen)]
    before = [lin(x) for x in xs]
    assert torch.equal(before[-1].reshape(14, n), lin(xs[-1].reshape(14, k)))
    dense_bytes = lin.weight.numel() * lin.weight.element_size()
    assert dense_bytes > 0 and lin.release_dense()
    assert lin.dense_released and lin.weight.numel() == 0 and lin.weight.dtype == torch.float32
    for x, y in zip(xs, before, strict=True):
        assert torch.equal(lin(x), y)
    assert not lin.release_dense()  # once
    with pytest.raises(ValueError, match="released"):
        lin.pack()
    with pytest.raises(TypeError, match="cannot take"):
        lin(xs[1].double())


def test_an_unpacked_or_row_invariant_linear_keeps_its_dense_weight():
    plain = Linear(64, 32, bias=False)
    assert not plain.release_dense() and plain.weight.numel() == 64 * 32
    invariant = Linear(64, 32, bias=False)
    invariant.pack()
    invariant.make_row_invariant()  # its kernel's dense kind reads the weight itself
    assert not invariant.release_dense() and invariant.weight.numel() == 64 * 32


_LIB = cpu_kernels.load_library()
_BF16 = pytest.mark.skipif(not (_LIB and _LIB.panel_gemm_bf16_supported()), reason="needs a CPU with AVX-512 BF16")


def _bf16_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The exact sums of the bf16 products (each fits a float32), plus the bias, rounded once to bf16."""
    ref = x.double() @ w.double().T
    return (ref if bias is None else ref + bias.double()).to(torch.bfloat16)


@_BF16
@pytest.mark.parametrize("rows", [1, 5, 11, 12, 13, 24, 64, 131])
@pytest.mark.parametrize("k,n", [(2, 32), (100, 96), (576, 960), (1536, 576)])
def test_bf16_panel_product_matches_float64(rows, k, n):
    # every tail-tile size class (rows % 12), several tiles, one and many panels, the narrowest width
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    y = panel_matmul(x, pack_panels(w))
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref = _bf16_reference(x, w)
    # float32 sums in another order, then one rounding: at most one bf16 step apart from the exact rounding
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-5 * k ** 0.5)
    assert (y == ref).float().mean() > 0.9


@_BF16
def test_bf16_bias_is_added_before_the_rounding():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    w = (torch.randn(64, 64, generator=gen) / 8).to(torch.bfloat16)
    bias = (torch.randn(64, generator=gen) * 4).to(torch.bfloat16)
    y = panel_matmul(x, pack_panels(w), bias)
    torch.testing.assert_close(y.float(), _bf16_reference(x, w, bias).float(), rtol=2 ** -7, atol=1e-4)
    # adding the bias after rounding the product (two roundings) misses the reference in ~17% of places here
    two_roundings = (x.double() @ w.double().T).to(torch.bfloat16) + bias
    ref = _bf16_reference(x, w, bias)
    assert (y == ref).float().mean() > 0.98 > (two_roundings == ref).float().mean()


@_BF16
def test_bf16_rows_result_does_not_depend_on_the_other_rows():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(37, 576, generator=gen).to(torch.bfloat16)
    panels = pack_panels(torch.randn(96, 576, generator=gen).to(torch.bfloat16))
    full = panel_matmul(x, panels)
    for r in (0, 11, 12, 30, 36):
        assert torch.equal(panel_matmul(x[r:r + 1], panels)[0], full[r])
    assert torch.equal(panel_matmul(x[12:29], panels), full[12:29])


_AMX = pytest.mark.skipif(not (_LIB and _LIB.amx_tiles_granted()), reason="needs a CPU with AMX (and Linux's grant)")


def _vector_matmul(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], panels.shape[0] * 32, dtype=torch.bfloat16)
    assert _LIB.panel_gemm_bf16_vector(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), None, y.data_ptr(),
                                       y.shape[1], 0)
    return y


@_AMX
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 100, 300])
def test_amx_tiles_match_float64_and_keep_each_rows_bits_whatever_the_batch(rows):
    # rows past a 16-row tile (zero-padded), an odd 16-row block (one A tile), more than a 128-row chunk (300)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    w = (torch.randn(3072, 576, generator=gen) / 24).to(torch.bfloat16)
    panels = pack_panels(w)
    y = panel_matmul(x, panels)
    ref = _bf16_reference(x, w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-5 * 24)
    assert (y == ref).float().mean() > 0.9
    for r0, r1 in ((0, 1), (rows // 2, rows), (rows - 1, rows)):
        assert torch.equal(panel_matmul(x[r0:r1], panels), y[r0:r1])
    # the vector tiles (what a CPU without AMX runs) sum the same products but round inside a k pair otherwise:
    # as close to float64, yet not the same bits everywhere
    vec = _vector_matmul(x, panels)
    torch.testing.assert_close(vec.float(), ref.float(), rtol=2 ** -7, atol=1e-5 * 24)
    assert (vec == y).float().mean() > 0.97


@_AMX
def test_amx_tiles_serve_widths_that_are_not_a_multiple_of_32_with_the_vector_tiles():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 100, generator=gen).to(torch.bfloat16)
    panels = pack_panels((torch.randn(64, 100, generator=gen) / 10).to(torch.bfloat16))
    assert torch.equal(panel_matmul(x, panels), _vector_matmul(x, panels))


@_BF16
@pytest.mark.parametrize("rows", [9, 12, 64])
def test_bf16_prefetch_requests_change_no_bits(rows):
    # the engine runs without the next-panel requests; the variant kept for panel_gemm.py must agree bit for bit
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    panels = pack_panels((torch.randn(1536, 576, generator=gen) / 24).to(torch.bfloat16))
    assert torch.equal(panel_matmul(x, panels, prefetch=True), panel_matmul(x, panels))


def test_bf16_panels_refuse_shapes_they_cannot_fill():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_panels(torch.randn(48, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="even width"):
        pack_panels(torch.randn(32, 63).to(torch.bfloat16))


@pytest.mark.skipif(not (_LIB and _LIB.panel_gemm_bf16_preferred()),
                    reason="bf16 panels serve Linear on CPUs with AVX-512 BF16 (and with AMX where Linux grants it)")
@pytest.mark.parametrize("bias", [False, True])
def test_linear_serves_bf16_batches_from_panels(bias):
    gen = torch.Generator().manual_seed(5)
    lin = Linear(576, 960, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(960, 576, generator=gen) / 24)
        if bias:
            lin.bias.copy_(torch.randn(960, generator=gen))
    assert lin.pack()
    assert lin._panels is not None and lin._packed is None and lin._panels.dtype == torch.bfloat16
    assert not lin.pads_rows  # each row costs its own arithmetic: speculative decoding's price is smoothed
    x = torch.randn(40, 576, generator=gen).to(torch.bfloat16)
    expected = _bf16_reference(x, lin.weight, lin.bias if bias else None)
    torch.testing.assert_close(lin(x).float(), expected.float(), rtol=2 ** -7, atol=1e-4)
    # 48 output features do not fill a bf16 panel: oneDNN (or torch) serves that layer
    narrow = Linear(64, 48, bias=False).to(torch.bfloat16)
    narrow.pack()
    assert narrow._panels is None


# a build with the gate/up tiles computes an empty product (returns 1); others compute nothing (0)
def _fused_tile(dtype: torch.dtype) -> bool:
    lib = cpu_kernels.load_library()
    if lib is None:
        return False
    if dtype == torch.bfloat16:
        return bool(lib.panel_gemm_bf16_preferred() and lib.panel_gemm_bf16_silu(0, 0, 32, 0, 0, 32))
    return bool(lib.panel_gemm_f32_silu(0, 0, 16, 0, 0, 16))


_DTYPES = [pytest.param(torch.float32, marks=pytest.mark.skipif(not _fused_tile(torch.float32),
                                                                 reason="needs the AVX-512 float32 panel tiles")),
           pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not _fused_tile(torch.bfloat16),
                                                                  reason="needs bf16 panels (AVX-512 BF16)"))]


def _gate_up(k: int, inter: int, seed: int, bias: bool = False, dtype: torch.dtype = torch.float32) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = Linear(k, 2 * inter, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2 * inter, k, generator=gen) / k ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(2 * inter, generator=gen))
    lin = lin.to(dtype)
    assert lin.pack() and lin._panels is not None
    return lin


def _two_steps(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    gu = lin(x)
    out = torch.empty(x.shape[0], gu.shape[1] // 2, dtype=x.dtype)
    cpu_kernels.load_library().silu_mul(gu.data_ptr(), out.data_ptr(), x.shape[0], out.shape[1],
                                        cpu_kernels.dtype_code(x.dtype))
    return out


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("rows", [9, 16, 64, 131])
@pytest.mark.parametrize("k,inter", [(576, 1536), (100, 96)])
def test_gate_up_with_silu_in_its_tiles_gives_the_two_steps_bits(dtype, rows, k, inter):
    # float32: x packed per tile at 1536 (3072 features), six gate and six up panels read as they are at 96;
    # bf16: 6-row tiles with a tail of 3, 4 or 1 rows; three gate and three up panels at 96
    lin = _gate_up(k, inter, rows + inter, dtype=dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    fused = torch.full((rows, inter), float("nan"), dtype=dtype)
    assert lin.silu_mul_into(x, fused)
    assert torch.equal(fused, _two_steps(lin, x))
    # and against float64 sums, for a kernel that got both steps wrong alike
    gu = _reference(x, lin.weight)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 2e-2}
    torch.testing.assert_close(fused.float(), F.silu(gu[:, :inter]) * gu[:, inter:], **tol)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_gate_up_with_silu_declines_what_forward_would_not_take_to_panels(dtype):
    x = torch.randn(12, 64).to(dtype)
    out = torch.zeros(12, 32, dtype=dtype)
    assert not _gate_up(64, 32, 1, bias=True, dtype=dtype).silu_mul_into(x, out)  # forward adds a bias after
    half = 24 if dtype == torch.float32 else 48  # halves of whole panels' features that are not whole panels
    assert not _gate_up(64, half, 2, dtype=dtype).silu_mul_into(x, torch.zeros(12, half, dtype=dtype))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not _gate_up(64, 32, 3, dtype=dtype).silu_mul_into(x.to(other), out.to(other))
    assert not _gate_up(64, 32, 4, dtype=dtype).silu_mul_into(x, torch.zeros(12, 16, dtype=dtype))  # out too narrow
    assert not Linear(64, 64).to(dtype).silu_mul_into(x, out)  # not packed
    assert torch.equal(out, torch.zeros(12, 32, dtype=dtype))
