/*
 * Matrix products straight from GGUF block-quantized weights.
 *
 * Decoding a handful of sequences on a CPU is limited by reading the weights from memory;
 * reading the GGUF blocks (Q4_1: 20 bytes per 32 weights, Q8_0: 34) instead of float32
 * (128 bytes) is what makes it fast. Each block is dequantized in registers.
 *
 *   y[m, n] = sum_k x[m, k] * w[n, k]        x: [M, K], y: [M, N], float32 or bfloat16 (dtype 0 / 1)
 *
 * Layouts (rows of w are output features, blocks of 32 run along k):
 *   Q4_1: qs [N, K/32, 16] uint8 (byte j: low nibble = q[j], high nibble = q[j+16]),
 *         d, mn [N, K/32] float32; w = d * q + mn
 *   Q8_0: qs [N, K] int8, d [N, K/32] float32; w = d * q
 * The effective weights are those of the model's dense copy in the same dtype, so a row's result
 * does not depend on which path a batch size picks: float32 uses the file's exact values, bfloat16
 * those values rounded to bfloat16. Rows are served MAX_ROWS at a time per pass over the weights (bf16 rows: the pair
 * products by VDPBF16PS, or at 2-8 rows by the two FMAs it is on Intel's cores, dp_fma). On AMX CPUs
 * gguf_amx_gemm(_silu) multiplies bf16 batches of any size from the blocks on AMX tiles (the end of this file).
 * Built together with paged_attention.c by deepinfer/layers/cpu_kernels.py.
 */
#include <omp.h>

#include "cpu_common.h"

#define QK 32
#define MAX_ROWS 8
/* see q4_1_rows_f32_m */
#define NO_SLP __attribute__((optimize("no-tree-slp-vectorize")))

/* dot product of one dequantized 32-weight block (w0..w3, as integers) with 32 activations */
static inline __m256 dot_block(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *xb) {
    __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);
    return _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);
}

/* per row m and block b: the sum of x over the block (Q4_1's offset term needs it) */
static void block_sums(const float *x, int M, int K, float *out) {
    int nb = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *p = x + (int64_t)m * K + b * QK;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            out[m * nb + b] = hsum8(s);
        }
}

/* bf16 -> float32 rows (x is [M, K]) */
static inline void widen(const void *x, int M, int K, float *out) {
    for (int64_t i = 0; i < (int64_t)M * K; i++) out[i] = load1(x, i, 1);
}

/* Ask for a feature's quants, scales and (Q4_1) offsets ahead of use: each weight of a small model is
 * too short for the hardware prefetcher to ramp up on (as prefetch_feature does for bf16). `stream`: the
 * call reads these weights once (at most MAX_ROWS rows, one pass), so they are asked for non-temporally
 * and do not pass through L2 into L3 on their way out. A decode step streams ~110 MB of weights
 * (SmolLM2-135M) through caches of a few MB: cached, they evicted the KV cache, the activations and the
 * host's own data every step and paid an L2 -> L3 victim write per line. On the 2-core Zen 3 a single
 * stream decoded 1-6% faster, with the machine's state (benchmarks/BENCHMARKS.md, session 26; 8 rows,
 * bound by their FMAs, unchanged). Passes over more rows re-read the weights per group of MAX_ROWS
 * rows from cache, so they keep the temporal hint. */
#define PREFETCH_AHEAD_F32 8
static inline __attribute__((always_inline)) void prefetch_rows_f32(const void *q, int qbytes, const float *d,
                                                                     const float *mn, int nb, int stream) {
#define PREFETCH_ROWS(HINT)                                                                    \
    do {                                                                                       \
        for (int o = 0; o < qbytes; o += 64) _mm_prefetch((const char *)q + o, HINT);          \
        for (int o = 0; o < nb * 4; o += 64) _mm_prefetch((const char *)d + o, HINT);          \
        if (mn)                                                                                \
            for (int o = 0; o < nb * 4; o += 64) _mm_prefetch((const char *)mn + o, HINT);     \
    } while (0)
    if (stream)
        PREFETCH_ROWS(_MM_HINT_NTA);
    else
        PREFETCH_ROWS(_MM_HINT_T0);
#undef PREFETCH_ROWS
}

/* one copy of a kernel per row count */
#define ROWS_SWITCH(CALL)            \
    switch (M) {                     \
        case 1: CALL(1); break;      \
        case 2: CALL(2); break;      \
        case 3: CALL(3); break;      \
        case 4: CALL(4); break;      \
        case 5: CALL(5); break;      \
        case 6: CALL(6); break;      \
        case 7: CALL(7); break;      \
        default: CALL(8); break;     \
    }

#ifndef __AVX512F__
/* AVX2 only: a Q4_1 block's 32 quants as float32 lanes in k order. Each half of the 16 bytes is widened
 * straight from memory (vpmovzxbd with a load operand); the low nibbles of a byte's 32-bit lane are
 * q[j], the lane shifted right by 4 gives q[j + 16]: 2 shuffles per block instead of 6 (load, 2 byte
 * shifts, 4 widenings), which bound the 1-row kernel. The same integer values as before. */
static inline __attribute__((always_inline)) void q4_1_block_w(const uint8_t *p, __m256 w[4]) {
    const __m256i nib = _mm256_set1_epi32(0x0F);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, nib));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c, nib));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}

/* AVX2 only: a Q8_0 block's 32 quants as float32 lanes, each 8 widened straight from memory (4 shuffles
 * instead of 7) */
static inline __attribute__((always_inline)) void q8_0_block_w(const int8_t *p, __m256 w[4]) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * j))));
}

/* acc[m] += d * (block b of weights w . row m of x), for the M rows: one block's step of the AVX2 float32 kernels */
static inline __attribute__((always_inline)) void fma_block_rows(__m256 *acc, const __m256 w[4], float d, const float *x,
                                                                  const int M, int K, int b) {
    const __m256 scale = _mm256_set1_ps(d);
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
        acc[m] = _mm256_fmadd_ps(scale, dot_block(w[0], w[1], w[2], w[3], x + (int64_t)m * K + b * QK), acc[m]);
}

/* sum over blocks b of mn[b] * sums[b] (Q4_1's offset term of one row and feature), 8 blocks per lane,
 * the last nb % 8 through a masked load (the other lanes read as 0) */
static inline __attribute__((always_inline)) __m256 offset_sum8(const float *mn, const float *sums, int nb) {
    __m256 s = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(mn + b), _mm256_loadu_ps(sums + b), s);
    if (b < nb) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb - b), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        s = _mm256_fmadd_ps(_mm256_maskload_ps(mn + b, mask), _mm256_maskload_ps(sums + b, mask), s);
    }
    return s;
}


/* AVX2 float32 Q4_1 by block pairs. Two blocks' 32 quant bytes are one 256-bit load of 8 dwords (4 per
 * block). Nibble k of every dword is isolated in place, v & (0xF << 4k), and converted: q * 2^4k, exact
 * in float32 (the top nibble, which would set the sign bit, is shifted down instead). 8 weights cost an
 * and and a convert, with no widening shuffles: ~14 instructions per block instead of 16, and the 1-row
 * kernel is bound by instruction count. Over SmolLM2-135M's layer weights from memory on one Zen 3 core
 * (benchmarks/gemm_rows.py): 1 row 10% faster than widening each block, 2-4 rows 1-5%; 5-8 rows 2-6% slower.
 * The weights come in the order (k, dword) instead of k, so each row of x is permuted to match once per
 * call (pair_x) and pre-scaled by 2^-4k: every product is q * x exactly as before (for |x| >= 2^-102, below
 * which x * 2^-24 is subnormal and loses bits); only the summation order differs. An odd last block goes
 * the one-block way (q4_1_block_w) on plain x. */
static void pair_x(const float *x, int K, float *xp) {
    const int nb = K / QK;
    /* dword l holds bytes 4 (l % 4) .. + 3 of block b + l / 4; byte j's low nibble is q[j], its high nibble
     * q[j + 16]: nibble k of dword l is weight 4 (l % 4) + k / 2 (+ 16 for odd k) of its block */
    const __m256i dword_at = _mm256_setr_epi32(0, 4, 8, 12, QK, QK + 4, QK + 8, QK + 12);
    int b = 0;
    for (; b + 2 <= nb; b += 2)
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const float scale = k == 7 ? 1.f : 1.f / (float)(1 << (4 * k));
            const __m256 v = _mm256_i32gather_ps(x + b * QK + k / 2 + (k & 1 ? 16 : 0), dword_at, 4);
            _mm256_storeu_ps(xp + b * QK + 8 * k, _mm256_mul_ps(v, _mm256_set1_ps(scale)));
        }
    if (b < nb) memcpy(xp + b * QK, x + b * QK, QK * sizeof(float));
}

