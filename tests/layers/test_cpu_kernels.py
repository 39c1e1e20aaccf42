"""The C kernels (paged decode attention, fused norm / rotary / SiLU, argmax, categorical sampling) against torch
references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers import cpu_kernels
from deepinfer.layers.activation import silu_and_mul
from deepinfer.layers.attention import AttentionBatch
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import apply_rotary, apply_rotary_qk
from deepinfer.layers.torch_attention import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="needs x86-64 with AVX2 and gcc")

CPU = torch.device("cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _decode_batch(lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator):
    """Random, scattered block tables for sequences of the given context lengths."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        nb = (n + block_size - 1) // block_size
        tables.append(perm[used:used + nb])
        used += nb
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens, strict=True)])
    return AttentionBatch([1] * len(lens), lens, tables, len(lens), slots, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 8, 32, 16), (16, 2, 128, 32),
                                                                 (4, 1, 64, 8), (12, 2, 48, 16), (6, 1, 40, 16),
                                                                 (5, 1, 80, 16), (6, 2, 96, 16), (4, 2, 256, 16)])
@pytest.mark.parametrize("copies", [1, 6])
def test_paged_decode_kernel_matches_gather_sdpa(dtype, heads, kv_heads, head_dim, block_size, copies):
    # head sizes 48 / 80 (a 16-lane tail after 32-lane chunks), 64 / 128 / 256 and 96 (the bf16 dot path's
    # fixed and generic chunk counts), groups of 1-8 (4 at a time); contexts end inside, at and past a block.
    # 7 sequences: one kv head per task on 2+ threads; 42: a sequence's kv heads together (up to 10 threads)
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    lens = [1, 2, block_size, block_size + 1, 37, 300, 5] * copies
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 7
    batch = _decode_batch(lens, block_size, num_blocks, gen)
    b = len(lens)
    q = torch.randn(b, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(b, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(b, kv_heads, head_dim, generator=gen).to(dtype)
    base = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    outs, caches = [], []
    for use_kernel in (True, False):
        backend = TorchAttentionBackend(CPU, use_cpu_kernel=use_kernel)
        cache = backend.allocate_cache(1, num_blocks, block_size, kv_heads, head_dim, dtype, CPU)[0]
        cache[0].copy_(base[0])
        cache[1].copy_(base[1])
        assert (backend.kernels is not None) == use_kernel
        outs.append(backend.forward(q, k, v, cache, backend.prepare(batch)).float())
        caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_give_a_row_the_same_bits_alone_in_a_batch_and_at_any_thread_count(dtype):
    """Contexts of several segments (paged_attention.c: 256 tokens at 16-token blocks): a lone sequence's
    segments are tasks of their own spread over the threads and merged after; in a batch of 16 each sequence's
    kv heads walk the whole context on one thread, merging as they go. A row's output is the same bits either
    way, at one thread and at two, and close to SDPA over the gathered context."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(7)
    long = [1900, 700, 257, 256]
    lens = long + [40] * 12
    num_blocks = sum((n + bs - 1) // bs for n in lens) + 3
    batch = _decode_batch(lens, bs, num_blocks, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(lens), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(lens), kv_heads, head_dim, generator=gen).to(dtype)
    base = [torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]

    def run(use_kernel: bool, rows: list[int], threads: int) -> torch.Tensor:
        backend = TorchAttentionBackend(CPU, use_cpu_kernel=use_kernel)
        cache = backend.allocate_cache(1, num_blocks, bs, kv_heads, head_dim, dtype, CPU)[0]
        cache[0].copy_(base[0])
        cache[1].copy_(base[1])
        sub = AttentionBatch([1] * len(rows), [lens[i] for i in rows], [batch.block_tables[i] for i in rows],
                             len(rows), batch.slot_mapping[rows], bs)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return backend.forward(q[rows], k[rows], v[rows], cache, backend.prepare(sub))
        finally:
            torch.set_num_threads(before)

    everyone = list(range(len(lens)))
    in_batch = run(True, everyone, 2)
    torch.testing.assert_close(in_batch.float(), run(False, everyone, 2).float(), atol=TOL[dtype], rtol=TOL[dtype])
    for i in range(len(long)):
        for threads in (1, 2):
            assert torch.equal(run(True, [i], threads)[0], in_batch[i]), (lens[i], threads)


def _shared_prefix_tables(lens: list[int], groups: list[int], shared: list[int], block_size: int,
                          gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables where sequence i shares the first shared[groups[i]] tokens' full blocks with the other
    sequences of its group (as the prefix cache hands them out), its other blocks its own, all scattered."""
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    common: dict[int, list[int]] = {}
    tables = []
    for n, g in zip(need, groups, strict=True):
        if g not in common:
            common[g] = [perm.pop() for _ in range(shared[g] // block_size)]
        own = [perm.pop() for _ in range(n - min(n, len(common[g])))]
        tables.append((common[g] + own)[:n])
    return tables, num_blocks


def _paged_attention(fn, q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lens: list[int],
                     block_size: int) -> torch.Tensor:
    """One call of a paged_decode_attention entry point of the C library: q [B, H, D], cache [2, blocks, ...]."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    ctx = torch.tensor(lens, dtype=torch.long)
    out = torch.empty_like(q)
    heads, kv_heads, dim = q.shape[1], cache.shape[3], q.shape[2]
    rc = fn(q.data_ptr(), out.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), table.data_ptr(), width,
            ctx.data_ptr(), q.shape[0], heads, kv_heads, dim, block_size, dim ** -0.5, cpu_kernels.dtype_code(q.dtype),
            0, None)
    assert rc == 0
    return out


def _dense_attention(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
    """float32 attention of each row over its gathered context (the reference)."""
    heads, kv_heads, dim = q.shape[1], cache.shape[3], q.shape[2]
    out = torch.empty(q.shape)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        keys, values = (cache[j][table].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(heads // kv_heads, 1)
                        for j in (0, 1))
        probs = (torch.einsum("hd,khd->hk", q[i].float(), keys) * dim ** -0.5).softmax(-1)
        out[i] = torch.einsum("hk,khd->hd", probs, values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 64),
                                                                 (6, 2, 64, 8)])
def test_rows_sharing_prefix_blocks_get_their_own_bits_in_a_batch(dtype, heads, kv_heads, head_dim, block_size):
    """Sequences that share a prefix's blocks (two groups, prefixes ending inside and at a 64-token segment), a
    sequence alone, and the consecutive rows of one prompt (each attending its own positions): on AMX CPUs bf16 rows
    of contexts of at least 256 tokens go to the AMX kernel, which gathers the rows of a segment they share into
    common tiles (paged_attention_amx.c), the shorter ones to the vector kernel, in one call. Every row is the same
    bits alone and in the batch, at one thread and at two, and close to float32 attention."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lens = [430, 431, 500, 700, 430, 200, 70, 129, 64, 65, 300] + list(range(120, 136))
    groups = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 3] + [4] * 16  # group 4: the prompt's rows
    tables, num_blocks = _shared_prefix_tables(lens, groups, [432, 128, 0, 0, 128], block_size, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lib = cpu_kernels.load_library()
    before = torch.get_num_threads()
    try:
        in_batch = _paged_attention(lib.paged_decode_attention, q, cache, tables, lens, block_size)
        torch.testing.assert_close(in_batch.float(), _dense_attention(q, cache, tables, lens),
                                   atol=TOL[dtype], rtol=TOL[dtype])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for i in range(len(lens)):
                alone = _paged_attention(lib.paged_decode_attention, q[i:i + 1].contiguous(), cache, [tables[i]],
                                         [lens[i]], block_size)
                assert torch.equal(alone[0], in_batch[i]), (i, lens[i], threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(cpu_kernels.load_library() is None or not cpu_kernels.load_library().amx_tiles_granted(),
                    reason="needs AMX tiles")
def test_amx_attention_agrees_with_the_vector_kernel_and_folds_windows_alike():
    """The AMX path against the vector kernel (the other CPUs' numerics) on a long shared context, with so many
    rows that its segment records take several windows (RECORD_BUDGET): the same bits as each row alone, whose
    records fit one window, and within bf16 rounding of the vector kernel."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, bs = 32, 4, 128, 16
    lens = [2000 + 37 * i for i in range(24)]
    tables, num_blocks = _shared_prefix_tables(lens, [0] * 12 + [1] * 12, [1024, 64], bs, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    lib = cpu_kernels.load_library()
    amx = _paged_attention(lib.paged_decode_attention, q, cache, tables, lens, bs)
    vector = _paged_attention(lib.paged_decode_attention_vector, q, cache, tables, lens, bs)
    assert not torch.equal(amx, vector)  # two numerics
    torch.testing.assert_close(amx.float(), vector.float(), atol=1e-2, rtol=1e-2)
    for i in (0, 13, 23):
        alone = _paged_attention(lib.paged_decode_attention, q[i:i + 1].contiguous(), cache, [tables[i]], [lens[i]], bs)
        assert torch.equal(alone[0], amx[i])


@pytest.mark.parametrize("kernel", ["paged_decode_attention", "paged_decode_attention_vector"])
def test_bf16_attention_outputs_are_the_exact_result_rounded(kernel):
    """Against float64 attention rounded to bf16, nearly every output is that value: the AMX kernel multiplies the
    values by each probability's bf16 leading part and its bf16 remainder (rounded once to bf16, as torch's bf16
    SDPA does, a quarter of the outputs missed it on this data); the vector kernel keeps them in float32."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, bs, n = 9, 3, 64, 16, 400  # contexts of 256+ tokens: the AMX kernel where there is one
    lens = [n] * 32
    tables, num_blocks = _shared_prefix_tables(lens, list(range(32)), [0] * 32, bs, gen)
    q = (2 * torch.randn(len(lens), heads, dim, generator=gen)).to(torch.bfloat16)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen).to(torch.bfloat16)
    out = _paged_attention(getattr(cpu_kernels.load_library(), kernel), q, cache, tables, lens, bs)
    exact = torch.empty(q.shape, dtype=torch.float64)
    for i, table in enumerate(tables):
        keys, values = (cache[j][table].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(3, 1) for j in (0, 1))
        probs = (torch.einsum("hd,khd->hk", q[i].double(), keys) * dim ** -0.5).softmax(-1)
        exact[i] = torch.einsum("hk,khd->hd", probs, values)
    missed = (out != exact.to(torch.bfloat16)).float().mean().item()
    assert missed < 0.02, missed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(dtype)
    res = torch.randn(5, 64, generator=gen).to(dtype)
    expected_sum = x + res  # rounded to dtype, as the reference stores it
    expected = norm._norm(expected_sum)
    out, new_res = norm(x, res.clone())
    assert torch.equal(new_res, expected_sum)
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(norm(x), norm._norm(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_qkv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    t, hq, hk, d = 6, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    eq, ek = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    rq, rk = apply_rotary_qk(q, k, cos, sin)
    assert rq.data_ptr() == q.data_ptr()  # rotated in place inside the fused buffer
    torch.testing.assert_close(rq, eq, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(rk, ek, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    gu = (torch.randn(7, 96, generator=gen) * 30).to(dtype)  # large magnitudes exercise exp's clamping
    gate, up = gu.split(48, dim=-1)
    torch.testing.assert_close(silu_and_mul(gu), F.silu(gate) * up, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("vocab", [37, 1003])
@pytest.mark.parametrize("from_logits", [True, False])
def test_sample_rows_follows_the_distribution(vocab, from_logits):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 2
    logits[::5] = float("-inf")  # banned tokens: never drawn
    temperature = 0.7
    probs = torch.softmax(logits / temperature, dim=-1)
    draws = 20000
    x = (logits if from_logits else probs * 3.0).unsqueeze(0).expand(draws, vocab).contiguous()
    u = torch.rand(draws, dtype=torch.float64, generator=gen)
    inv_temp = torch.full((draws,), 1 / temperature) if from_logits else None
    picked = cpu_kernels.sample_rows(x, list(range(draws)), u, inv_temp)
    freq = torch.bincount(picked, minlength=vocab).double() / draws
    assert freq[::5].sum() == 0
    sigma = (probs.double() * (1 - probs.double()) / draws).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-4).all()
    # inverse CDF: the same uniforms pick the same tokens as torch's cumsum + searchsorted
    reference = cpu_kernels._sample_rows_torch(x, list(range(draws)), u, inv_temp)
    assert (picked == reference).double().mean() > 0.999


def test_sample_rows_on_a_full_vocabulary_matches_torch_inverse_cdf():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 49152, generator=gen) * 4
    x[:, 1000:2000] = float("-inf")
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    inv_temp = torch.rand(64, generator=gen) + 0.5
    rows = list(range(0, 64, 2))
    picked = cpu_kernels.sample_rows(x, rows, u[::2], inv_temp[::2])
    assert not ((picked >= 1000) & (picked < 2000)).any()
    reference = cpu_kernels._sample_rows_torch(x, rows, u[::2], inv_temp[::2])
    assert (picked == reference).sum() >= 31


def test_sample_rows_edges_of_the_uniform_interval_and_listed_rows_only():
    x = torch.full((3, 20), float("-inf"))
    x[:, 3] = 0.0
    x[:, 17] = 0.0
    x[1] = float("-inf")  # nothing allowed: falls back to the largest value's index
    u = torch.tensor([0.0, 0.5, 1 - 2 ** -53], dtype=torch.float64)
    picked = cpu_kernels.sample_rows(x, [0, 1, 2], u, torch.ones(3))
    assert picked.tolist() == [3, 0, 17]
    assert cpu_kernels.sample_rows(x, [2], u[2:], torch.ones(1)).tolist() == [17]


def test_argmax_rows_matches_torch_including_ties():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 1000, generator=gen)
    x[3, 10] = x[3, 500] = 100.0  # a tie: the first index wins, as in torch
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))


def _scan_argmax(row: list[float]) -> int:
    """The kernel's contract spelled as its scalar scan: first strict maximum from row[0] (NaN skipped)."""
    best = 0
    for n, v in enumerate(row):
        if v > row[best]:
            best = n
    return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [5, 31, 32, 47, 1000, 49152])
def test_argmax_rows_vector_scan_matches_the_scalar_scan(dtype, width):
    """The 16-lane pass returns what the scalar scan does: ties in different lanes (the lower index),
    -0 against +0, rows of -inf, NaNs (skipped, or index 0 when the row starts with one), widths
    that end mid-vector; bfloat16 rows give their float32 copy's answer."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=gen).to(dtype)
    last = width - 1
    x[1, last] = x[1, min(3, last)] = 50.0  # tie across lanes: the first wins
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, last] = -0.0
    x[3, 0] = -0.0  # -0 first, +0 later: equal, the first wins
    x[4, 0] = float("nan")  # a leading NaN: index 0, like the scan
    x[5, min(7, last)] = float("nan")
    x[5, last // 2] = 40.0  # a NaN elsewhere is skipped
    x[6] = float("nan")
    x[6, last] = 1.0
    x[7, last] = float("inf")
    x[8] = float("-inf")
    x[8, last] = float("nan")
    got = cpu_kernels.argmax_rows(x)
    assert torch.equal(got, cpu_kernels.argmax_rows(x.float()))
    assert got.tolist() == [_scan_argmax(r) for r in x.float().tolist()]
    finite = torch.isfinite(x).all(dim=-1)
    assert torch.equal(got[finite], x[finite].float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_as_kernel_rows_match_sdpa(dtype):
    """A step of two decodes, a fresh prompt, and a chunk after cached context (plus tokens of the same
    chunk): on the kernel every new token is a row attending to its own positions, which must equal the
    gather + causal SDPA path, KV writes included."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    query_lens = [1, 1, 37, 21]
    context_lens = [50, 17, 37, 3 * bs + 21]  # the last chunk follows 48 cached tokens
    tables, nxt = [], 0
    for n in context_lens:
        nb = (n + bs - 1) // bs
        tables.append(list(range(nxt + nb - 1, nxt - 1, -1)))  # reversed: blocks are not in order
        nxt += nb
    slots = torch.tensor([t[p // bs] * bs + p % bs for q, n, t in zip(query_lens, context_lens, tables, strict=True)
                          for p in range(n - q, n)])
    batch = AttentionBatch(query_lens, context_lens, tables, 2, slots, bs)
    rows = sum(query_lens)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    base = [torch.randn(nxt, bs, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    outs, caches = [], []
    for use_kernel in (True, False):
        backend = TorchAttentionBackend(CPU, use_cpu_kernel=use_kernel)
        cache = backend.allocate_cache(1, nxt, bs, kv_heads, head_dim, dtype, CPU)[0]
        cache[0].copy_(base[0])
        cache[1].copy_(base[1])
        meta = backend.prepare(batch)
        assert (meta.decode_context_lens is not None and not meta.prefills) == use_kernel
        outs.append(backend.forward(q, k, v, cache, meta).float())
        caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("window", [None, 6])
def test_horizons_let_a_run_attend_both_ways(window):
    """`AttentionBatch.horizons` (Gemma 3's image placeholders): a token of a run attends to keys up to the
    run's end, the others stay causal, a window still counts back from the token's own position. The kernel rows,
    the gather + SDPA path and the window path all equal attention computed densely with that mask."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, bs = 4, 2, 32, 8
    query_lens = [1, 30, 14]
    context_lens = [20, 30, 2 * bs + 14]  # the last chunk starts inside a run, after 16 cached tokens
    runs = [[], [(5, 20)], [(12, 25)]]
    tables, nxt = [], 0
    for n in context_lens:
        nb = (n + bs - 1) // bs
        tables.append(list(range(nxt + nb - 1, nxt - 1, -1)))
        nxt += nb
    positions = [p for q, n in zip(query_lens, context_lens, strict=True) for p in range(n - q, n)]
    horizons = list(positions)
    row = 0
    for q, n, seq_runs in zip(query_lens, context_lens, runs, strict=True):
        for first, last in seq_runs:
            for p in range(max(first, n - q), last + 1):
                horizons[row + p - (n - q)] = last
        row += q
    slots = torch.tensor([t[p // bs] * bs + p % bs for q, n, t in zip(query_lens, context_lens, tables, strict=True)
                          for p in range(n - q, n)])
    batch = AttentionBatch(query_lens, context_lens, tables, 1, slots, bs, window=window, horizons=horizons)
    rows = sum(query_lens)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen)
    base = [torch.randn(nxt, bs, kv_heads, head_dim, generator=gen) for _ in range(2)]
    outs = []
    for use_kernel in (True, False):
        backend = TorchAttentionBackend(CPU, use_cpu_kernel=use_kernel)
        cache = backend.allocate_cache(1, nxt, bs, kv_heads, head_dim, torch.float32, CPU)[0]
        cache[0].copy_(base[0])
        cache[1].copy_(base[1])
        outs.append(backend.forward(q, k, v, cache, backend.prepare(batch)))
    row = 0
    expected = torch.empty_like(q)
    for n, table, ql in zip(context_lens, tables, query_lens, strict=True):
        keys = cache[0][table].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, dim=1)
        values = cache[1][table].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, dim=1)
        for j in range(ql):
            pos, last = positions[row + j], horizons[row + j]
            seen = torch.arange(n) <= last
            if window is not None:
                seen &= torch.arange(n) > pos - window
            scores = torch.einsum("hd,khd->hk", q[row + j], keys) * head_dim ** -0.5
            probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            expected[row + j] = torch.einsum("hk,khd->hd", probs, values)
        row += ql
    for out in outs:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    causal = TorchAttentionBackend(CPU).forward(q, k, v, cache, TorchAttentionBackend(CPU).prepare(
        AttentionBatch(query_lens, context_lens, tables, 1, slots, bs, window=window)))
    assert not torch.allclose(causal, expected, atol=1e-3)  # the horizons changed the run's rows