/* weights k * 8 .. k * 8 + 7 of the block pair whose 32 quant bytes are q (see pair_x), as float32 */
static inline __attribute__((always_inline)) __m256 q4_1_pair_w(const __m256i q, const int k) {
    return _mm256_cvtepi32_ps(k < 7 ? _mm256_and_si256(q, _mm256_set1_epi32(0xF << (4 * k))) : _mm256_srli_epi32(q, 28));
}

/* a feature's scales of blocks b, b + 1 (dn points at block b's) as lanes 0-3 and 4-7, like the weights */
static inline __attribute__((always_inline)) __m256 q4_1_pair_d(const float *dn) {
    return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)dn)),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* One (row, feature) product over a block pair, the same operations in the same order in every kernel
 * below: even k into the chain s, odd k into t (two dependency chains of 4), then acc += d * s, acc += d * t.
 * Step k, xk the row's pair_x values k * 8 .. k * 8 + 7: */
static inline __attribute__((always_inline)) void q4_1_pair_step(const int k, const __m256 wk, const __m256 xk,
                                                                 __m256 *s, __m256 *t) {
    if (k < 2) *(k == 0 ? s : t) = _mm256_mul_ps(wk, xk);
    else if (k % 2 == 0) *s = _mm256_fmadd_ps(wk, xk, *s);
    else *t = _mm256_fmadd_ps(wk, xk, *t);
}

static inline __attribute__((always_inline)) void q4_1_pair_acc(const __m256 dv, const __m256 s, const __m256 t,
                                                                __m256 *acc) {
    *acc = _mm256_fmadd_ps(dv, t, _mm256_fmadd_ps(dv, s, *acc));
}

/* ... and all 8 steps from the pair's weight vectors w (5-8 rows: the 8 vectors stay in registers and
 * each row needs only its s, t and acc) */
static inline __attribute__((always_inline)) void q4_1_pair_dot(const __m256 w[8], const float *xp, const __m256 dv,
                                                                __m256 *acc) {
    __m256 s, t;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) q4_1_pair_step(k, w[k], _mm256_loadu_ps(xp + 8 * k), &s, &t);
    q4_1_pair_acc(dv, s, t, acc);
}

/* G (<= 4) rows' products over one block pair (quants q, the rows' pair_x values from xb, row stride K), one
 * k at a time for all rows: each weight vector is converted once and only the rows' chains stay live */
static inline __attribute__((always_inline)) void q4_1_pair_rows(const __m256i q, const float *xb, const int G, int K,
                                                                 const float *dn, __m256 *acc) {
    __m256 s[4], t[4];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m256 wk = q4_1_pair_w(q, k);
#pragma GCC unroll 4
        for (int m = 0; m < G; m++) q4_1_pair_step(k, wk, _mm256_loadu_ps(xb + (int64_t)m * K + 8 * k), &s[m], &t[m]);
    }
    const __m256 dv = q4_1_pair_d(dn);
#pragma GCC unroll 4
    for (int m = 0; m < G; m++) q4_1_pair_acc(dv, s[m], t[m], &acc[m]);
}
#endif

#ifdef __AVX512F__
/* 16 horizontal sums at once: source s's total lands in lane 4 * (s % 4) + s / 4, each added up in
 * exactly _mm512_reduce_add_ps's order (lanes i + i+8, then + i+4, then + i+2, then 0 + 1; float
 * addition is commutative, so which operand comes first does not matter): the same bits as separate
 * reduces, in about a third of the instructions (sources beyond the caller's count are constant zeros,
 * which the compiler folds away). */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512d a = _mm512_castps_pd(u[2 * h]), b = _mm512_castps_pd(u[2 * h + 1]);
        w[h] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* AVX-512 float32 Q4_1 by block quads, the AVX2 kernels' pair trick at 512 bits. Four blocks' 64 quant
 * bytes are one load of 16 dwords (4 per block); nibble k of every dword is isolated in place,
 * v & (0xF << 4k), and converted: q * 2^4k, exact in float32 (the top nibble, which would set the sign
 * bit, is shifted down instead). 16 weights cost an and and a convert, with no widening shuffles: a quad's
 * 128 weights take 17 instructions, and each row 8 multiply-adds and 2 scalings, where widening each
 * block took ~36, and each row 12 and a scalar offset sum per block. The weights come in the order
 * (k, dword) instead of k, so each row of x is permuted to match once per call (quad_x) and pre-scaled by
 * 2^-4k: every product is q * x exactly
 * (for |x| >= 2^-102, below which x * 2^-24 is subnormal and loses bits). A row's last nb % 4 blocks form
 * a short quad: masked loads of their 4 (nb % 4) dwords, and x packed at that stride (a row of the
 * permutation still fills exactly K floats), the missing lanes zeros that add nothing. */
static void quad_x(const float *x, int K, float *xp) {
    const int nb = K / QK;
    /* dword l holds bytes 4 (l % 4) .. + 3 of block b + l / 4; byte j's low nibble is q[j], its high nibble
     * q[j + 16]: nibble k of dword l is weight 4 (l % 4) + k / 2 (+ 16 for odd k) of its block */
    const __m512i dword_at = _mm512_setr_epi32(0, 4, 8, 12, QK, QK + 4, QK + 8, QK + 12, 2 * QK, 2 * QK + 4,
                                               2 * QK + 8, 2 * QK + 12, 3 * QK, 3 * QK + 4, 3 * QK + 8, 3 * QK + 12);
    int b = 0;
    for (; b + 4 <= nb; b += 4)
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const float scale = k == 7 ? 1.f : 1.f / (float)(1 << (4 * k));
            const __m512 v = _mm512_i32gather_ps(dword_at, x + b * QK + k / 2 + (k & 1 ? 16 : 0), 4);
            _mm512_storeu_ps(xp + b * QK + 16 * k, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
        }
    const int r = nb - b;
    if (r) {
        const __mmask16 lanes = (__mmask16)((1u << (4 * r)) - 1);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const float scale = k == 7 ? 1.f : 1.f / (float)(1 << (4 * k));
            const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, dword_at,
                                                      x + b * QK + k / 2 + (k & 1 ? 16 : 0), 4);
            _mm512_mask_storeu_ps(xp + b * QK + 4 * r * k, lanes, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
        }
    }
}

/* weights k * 16 .. k * 16 + 15 of the quad whose 64 quant bytes are q (see quad_x), as float32 */
static inline __attribute__((always_inline)) __m512 q4_1_quad_w(const __m512i q, const int k) {
    return _mm512_cvtepi32_ps(k < 7 ? _mm512_and_si512(q, _mm512_set1_epi32(0xF << (4 * k))) : _mm512_srli_epi32(q, 28));
}

/* the quad's scales (dn points at its first block's; `blocks` of them) as lanes 4j .. 4j + 3, like the weights */
static inline __attribute__((always_inline)) __m512 q4_1_quad_d(const float *dn, const __mmask8 blocks) {
    const __m128 d4 = blocks == 0xF ? _mm_loadu_ps(dn) : _mm_maskz_loadu_ps(blocks, dn);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(d4));
}

/* One (row, feature) product over a quad, the same operations in the same order in every kernel: even k
 * into the chain s, odd k into t, then acc += d * s, acc += d * t. Step k: */
static inline __attribute__((always_inline)) void q4_1_quad_step(const int k, const __m512 wk, const __m512 xk,
                                                                 __m512 *s, __m512 *t) {
    if (k < 2) *(k == 0 ? s : t) = _mm512_mul_ps(wk, xk);
    else if (k % 2 == 0) *s = _mm512_fmadd_ps(wk, xk, *s);
    else *t = _mm512_fmadd_ps(wk, xk, *t);
}

/* x values k * stride .. + 15 of a quad (stride 16; a short quad's 4 (nb % 4), its other lanes zeros) */
static inline __attribute__((always_inline)) __m512 quad_xk(const float *xb, const int k, const int stride,
                                                            const __mmask16 lanes) {
    return stride == 16 ? _mm512_loadu_ps(xb + 16 * k) : _mm512_maskz_loadu_ps(lanes, xb + stride * k);
}

/* M rows' products over one quad (quants q, scales dv, the rows' quad_x values from xb, row stride K) into
 * acc. 1-4 rows one k at a time for all rows (each weight vector converted once, only the rows' chains
 * live); 5-8 rows the 8 weight vectors first, then row by row (their chains at once would spill). */
static inline __attribute__((always_inline)) void q4_1_quad_rows(const __m512i q, const __m512 dv, const float *xb,
                                                                 const int M, int K, const int stride,
                                                                 const __mmask16 lanes, __m512 *acc) {
    if (M <= 4) {
        __m512 s[4], t[4];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512 wk = q4_1_quad_w(q, k);
#pragma GCC unroll 4
            for (int m = 0; m < M && m < 4; m++)
                q4_1_quad_step(k, wk, quad_xk(xb + (int64_t)m * K, k, stride, lanes), &s[m], &t[m]);
        }
#pragma GCC unroll 4
        for (int m = 0; m < M && m < 4; m++) acc[m] = _mm512_fmadd_ps(dv, t[m], _mm512_fmadd_ps(dv, s[m], acc[m]));
        return;
    }
    __m512 w[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) w[k] = q4_1_quad_w(q, k);
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        __m512 s, t;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) q4_1_quad_step(k, w[k], quad_xk(xb + (int64_t)m * K, k, stride, lanes), &s, &t);
        acc[m] = _mm512_fmadd_ps(dv, t, _mm512_fmadd_ps(dv, s, acc[m]));
    }
}

/* sum over blocks b of mn[b] * sums[b] (Q4_1's offset term of one row and feature), 16 blocks per lane */
static inline __attribute__((always_inline)) __m512 offset_sum16(const float *mn, const float *sums, int nb) {
    __m512 s = _mm512_setzero_ps();
    int b = 0;
    for (; b + 16 <= nb; b += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(mn + b), _mm512_loadu_ps(sums + b), s);
    if (b < nb) {
        const __mmask16 lanes = (__mmask16)((1u << (nb - b)) - 1);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, mn + b), _mm512_maskz_loadu_ps(lanes, sums + b), s);
    }
    return s;
}

/* Output feature n's totals for M rows, as 16 lanes each into v[0..M) (their sum is the result): even
 * quads into acc, odd into accb (two chains), the short quad last, then the offsets. The order is fixed
 * by K alone, so a row's bits do not depend on M. */
static inline __attribute__((always_inline)) void q4_1_feature_f32(const float *xq, const int M, int K,
                                                                   const uint8_t *qs, const float *d, const float *mn,
                                                                   const float *sums, int n, __m512 *v) {
    const int nb = K / QK;
    const uint8_t *row = qs + (int64_t)n * nb * 16;
    const float *dn = d + (int64_t)n * nb, *mnn = mn + (int64_t)n * nb;
    __m512 acc[MAX_ROWS], accb[MAX_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m] = accb[m] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
        q4_1_quad_rows(_mm512_loadu_si512(row + b * 16), q4_1_quad_d(dn + b, 0xF), xq + b * QK, M, K, 16, 0xFFFF, acc);
        q4_1_quad_rows(_mm512_loadu_si512(row + (b + 4) * 16), q4_1_quad_d(dn + b + 4, 0xF), xq + (b + 4) * QK, M, K,
                       16, 0xFFFF, accb);
    }
    if (b + 4 <= nb) {
        q4_1_quad_rows(_mm512_loadu_si512(row + b * 16), q4_1_quad_d(dn + b, 0xF), xq + b * QK, M, K, 16, 0xFFFF, acc);
        b += 4;
    }
    const int r = nb - b;
    if (r) {
        const __mmask16 lanes = (__mmask16)((1u << (4 * r)) - 1);
        q4_1_quad_rows(_mm512_maskz_loadu_epi32(lanes, row + b * 16), q4_1_quad_d(dn + b, (__mmask8)((1u << r) - 1)),
                       xq + b * QK, M, K, 4 * r, lanes, accb);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
        v[m] = _mm512_add_ps(_mm512_add_ps(acc[m], accb[m]), offset_sum16(mnn, sums + (int64_t)m * nb, nb));
}

/* acc[m] += d * (block b . row m of x) for a Q8_0 feature's block b */
static inline __attribute__((always_inline)) void q8_0_block_rows(const int8_t *row, const float *dn, const float *x,
                                                                  const int M, int K, int b, __m512 *acc) {
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + b * QK))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + b * QK + 16))));
    const __m512 scale = _mm512_set1_ps(dn[b]);
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) {
        const float *xb = x + (int64_t)m * K + b * QK;
        acc[m] = _mm512_fmadd_ps(scale, _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb))),
                                 acc[m]);
    }
}

/* Q8_0 likewise: even blocks into acc, odd into accb */
static inline __attribute__((always_inline)) void q8_0_feature_f32(const float *x, const int M, int K, const int8_t *qs,
                                                                   const float *d, int n, __m512 *v) {
    const int nb = K / QK;
    const int8_t *row = qs + (int64_t)n * K;
    const float *dn = d + (int64_t)n * nb;
    __m512 acc[MAX_ROWS], accb[MAX_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m] = accb[m] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        q8_0_block_rows(row, dn, x, M, K, b, acc);
        q8_0_block_rows(row, dn, x, M, K, b + 1, accb);
    }
    if (b < nb) q8_0_block_rows(row, dn, x, M, K, b, acc);
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) v[m] = _mm512_add_ps(acc[m], accb[m]);
}

/* features ahead (the AVX2 kernels' 8, tuned on a Zen 3, left a Zen 5's memory latency showing: 16 made
 * a float32 single stream 3-7% faster) */
#define PREFETCH_AHEAD_F32_512 16

/* G consecutive features from n (G * M <= 16) reduced together by one reduce16 (source f * M + m: feature
 * f, row m) and stored, the weights of the feature PREFETCH_AHEAD_F32_512 on asked for (see prefetch_rows_f32).
 * At 1-4 rows 16 / M features share a reduce16, as the bf16 kernels do; reduce16 sums each source in the
 * same order wherever it lands. */
static inline __attribute__((always_inline)) NO_SLP void group_f32(const int kind, const float *xq, const int M, int K,
                                                                   const void *qs, const float *d, const float *mn,
                                                                   float *y, int N, const float *sums, int n,
                                                                   const int G, int n1, int stream) {
    const int nb = K / QK;
    __m512 v[16];
#pragma GCC unroll 16
    for (int s = G * M; s < 16; s++) v[s] = _mm512_setzero_ps();
    for (int f = 0; f < G; f++) {
        const int64_t ahead = n + f + PREFETCH_AHEAD_F32_512;
        if (kind == 0) {
            if (ahead < n1)
                prefetch_rows_f32((const uint8_t *)qs + ahead * nb * 16, nb * 16, d + ahead * nb, mn + ahead * nb, nb,
                                  stream);
            q4_1_feature_f32(xq, M, K, (const uint8_t *)qs, d, mn, sums, n + f, v + f * M);
        } else {
            if (ahead < n1) prefetch_rows_f32((const int8_t *)qs + ahead * K, K, d + ahead * nb, NULL, nb, stream);
            q8_0_feature_f32(xq, M, K, (const int8_t *)qs, d, n + f, v + f * M);
        }
    }
    float out[16];
    _mm512_storeu_ps(out, reduce16(v));
#pragma GCC unroll 16
    for (int s = 0; s < G * M; s++) y[(int64_t)(s % M) * N + n + s / M] = out[4 * (s % 4) + s / 4];
}

#define GROUPED_MAX_ROWS_F32 4
static inline __attribute__((always_inline)) void rowsm_f32(const int kind, const float *xq, const int M, int K,
                                                             const void *qs, const float *d, const float *mn, float *y,
                                                             int N, const float *sums, int n0, int n1, int stream) {
    const int G = M <= GROUPED_MAX_ROWS_F32 ? 16 / M : 1;
    int n = n0;
    for (; n + G <= n1; n += G) group_f32(kind, xq, M, K, qs, d, mn, y, N, sums, n, G, n1, stream);
    for (; n < n1; n++) group_f32(kind, xq, M, K, qs, d, mn, y, N, sums, n, 1, n1, stream);
}
#endif

/* ---- float32 activations: the file's exact weight values ---------------------------------------- */

#ifndef __AVX512F__
/* AVX2: rows [0, M) of one group (M <= MAX_ROWS); sums: the group's per-block sums of x. Inlined with M a
 * compile-time constant (the dispatchers below), so the per-row accumulators stay in registers (1.2-1.5x
 * faster over the layer weights from memory). No SLP vectorization (here and in group_f32): with M
 * constant gcc may pack the rows' scalar work into vectors and contract its multiply-adds differently
 * from the code one row gets (an earlier kernel's per-row offset sums gave 8 rows other bits than each
 * row alone). */
static inline __attribute__((always_inline)) NO_SLP void q4_1_rows_f32_m(const float *x, const int M, int K,
                                                                         const uint8_t *qs, const float *d,
                                                                         const float *mn, float *y, int N,
                                                                         const float *sums, int n0, int n1,
                                                                         int stream) {
    int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = qs + (int64_t)n * nb * 16;
        const float *dn = d + (int64_t)n * nb, *mnn = mn + (int64_t)n * nb;
        if (n + PREFETCH_AHEAD_F32 < n1) prefetch_rows_f32(row + (int64_t)PREFETCH_AHEAD_F32 * nb * 16, nb * 16,
                                                           dn + (int64_t)PREFETCH_AHEAD_F32 * nb,
                                                           mnn + (int64_t)PREFETCH_AHEAD_F32 * nb, nb, stream);
        /* x is pair_x's permutation of the rows; the offsets' sum runs after the blocks, 8 blocks per lane */
        __m256 acc[MAX_ROWS], w[8];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(row + b * 16));
            const float *xb = x + b * QK;
            if (M <= 4) {
                q4_1_pair_rows(q, xb, M, K, dn + b, acc);
            } else {
                /* the 8 weight vectors first, then row by row: 5-8 rows' chains at once would spill (as
                 * would two groups converting the weights twice: 5-8 rows 25% slower) */
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) w[k] = q4_1_pair_w(q, k);
                const __m256 dv = q4_1_pair_d(dn + b);
                /* spelled out: gcc left a loop over 5-7 rows partly rolled, with the accumulators in memory */
#define ROW_DOT(m) if (M > m) q4_1_pair_dot(w, xb + (int64_t)m * K, dv, &acc[m])
                ROW_DOT(0); ROW_DOT(1); ROW_DOT(2); ROW_DOT(3); ROW_DOT(4); ROW_DOT(5); ROW_DOT(6); ROW_DOT(7);
#undef ROW_DOT
            }
        }
        if (b < nb) {
            q4_1_block_w(row + b * 16, w);
            fma_block_rows(acc, w, dn[b], x, M, K, b);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            y[(int64_t)m * N + n] = hsum8(_mm256_add_ps(acc[m], offset_sum8(mnn, sums + m * nb, nb)));
    }
}

static inline __attribute__((always_inline)) void q8_0_rows_f32_m(const float *x, const int M, int K, const int8_t *qs,
                                                                 const float *d, float *y, int N, int n0,
                                                                 int n1, int stream) {
    int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        const int8_t *row = qs + (int64_t)n * K;
        const float *dn = d + (int64_t)n * nb;
        if (n + PREFETCH_AHEAD_F32 < n1)
            prefetch_rows_f32(row + (int64_t)PREFETCH_AHEAD_F32 * K, K, dn + (int64_t)PREFETCH_AHEAD_F32 * nb, NULL, nb,
                              stream);
        /* even blocks into acc, odd into accb, as the Q4_1 kernel */
        __m256 acc[MAX_ROWS], accb[MAX_ROWS], w[4];
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = accb[m] = _mm256_setzero_ps();
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            q8_0_block_w(row + b * QK, w);
            fma_block_rows(acc, w, dn[b], x, M, K, b);
            q8_0_block_w(row + (b + 1) * QK, w);
            fma_block_rows(accb, w, dn[b + 1], x, M, K, b + 1);
        }
        if (b < nb) {
            q8_0_block_w(row + b * QK, w);
            fma_block_rows(acc, w, dn[b], x, M, K, b);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum8(_mm256_add_ps(acc[m], accb[m]));
    }
}


/* AVX2, one row: two output features per pass, the same operations per feature as q4_1_rows_f32_m (the
 * same bits); the second feature's chains run while the first's wait, and the x values are loaded once.
 * x is pair_x's permutation. */
static NO_SLP void q4_1_row1_f32(const float *x, int K, const uint8_t *qs, const float *d, const float *mn,
                                 float *y, const float *sums, int n0, int n1, int stream) {
    const int nb = K / QK;
    int n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint8_t *row = qs + (int64_t)n * nb * 16;
        const float *dn = d + (int64_t)n * nb, *mnn = mn + (int64_t)n * nb;
        if (n + PREFETCH_AHEAD_F32 + 1 < n1)
            prefetch_rows_f32(row + (int64_t)PREFETCH_AHEAD_F32 * nb * 16, 2 * nb * 16,
                              dn + (int64_t)PREFETCH_AHEAD_F32 * nb, mnn + (int64_t)PREFETCH_AHEAD_F32 * nb, 2 * nb,
                              stream);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, w[4], v[4];
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            /* the two features' chains one k at a time, as q4_1_rows_f32_m does for 1-4 rows */
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(row + b * 16));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(row + (nb + b) * 16));
            __m256 s0, t0, s1, t1;
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m256 xk = _mm256_loadu_ps(x + b * QK + 8 * k);
                q4_1_pair_step(k, q4_1_pair_w(q0, k), xk, &s0, &t0);
                q4_1_pair_step(k, q4_1_pair_w(q1, k), xk, &s1, &t1);
            }
            q4_1_pair_acc(q4_1_pair_d(dn + b), s0, t0, &a0);
            q4_1_pair_acc(q4_1_pair_d(dn + nb + b), s1, t1, &a1);
        }
        if (b < nb) {
            q4_1_block_w(row + b * 16, w);
            q4_1_block_w(row + (nb + b) * 16, v);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(dn[b]), dot_block(w[0], w[1], w[2], w[3], x + b * QK), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(dn[nb + b]), dot_block(v[0], v[1], v[2], v[3], x + b * QK), a1);
        }
        y[n] = hsum8(_mm256_add_ps(a0, offset_sum8(mnn, sums, nb)));
        y[n + 1] = hsum8(_mm256_add_ps(a1, offset_sum8(mnn + nb, sums, nb)));
    }
    if (n < n1) q4_1_rows_f32_m(x, 1, K, qs, d, mn, y, 0, sums, n, n1, stream);
}
#endif

static NO_SLP void q4_1_rows_f32(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *mn,
                                 float *y, int N, const float *sums, int n0, int n1, int stream) {
#ifdef __AVX512F__
#define Q4_1_F32(R) rowsm_f32(0, x, R, K, qs, d, mn, y, N, sums, n0, n1, stream)
#else
    if (M == 1) {
        q4_1_row1_f32(x, K, qs, d, mn, y, sums, n0, n1, stream);
        return;
    }
#define Q4_1_F32(R) q4_1_rows_f32_m(x, R, K, qs, d, mn, y, N, sums, n0, n1, stream)
#endif
    ROWS_SWITCH(Q4_1_F32)
#undef Q4_1_F32
}

static void q8_0_rows_f32(const float *x, int M, int K, const int8_t *qs, const float *d, float *y, int N, int n0,
                          int n1, int stream) {
#ifdef __AVX512F__
#define Q8_0_F32(R) rowsm_f32(1, x, R, K, qs, d, NULL, y, N, NULL, n0, n1, stream)
#else
#define Q8_0_F32(R) q8_0_rows_f32_m(x, R, K, qs, d, y, N, n0, n1, stream)
#endif
    ROWS_SWITCH(Q8_0_F32)
#undef Q8_0_F32
}

/* ---- bfloat16 activations: the weights rounded to bfloat16 -------------------------------------- *
 * The dense path of a bf16 model multiplies the dequantized weights rounded to bf16 (oneDNN, larger
 * batches), so these kernels use exactly those values too: w = bf16(d * q + mn) (d * q is exact in
 * float32, so one rounding before the bf16 one, as in the dequantized checkpoint). Both paths then
 * compute the same products in float32 and differ only in summation order.
 *
 * Weight kinds: 0 = Q4_1, 1 = Q8_0, 2 = dense float32 [N, K], 3 = dense bfloat16 [N, K] (the
 * dense kinds serve --deterministic on models without GGUF blocks; their dtype is the activations'). */

#ifdef __AVX512BF16__
/* CPUs with AVX-512 BF16: a block's 32 weights converted to bf16 in one instruction (round to
 * nearest even, as torch's .to(bfloat16)), bf16 pairs multiplied and summed into float32 lanes by
 * vdpbf16ps, reading the bf16 activations as they are. (Compilers enable AVX-512 BW with AVX-512 BF16, so
 * its word shuffles are there too.) */

/* A Q4_1 block has only 16 distinct weights, d * j + mn for j = 0..15: built once per block (the same fmadd
 * as dequantizing each weight, so after the bf16 rounding the same values), every weight is then looked up
 * by its nibble instead of widening, converting and scaling 32 lanes */
static inline __m512 q4_1_values(float d, float mn) {
    const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                       14.f, 15.f);
    return _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(mn));
}

static inline __m512bh q4_1_block_pbh(const uint8_t *bytes, float d, float mn) {
    const __m512 t = q4_1_values(d, mn);
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);  /* words 16..31 repeat 0..15 */
    /* word k < 16: byte k (vpermw reads 5 bits: the low nibble, plus 16 for an odd high nibble, which
     * the repeated table absorbs); word k >= 16: byte k - 16 >> 4, its high nibble */
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i idx = _mm512_srlv_epi16(
        _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes))), shifts);
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

/* d * the 16 Q8_0 quants at p, as float32 */
static inline __m512 q8_0_values16(const int8_t *p, __m512 d) {
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}

static inline __m512bh q8_0_block_pbh(const int8_t *bytes, float d) {
    const __m512 dv = _mm512_set1_ps(d);
    return _mm512_cvtne2ps_pbh(q8_0_values16(bytes + 16, dv), q8_0_values16(bytes, dv));  /* k 0..15 low */
}

static inline __attribute__((always_inline)) __m512bh block_pbh(int kind, const void *qs, const float *d,
                                                                 const float *mn, int64_t n, int nb, int b) {
    const int64_t i = n * nb + b;
    if (kind == 0) return q4_1_block_pbh((const uint8_t *)qs + i * 16, d[i], mn[i]);
    if (kind == 1) return q8_0_block_pbh((const int8_t *)qs + i * QK, d[i]);
    return (__m512bh)_mm512_loadu_si512((const uint16_t *)qs + i * QK);  /* kind 3 */
}

/* Blocks go through the kernels in pairs (b, b + 1), as two vectors of 32 weights:
 *   lo = [block b: k 0..15 | block b + 1: k 0..15],  hi = [block b: k 16..31 | block b + 1: k 16..31],
 * with x permuted the same way once per call (pair_x_rows), so the products and their float32 lanes are
 * those of the blocks in k order, summed in another fixed order. For Q4_1 one vpermw table then holds both
 * blocks' 16 values (words 0..15 block b's, 16..31 block b + 1's): one conversion to bf16 per pair instead
 * of one per block, and one widening of the pair's 32 quant bytes, whose words index the table after a
 * mask (low nibbles) or a shift (high nibbles) and the block's bit: ~13% off a 1-row pass over weights in
 * cache on the 2-core Zen 4 (benchmarks/BENCHMARKS.md, session 38). Every kind (and the dense copy of a
 * GGUF weight) takes the same order, so their bits agree. A K / 32 that is odd leaves a last block alone,
 * in k order with x as it is. */
static inline void q4_1_pair_pbh(const uint8_t *bytes, const float *d, const float *mn, __m512bh *lo,
                                 __m512bh *hi) {
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(q4_1_values(d[1], mn[1]), q4_1_values(d[0], mn[0]));
    const __m512i block = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    /* word k: byte k of the pair (block b's 16 bytes, then block b + 1's): low nibble q[k % 16], high q[k % 16 + 16] */
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)bytes));
    const __m512i lo_idx = _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x0F), block, 0xEA);  /* (w & 15) | block */
    const __m512i hi_idx = _mm512_or_si512(_mm512_srli_epi16(w, 4), block);
    *lo = (__m512bh)_mm512_permutexvar_epi16(lo_idx, table);
    *hi = (__m512bh)_mm512_permutexvar_epi16(hi_idx, table);
}

static inline void q8_0_pair_pbh(const int8_t *bytes, const float *d, __m512bh *lo, __m512bh *hi) {
    const __m512 d0 = _mm512_set1_ps(d[0]), d1 = _mm512_set1_ps(d[1]);
    *lo = _mm512_cvtne2ps_pbh(q8_0_values16(bytes + QK, d1), q8_0_values16(bytes, d0));
    *hi = _mm512_cvtne2ps_pbh(q8_0_values16(bytes + QK + 16, d1), q8_0_values16(bytes + 16, d0));
}

static inline __m512i two_halves(const uint16_t *a, const uint16_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* the pair of blocks (b, b + 1) of output feature n as lo, hi (above) */
static inline __attribute__((always_inline)) void block_pair_pbh(int kind, const void *qs, const float *d,
                                                                 const float *mn, int64_t n, int nb, int b,
                                                                 __m512bh *lo, __m512bh *hi) {
    const int64_t i = n * nb + b;
    if (kind == 0) {
        q4_1_pair_pbh((const uint8_t *)qs + i * 16, d + i, mn + i, lo, hi);
    } else if (kind == 1) {
        q8_0_pair_pbh((const int8_t *)qs + i * QK, d + i, lo, hi);
    } else {  /* kind 3 */
        const uint16_t *w = (const uint16_t *)qs + i * QK;
        *lo = (__m512bh)two_halves(w, w + QK);
        *hi = (__m512bh)two_halves(w + 16, w + QK + 16);
    }
}

/* the even / odd bf16 members of v's 32 as float32 (the top half of a float32 is the bf16) */
static inline __m512 even_f32(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 odd_f32(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000))); }

/* rows of x [M, K] (bf16) in the pair order of block_pair_pbh, 32 values a chunk, into out [M, K]: as bf16 or, with
 * `widen` (dp_fma's rows), each chunk as its 16 odd members then its 16 even ones in float32 (out: M * K floats) */
static void pair_x_rows(const uint16_t *x, int M, int K, void *out, int widen) {
    const int nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *r = x + m * K;
        for (int b = 0; b < nb; b += 2) {
            const uint16_t *x0 = r + b * QK, *x1 = x0 + QK;
            /* a pair's lo, hi chunks; a last lone block as it is */
            const __m512i chunk[2] = {b + 1 < nb ? two_halves(x0, x1) : _mm512_loadu_si512(x0),
                                      b + 1 < nb ? two_halves(x0 + 16, x1 + 16) : _mm512_setzero_si512()};
            for (int h = 0; h < (b + 1 < nb ? 2 : 1); h++) {
                const int64_t at = m * K + (b + h) * QK;
                if (widen) {
                    _mm512_storeu_ps((float *)out + at, odd_f32(chunk[h]));
                    _mm512_storeu_ps((float *)out + at + 16, even_f32(chunk[h]));
                } else {
                    _mm512_storeu_si512((uint16_t *)out + at, chunk[h]);
                }
            }
        }
    }
}

/* Ask for output feature n's blocks (quants, scales, offsets) ahead of use. Each thread walks its
 * features in order, one short run of bytes per array and feature; the 210 weights of a small model are
 * each too short for the hardware prefetcher to ramp up on (8 features ahead: ~3-8% off a pass over
 * SmolLM2-135M's layer weights from memory, any row count; 16 ahead: 1-row passes another ~6% faster and a
 * single stream ~5% on a 2-core Zen 5, where 8 features at 1 row, ~150 ns, left its memory latency
 * showing). */
#define PREFETCH_AHEAD 16
static inline __attribute__((always_inline)) void prefetch_feature(const int kind, const void *qs, const float *d,
                                                                    const float *mn, int64_t n, int nb) {
    const int bytes = nb * (kind == 0 ? 16 : kind == 1 ? 32 : 64);
    const char *q = (const char *)qs + n * bytes;
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
    if (kind == 3) return;
    for (int o = 0; o < nb * 4; o += 64) _mm_prefetch((const char *)(d + n * nb) + o, _MM_HINT_T0);
    if (kind == 0)
        for (int o = 0; o < nb * 4; o += 64) _mm_prefetch((const char *)(mn + n * nb) + o, _MM_HINT_T0);
}

/* VDPBF16PS is slow on some cores (a 2-core Sapphire Rapids Xeon: one every ~2 cycles, where an FMA issues twice a
 * cycle), and on Intel's it is two fused multiply-adds per float32 lane, the odd bf16 pair member first, with DAZ and
 * FTZ: fma(even w, even x, fma(odd w, odd x, acc)) with the denormal flags set gives the same bits (checked at start,
 * dp_is_two_fmas). With 2-8 rows the weights' bf16 halves are widened once (a shift, a mask) and shared by the rows,
 * the rows' x widened once per call (pair_x_rows), so a row's products cost two FMAs and two loads. */

/* acc + the dot products of a 32-value chunk: w's odd / even members against x's (xc: 16 odd, then 16 even floats) */
static inline __attribute__((always_inline)) __m512 dp_fma(__m512 acc, __m512 w_o, __m512 w_e, const float *xc) {
    return _mm512_fmadd_ps(w_e, _mm512_loadu_ps(xc + 16), _mm512_fmadd_ps(w_o, _mm512_loadu_ps(xc), acc));
}

/* acc + the products of the weights' 32-value chunk w with x's chunk at element `at` of x as pair_x_rows left it:
 * VDPBF16PS on bf16 x, or (fma2) dp_fma on widened x with w's halves w_o, w_e (widened once for all rows) */
static inline __attribute__((always_inline)) __m512 chunk_dp(__m512 acc, __m512bh w, __m512 w_o, __m512 w_e,
                                                            const void *x, int64_t at, const int fma2) {
    if (fma2) return dp_fma(acc, w_o, w_e, (const float *)x + at);
    return _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_loadu_si512((const uint16_t *)x + at));
}

/* whether this core's VDPBF16PS gives the two FMAs' bits (dp_fma) under DAZ and FTZ, on values of every scale down to
 * the denormal range (1 on Intel's cores, where the instruction is defined that way; once, then cached) */
static int dp_is_two_fmas(void) {
    static int known = -1;
    if (known >= 0) return known;
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    uint32_t state = 12345;
    int same = 1;
    for (int it = 0; it < 4096 && same; it++) {
        uint16_t w[32], xv[32];
        float acc[16], xf[32];
        for (int i = 0; i < 32; i++) {
            state = state * 1664525u + 1013904223u;
            w[i] = (uint16_t)(state >> 16) & (it % 3 ? 0xBFFF : 0x81FF);  /* every sign and exponent; tiny ones */
            state = state * 1664525u + 1013904223u;
            xv[i] = (uint16_t)(state >> 16) & (it % 4 ? 0xBFFF : 0x80FF);
        }
        for (int i = 0; i < 16; i++) {
            state = state * 1664525u + 1013904223u;
            uint32_t bits = state & (it % 2 ? 0xBFFFFFFFu : 0x80FFFFFFu);
            memcpy(&acc[i], &bits, 4);
        }
        const __m512i wv = _mm512_loadu_si512(w), x = _mm512_loadu_si512(xv);
        _mm512_storeu_ps(xf, odd_f32(x));
        _mm512_storeu_ps(xf + 16, even_f32(x));
        const __m512 a = _mm512_loadu_ps(acc);
        const __m512 ref = _mm512_dpbf16_ps(a, (__m512bh)wv, (__m512bh)x);
        const __m512 got = dp_fma(a, odd_f32(wv), even_f32(wv), xf);
        same = _mm512_cmpeq_epi32_mask(_mm512_castps_si512(ref), _mm512_castps_si512(got)) == 0xFFFF;
    }
    _mm_setcsr(csr);
    known = same;
    return known;
}

/* 1 where bf16 products of 2-8 rows take dp_fma (tests and benchmarks ask) */
int gguf_rows_take_fmas(void) { return dp_is_two_fmas(); }

/* The sums of output feature n for M rows (1..MAX_ROWS) of x (in pair order: pair_x_rows) into v[0..M): each
 * block pair's lo vector into one accumulator, its hi vector into another (a last lone block into the first),
 * then their sum. M and the weight kind are compile-time constants at each call site, so
 * the 2 * M accumulators stay in registers (a stack array indexed by a run-time m had every vdpbf16ps load
 * and store its accumulator: 4-8 rows cost 1.7-2.3x one row). Each block is dequantized once for all M
 * rows; the x blocks come from L1. The order is fixed whatever M is, so a row's bits do not depend on the
 * other rows. */
static inline __attribute__((always_inline)) void feature_sums(const void *x, const int M, int K, const int kind,
                                                                const void *qs, const float *d, const float *mn,
                                                                int n, __m512 *v, const int fma2) {
    const int nb = K / QK;
    __m512 acc[MAX_ROWS], accb[MAX_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m] = accb[m] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512bh lo, hi;
        block_pair_pbh(kind, qs, d, mn, n, nb, b, &lo, &hi);
        const __m512 lo_o = fma2 ? odd_f32((__m512i)lo) : _mm512_setzero_ps();
        const __m512 lo_e = fma2 ? even_f32((__m512i)lo) : lo_o;
        const __m512 hi_o = fma2 ? odd_f32((__m512i)hi) : lo_o;
        const __m512 hi_e = fma2 ? even_f32((__m512i)hi) : lo_o;
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
            const int64_t at = (int64_t)m * K + b * QK;
            acc[m] = chunk_dp(acc[m], lo, lo_o, lo_e, x, at, fma2);
            accb[m] = chunk_dp(accb[m], hi, hi_o, hi_e, x, at + QK, fma2);
        }
    }
    if (b < nb) {
        const __m512bh w0 = block_pbh(kind, qs, d, mn, n, nb, b);
        const __m512 w_o = fma2 ? odd_f32((__m512i)w0) : _mm512_setzero_ps();
        const __m512 w_e = fma2 ? even_f32((__m512i)w0) : w_o;
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = chunk_dp(acc[m], w0, w_o, w_e, x, (int64_t)m * K + b * QK, fma2);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) v[m] = _mm512_add_ps(acc[m], accb[m]);
}

/* G consecutive features from n (G * M <= 16): their sums reduced together by one reduce16 (source f * M + m:
 * feature f, row m), rounded to bfloat16 as store1 rounds one, and stored */
static inline __attribute__((always_inline)) void feature_group(const void *x, const int M, int K, const int kind,
                                                                 const void *qs, const float *d, const float *mn,
                                                                 uint16_t *y, int N, int n, const int G, int n1,
                                                                 const int fma2) {
    const int nb = K / QK;
    __m512 v[16];
#pragma GCC unroll 16
    for (int s = G * M; s < 16; s++) v[s] = _mm512_setzero_ps();
    for (int f = 0; f < G; f++) {
        if (n + f + PREFETCH_AHEAD < n1) prefetch_feature(kind, qs, d, mn, n + f + PREFETCH_AHEAD, nb);
        feature_sums(x, M, K, kind, qs, d, mn, n + f, v + f * M, fma2);
    }
    uint16_t out[16];
    store16(out, reduce16(v), 1);
#pragma GCC unroll 16
    for (int s = 0; s < G * M; s++) y[(int64_t)(s % M) * N + n + s / M] = out[4 * (s % 4) + s / 4];
}

/* M rows over output features [n0, n1). With at most GROUPED_MAX_ROWS rows, 16 / M features share one
 * reduce16, whose shuffles, rounding and extraction otherwise ran once per feature (~20 instructions beside
 * a K = 576 feature's ~180): 5-14% off a 1-2 row projection, 0-3% at 3-4 rows, slower from 6 (the
 * accumulators no longer fit in registers beside the group's sums). reduce16 reduces every source in the
 * same order wherever it lands, so grouping does not change any bits. One feature at a time within a
 * group: several features per pass (sharing the x loads) only paid with the weights in cache; reading them
 * from memory, one sequential run per array was faster. */
#define GROUPED_MAX_ROWS 4
static inline __attribute__((always_inline)) void rowsm_bf16(const void *x, const int M, int K, const int kind,
                                                              const void *qs, const float *d, const float *mn,
                                                              uint16_t *y, int N, int n0, int n1, const int fma2) {
    const int G = M <= GROUPED_MAX_ROWS ? 16 / M : 1;
    int n = n0;
    for (; n + G <= n1; n += G) feature_group(x, M, K, kind, qs, d, mn, y, N, n, G, n1, fma2);
    for (; n < n1; n++) feature_group(x, M, K, kind, qs, d, mn, y, N, n, 1, n1, fma2);
}

static inline __attribute__((always_inline)) void rowsm_any(const void *x, const int M, int K, int kind,
                                                             const void *qs, const float *d, const float *mn,
                                                             uint16_t *y, int N, int n0, int n1, const int fma2) {
    if (kind == 0) rowsm_bf16(x, M, K, 0, qs, d, mn, y, N, n0, n1, fma2);
    else if (kind == 1) rowsm_bf16(x, M, K, 1, qs, d, mn, y, N, n0, n1, fma2);
    else rowsm_bf16(x, M, K, 3, qs, d, mn, y, N, n0, n1, fma2);
}

/* one group of M <= MAX_ROWS rows: one copy of the kernel per (M, kind); fma2: x as pair_x_rows widened it, the products
 * as dp_fma's (2-8 rows), else x as pair_x_rows left it and VDPBF16PS */
static void rows_bf16(const void *x, int M, int K, int kind, const void *qs, const float *d, const float *mn,
                      uint16_t *y, int N, int n0, int n1, int fma2) {
    if (fma2) {
#define ROWSM(R) rowsm_any(x, R, K, kind, qs, d, mn, y, N, n0, n1, 1)
        ROWS_SWITCH(ROWSM)
#undef ROWSM
    } else {
#define ROWSM(R) rowsm_any(x, R, K, kind, qs, d, mn, y, N, n0, n1, 0)
        ROWS_SWITCH(ROWSM)
#undef ROWSM
    }
}
#endif

#if HAVE_AMX
/* ---- batches past MAX_ROWS on AMX tiles, straight from the blocks ------------------------------- *
 * A bf16 batch of more rows than MAX_ROWS takes AMX tiles (panel_gemm.c's amx_gemm_bf16) where the CPU has them,
 * on the dense bf16 copy of the weights: 2 bytes a weight from memory where the blocks hold 0.625 (Q4_1). Here the
 * blocks are dequantized, 32 output features at a time, into a buffer in the core's cache (q4_1_block_pbh: the
 * dense copy's values, k in order) and multiplied from there as A tiles (16 features x 32 k) against x transposed
 * into B tiles (16 k pairs x 16 rows), the C tiles (features x rows) transposed into y. A tile product's output
 * (m, n) adds the same k pairs' products in the same order whichever operand holds the weights, so every output has
 * the bits amx_gemm_bf16 gives on the dense copy. */
#define AMX_FEATURES 32
/* more rows take the panels: each unit of features here walks all of x^T, which past ~1000 rows no longer stays in
 * L2 (SmolLM2's gate/up: 1.22-1.35x the panels' speed at 16-512 rows, 0.74x at 2048) */
#define AMX_BLOCKS_MAX_ROWS 512

/* v[0..16) as rows of a 16 x 16 matrix of 32-bit lanes -> v[j] its column j: 32-bit unpacks, 64-bit unpacks, then
 * two rounds of 128-bit shuffles */
static inline __attribute__((always_inline)) void transpose16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        v[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        v[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        v[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        v[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        v[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* B tile (g, c) of x: rows [16 g, 16 g + 16) of x [M, K] (bf16) at k chunk c (32 k) as 16 rows (k pairs) x 16
 * dwords (one row of x each, its pair); rows past M zeros */
static void pack_xt_tile(const uint16_t *x, int M, int K, int g, int c, uint32_t *tile) {
    __m512 v[16];
    for (int r = 0; r < 16; r++)
        v[r] = 16 * g + r < M ? _mm512_loadu_ps((const float *)(x + (int64_t)(16 * g + r) * K + 32 * c))
                              : _mm512_setzero_ps();
    transpose16(v);
    for (int p = 0; p < 16; p++) _mm512_storeu_ps((float *)(tile + 16 * p), v[p]);
}

/* The dequantizing of one unit's features into a [AMX_FEATURES][K] buffer, done a few blocks at a time between tile
 * products (dequant_step) so that the vector units dequantize the next unit while the tiles multiply this one: a
 * unit is 32 features from n0 (or, with silu, 16 gate features from n0 and their 16 up features from n1) */
typedef struct {
    int kind, nb, first[2], limit[2];  /* feature ranges of 16 from first[h]; prefetches stop at limit[h] */
    const void *qs;
    const float *d, *mn;
    uint16_t *buf;
    int f, b;  /* the next block: feature f (of AMX_FEATURES), block b */
} dequant_job;

/* j set to dequantize unit u into buf: its features from first[0] and first[1] (see dequant_job) */
static inline void dequant_unit(dequant_job *j, int u, int silu, int I, uint16_t *buf) {
    j->first[0] = silu ? 16 * u : AMX_FEATURES * u;
    j->first[1] = silu ? I + 16 * u : j->first[0] + 16;
    j->buf = buf, j->f = j->b = 0;
}

static inline void dequant_step(dequant_job *j, int blocks) {
    const int K = j->nb * QK;
    while (blocks > 0 && j->f < AMX_FEATURES) {
        const int h = j->f >> 4;
        const int64_t row = j->first[h] + (j->f & 15);
        if (j->b == 0 && row + PREFETCH_AHEAD < j->limit[h])
            prefetch_feature(j->kind, j->qs, j->d, j->mn, row + PREFETCH_AHEAD, j->nb);
        int end = j->b + blocks < j->nb ? j->b + blocks : j->nb;
        end += (end - j->b) & 1 && end < j->nb;  /* whole pairs */
        uint16_t *out = j->buf + (int64_t)j->f * K;
        blocks -= end - j->b;
        int b = j->b;
        for (; b + 2 <= end; b += 2) {  /* a pair's lo / hi halves (block_pair_pbh) back into k order */
            __m512bh lo, hi;
            block_pair_pbh(j->kind, j->qs, j->d, j->mn, row, j->nb, b, &lo, &hi);
            _mm512_storeu_si512(out + b * QK, _mm512_shuffle_i64x2((__m512i)lo, (__m512i)hi, 0x44));
            _mm512_storeu_si512(out + (b + 1) * QK, _mm512_shuffle_i64x2((__m512i)lo, (__m512i)hi, 0xEE));
        }
        if (b < end)
            _mm512_storeu_si512(out + b * QK, (__m512i)block_pbh(j->kind, j->qs, j->d, j->mn, row, j->nb, b));
        j->b = end;
        if (end == j->nb) j->f++, j->b = 0;
    }
}

/* the 16 x 16 float32 tile c (rows: features, columns: rows of x) as 16-feature runs of `rows` rows of y */
static inline void store_transposed(const float c[16][16], uint16_t *y, int N, int rows) {
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_ps(c[i]);
    transpose16(v);
    /* v[j]: column j; + 0 as amx_gemm_bf16 adds its (zero) bias: a -0 sum is stored as +0 there too */
    for (int j = 0; j < rows; j++) store16(y + (int64_t)j * N, _mm512_add_ps(v[j], _mm512_setzero_ps()), 1);
}

/* C tiles 0-3 = (A tile a0, a1) x (B tiles of row groups g, g + 1 at k chunk c): tile 2 i + q is A i, group q */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *a, int K, const uint32_t *xt, int groups,
                                                           int g, int two, dequant_job *job, int per_step) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < K / 32; c++) {
        if (job) dequant_step(job, per_step);
        const uint32_t *b = xt + ((int64_t)c * groups + g) * 256;
        _tile_loadd(4, a + 32 * c, 2 * K);
        _tile_loadd(5, a + (int64_t)16 * K + 32 * c, 2 * K);
        _tile_loadd(6, b, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, b + 256, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* y [M, N] = x [M, K] w^T for bf16 x and the GGUF blocks of w (kind 0 Q4_1, 1 Q8_0), on AMX tiles, with the bits of
 * amx_gemm_bf16 on w's dense bf16 copy. `silu`: w is a fused gate/up projection of N = 2 I features and y [M, I]
 * gets silu(x gate^T) * (x up^T) with the bits of amx_gemm_bf16_silu (a unit of work is then 16 gate features and
 * their 16 up features, else 32 features). Returns 0 (nothing computed) where the CPU or Linux grants no tiles, K
 * or N is not a multiple of 32, M is past AMX_BLOCKS_MAX_ROWS, or memory runs out. The dequantizing and the tile
 * products of a core do not overlap in time here (measured: their sum), so this pays where the panels' 2 bytes a
 * weight cost more than the dequantizing: SmolLM2-135M's gate/up product (benchmarks/amx_blocks.py). */
static int amx_blocks(const uint16_t *x, int M, int K, int kind, const void *qs, const float *d, const float *mn,
                      uint16_t *y, int N, int silu) {
    if (M > AMX_BLOCKS_MAX_ROWS || K % 32 || N % AMX_FEATURES || !amx_permitted()) return 0;
    const int groups = (M + 15) / 16, nb = K / QK, I = N / 2;
    uint32_t *xt = thread_scratch(0, (size_t)(K / 32) * groups * 1024);  /* the caller's: every thread reads it */
    if (!xt) return 0;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *bufs = thread_scratch(1, (size_t)2 * AMX_FEATURES * K * 2);  /* this unit's, the next one's */
        if (!bufs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int i = 0; i < groups * (K / 32); i++)  /* tile (g, c) at (c * groups + g) */
            pack_xt_tile(x, M, K, i % groups, i / groups, xt + (int64_t)i * 256);
        if (!failed) {
            amx_configure();
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            /* silu: a unit is 16 gate features and their 16 up features; else 32 features */
            const int units = silu ? I / 16 : N / AMX_FEATURES;
            const int u0 = (int)((int64_t)units * t / nt), u1 = (int)((int64_t)units * (t + 1) / nt);
            /* the next unit's blocks spread over this unit's k steps */
            const int steps = (K / 32) * ((groups + 1) / 2), per_step = (AMX_FEATURES * nb + steps - 1) / steps;
            float c[4][16][16];
            /* prefetches stop at the end of this thread's features (with silu: of its gate, of its up features) */
            dequant_job job = {kind, nb, {0, 0}, {silu ? 16 * u1 : AMX_FEATURES * u1, silu ? I + 16 * u1 : AMX_FEATURES * u1},
                               qs, d, mn, bufs, 0, 0};
            if (u0 < u1) {  /* the first unit's blocks before any product */
                dequant_unit(&job, u0, silu, I, bufs);
                dequant_step(&job, AMX_FEATURES * nb);
            }
            for (int u = u0; u < u1; u++) {
                uint16_t *buf = bufs + (int64_t)((u - u0) & 1) * AMX_FEATURES * K;
                dequant_job *ahead = NULL;  /* the next unit's, into the other buffer */
                if (u + 1 < u1) {
                    dequant_unit(&job, u + 1, silu, I, bufs + (int64_t)((u + 1 - u0) & 1) * AMX_FEATURES * K);
                    ahead = &job;
                }
                for (int g = 0; g < groups; g += 2) {
                    const int two = g + 1 < groups;
                    amx_block(buf, K, xt, groups, g, two, ahead, per_step);
                    /* c[q]: A 0 (the first 16 features: gate with silu) x group g + q; c[2 + q]: A 1 (the next 16: up) */
                    _tile_stored(0, c[0], 64);
                    _tile_stored(2, c[2], 64);
                    if (two) {
                        _tile_stored(1, c[1], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    for (int q = 0; q <= two; q++) {
                        const int r0 = 16 * (g + q), rows = M - r0 < 16 ? M - r0 : 16;
                        if (!silu) {
                            store_transposed(c[q], y + (int64_t)r0 * N + AMX_FEATURES * u, N, rows);
                            store_transposed(c[2 + q], y + (int64_t)r0 * N + AMX_FEATURES * u + 16, N, rows);
                        } else {
                            uint16_t gt[16][16], ut[16][16];  /* the rounded gate and up sums, rows x features */
                            store_transposed(c[q], &gt[0][0], 16, rows);
                            store_transposed(c[2 + q], &ut[0][0], 16, rows);
                            for (int r = 0; r < rows; r++)
                                store16(y + (int64_t)(r0 + r) * I + 16 * u,
                                        _mm512_mul_ps(round16(silu16(load16(gt[r], 1)), 1), load16(ut[r], 1)), 1);
                        }
                    }
                }
                if (ahead) dequant_step(ahead, AMX_FEATURES * nb);  /* what the k steps left (rounding) */
            }
            _tile_release();
        }
    }
    return !failed;
}

int gguf_amx_gemm(const void *x, int M, int K, int kind, const void *qs, const float *d, const float *mn, void *y,
                  int N) {
    return amx_blocks((const uint16_t *)x, M, K, kind, qs, d, mn, (uint16_t *)y, N, 0);
}

int gguf_amx_gemm_silu(const void *x, int M, int K, int kind, const void *qs, const float *d, const float *mn,
                       void *out, int I) {
    return amx_blocks((const uint16_t *)x, M, K, kind, qs, d, mn, (uint16_t *)out, 2 * I, 1);
}
#endif

/* the 32 weights of block b of row n as float32 lanes, in k order; GGUF kinds rounded to bf16 (they
 * come here only for bf16 activations) */
static inline void block_f32(int kind, const void *qs, const float *d, const float *mn, int64_t n, int nb, int b,
                             __m256 w[4]) {
    const int64_t i = n * nb + b;
    if (kind == 2 || kind == 3) {
        const char *p = (const char *)qs + i * QK * (kind == 2 ? 4 : 2);
        for (int j = 0; j < 4; j++) w[j] = load8(p + j * 8 * (kind == 2 ? 4 : 2), kind == 3);
        return;
    }
    __m256i q[4];
    __m256 dv = _mm256_set1_ps(d[i]), mv = _mm256_setzero_ps();
    if (kind == 0) {
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + i * 16));
        __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        q[0] = _mm256_cvtepu8_epi32(lo), q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        q[2] = _mm256_cvtepu8_epi32(hi), q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
        mv = _mm256_set1_ps(mn[i]);
    } else {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const int8_t *)qs + i * QK));
        __m128i q0 = _mm256_castsi256_si128(raw), q1 = _mm256_extracti128_si256(raw, 1);
        q[0] = _mm256_cvtepi8_epi32(q0), q[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8));
        q[2] = _mm256_cvtepi8_epi32(q1), q[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8));
    }
    /* d * q is exact in float32, so this is one rounding, like the dequantized checkpoint's d * q + mn */
    for (int j = 0; j < 4; j++) w[j] = round8(_mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(q[j]), mv), 1);
}

/* float32 lanes: xf are the activations as float32, y stored in the activations' dtype */
static void rows_f32lanes(const float *xf, int M, int K, int kind, const void *qs, const float *d, const float *mn,
                          void *y, int N, int out_bf16, int n0, int n1) {
    int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        __m256 w[4];
        for (int b = 0; b < nb; b++) {
            block_f32(kind, qs, d, mn, n, nb, b, w);
            for (int m = 0; m < M; m++)
                acc[m] = _mm256_add_ps(acc[m], dot_block(w[0], w[1], w[2], w[3], xf + (int64_t)m * K + b * QK));
        }
        for (int m = 0; m < M; m++) store1(y, (int64_t)m * N + n, hsum8(acc[m]), out_bf16);
    }
}

/* ---- entry points: any number of rows, in groups of MAX_ROWS ------------------------------------ *
 * Every row's result depends only on that row (its sums run in the same order whatever M is and
 * whichever group it lands in), which is what --deterministic relies on. One parallel region per
 * call: each thread takes a fixed slice of the output features and runs every row group over it
 * (its slice of the weights stays in its cache; no barrier between groups, which matters when
 * another process holds one of the cores).
 * scratch: M * K floats for bf16 input (on CPUs with AVX-512 BF16: the rows in block-pair order, in half of
 * it), plus M * K/32 for Q4_1; float32 Q4_1 input on AVX2 builds keeps its pair_x permutation in the M * K
 * floats, after M * K/32 rounded up to 16 floats. */
static void qgemm_any(int kind, const void *x_in, int M, int K, const void *qs, const float *d, const float *mn,
                      void *y, int N, float *scratch, int dtype) {
    const int es = dtype == 1 ? 2 : 4;
    int path = 0;  /* 0: float32 exact blocks, 1: float32 lanes, 2: native bf16 */
    const float *xf = (const float *)x_in;
#ifdef __AVX512BF16__
    if (dtype == 1) path = 2;
#endif
    if (path == 0 && (dtype == 1 || kind >= 2)) {
        path = 1;
        if (dtype == 1) {
            widen(x_in, M, K, scratch);
            xf = scratch;
        }
    }
    const float *xq = xf;  /* the Q4_1 float32 kernels' view of x */
    const int stream = M <= MAX_ROWS;  /* one pass over the weights: see prefetch_rows_f32 */
    if (path == 0 && kind == 0) {
        block_sums(xf, M, K, scratch);
        /* on a 64-byte boundary (given an aligned scratch): 32-byte loads that straddle cache lines
         * made 3 and 5-7 rows 10-30% slower (AVX2) */
        float *xp = scratch + (((int64_t)M * (K / QK) + 15) & ~(int64_t)15);
#ifdef __AVX512F__
        for (int m = 0; m < M; m++) quad_x(xf + (int64_t)m * K, K, xp + (int64_t)m * K);
#else
        for (int m = 0; m < M; m++) pair_x(xf + (int64_t)m * K, K, xp + (int64_t)m * K);
#endif
        xq = xp;
    }
#ifdef __AVX512BF16__
    /* path 2: the rows in block-pair order (block_pair_pbh), as bf16, or widened for dp_fma (2 rows and more, on a
     * core whose VDPBF16PS is the two FMAs: the same bits, faster) */
    const int fma2 = path == 2 && M >= 2 && dp_is_two_fmas();
    const void *xb = x_in;
    if (path == 2) {
        pair_x_rows((const uint16_t *)x_in, M, K, scratch, fma2);
        xb = scratch;
    }
#endif
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* bf16: DAZ and FTZ, VDPBF16PS's own rules, for dp_fma's FMAs and for every row's lane sums (reduce16), so
         * that a row's bits do not depend on which of the two ran its products, down to denormal sums */
        const unsigned csr = _mm_getcsr();
        if (path == 2) _mm_setcsr(csr | 0x8040);
        const int n0 = (int)((int64_t)N * t / nt), n1 = (int)((int64_t)N * (t + 1) / nt);
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            char *yg = (char *)y + (int64_t)m0 * N * es;
            if (path == 2) {
#ifdef __AVX512BF16__
                rows_bf16((const char *)xb + (int64_t)m0 * K * (fma2 ? 4 : 2), rows, K, kind, qs, d, mn, (uint16_t *)yg, N,
                          n0, n1, fma2);
#endif
            } else if (path == 1) {
                rows_f32lanes(xf + (int64_t)m0 * K, rows, K, kind, qs, d, mn, yg, N, dtype == 1, n0, n1);
            } else if (kind == 0) {
                q4_1_rows_f32(xq + (int64_t)m0 * K, rows, K, (const uint8_t *)qs, d, mn, (float *)yg, N,
                              scratch + (int64_t)m0 * (K / QK), n0, n1, stream);
            } else {
                q8_0_rows_f32(xf + (int64_t)m0 * K, rows, K, (const int8_t *)qs, d, (float *)yg, N, n0, n1, stream);
            }
        }
        if (path == 2) _mm_setcsr(csr);
    }
}

void q4_1_gemm(const void *x_in, int M, int K, const uint8_t *qs, const float *d, const float *mn,
               void *y, int N, float *scratch, int dtype) {
    qgemm_any(0, x_in, M, K, qs, d, mn, y, N, scratch, dtype);
}

void q8_0_gemm(const void *x_in, int M, int K, const int8_t *qs, const float *d, void *y, int N, float *scratch,
               int dtype) {
    qgemm_any(1, x_in, M, K, qs, d, NULL, y, N, scratch, dtype);
}

/* y = x w^T for a dense weight w [N, K] of the activations' dtype (K % 32 == 0), row by row as above */
void dense_gemm(const void *x_in, int M, int K, const void *w, void *y, int N, float *scratch, int dtype) {
    qgemm_any(dtype == 1 ? 3 : 2, x_in, M, K, w, NULL, NULL, y, N, scratch, dtype);
}

/* rows one call serves with a single pass over the weights (more rows loop over groups) */
int max_rows(void) { return MAX_ROWS; }
