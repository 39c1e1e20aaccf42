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
 * those values rounded to bfloat16. Rows are served MAX_ROWS at a time per pass over the weights.
 * Built together with paged_attention.c by deepinfer/layers/cpu_kernels.py.
 */
#include <omp.h>

#include "cpu_common.h"

#define QK 32
#define MAX_ROWS 8

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

/* ---- float32 activations: the file's exact weight values ---------------------------------------- */

/* rows [0, M) of one group (M <= MAX_ROWS); sums: the group's per-block sums of x */
static void q4_1_rows_f32(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *mn,
                          float *y, int N, const float *sums, int n0, int n1) {
    int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        float off[MAX_ROWS];
        for (int m = 0; m < M; m++) off[m] = 0.f;
        const uint8_t *row = qs + (int64_t)n * nb * 16;
        const float *dn = d + (int64_t)n * nb, *mnn = mn + (int64_t)n * nb;
#ifdef __AVX512F__
        /* 16-wide, two blocks per iteration into separate accumulators (two dependency chains) */
        __m512 acc16[MAX_ROWS], acc16b[MAX_ROWS];
        for (int m = 0; m < M; m++) acc16[m] = acc16b[m] = _mm512_setzero_ps();
        const __m128i nib = _mm_set1_epi8(0x0F);
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            __m128i b0 = _mm_loadu_si128((const __m128i *)(row + b * 16));
            __m128i b1 = _mm_loadu_si128((const __m128i *)(row + b * 16 + 16));
            __m512 wl0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, nib)));
            __m512 wh0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b0, 4), nib)));
            __m512 wl1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, nib)));
            __m512 wh1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b1, 4), nib)));
            __m512 sc0 = _mm512_set1_ps(dn[b]), sc1 = _mm512_set1_ps(dn[b + 1]);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (int64_t)m * K + b * QK;
                __m512 s0 = _mm512_fmadd_ps(wh0, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(wl0, _mm512_loadu_ps(xb)));
                __m512 s1 = _mm512_fmadd_ps(wh1, _mm512_loadu_ps(xb + 48), _mm512_mul_ps(wl1, _mm512_loadu_ps(xb + 32)));
                acc16[m] = _mm512_fmadd_ps(sc0, s0, acc16[m]);
                acc16b[m] = _mm512_fmadd_ps(sc1, s1, acc16b[m]);
                off[m] += mnn[b] * sums[m * nb + b] + mnn[b + 1] * sums[m * nb + b + 1];
            }
        }
        for (; b < nb; b++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
            __m512 wl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, nib)));
            __m512 wh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib)));
            __m512 scale = _mm512_set1_ps(dn[b]);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (int64_t)m * K + b * QK;
                __m512 s = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(wl, _mm512_loadu_ps(xb)));
                acc16[m] = _mm512_fmadd_ps(scale, s, acc16[m]);
                off[m] += mnn[b] * sums[m * nb + b];
            }
        }
        for (int m = 0; m < M; m++)
            y[(int64_t)m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc16[m], acc16b[m])) + off[m];
#else
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
            __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            __m256 scale = _mm256_set1_ps(dn[b]);
            for (int m = 0; m < M; m++) {
                __m256 s = dot_block(w0, w1, w2, w3, x + (int64_t)m * K + b * QK);
                acc[m] = _mm256_fmadd_ps(scale, s, acc[m]);
                off[m] += mnn[b] * sums[m * nb + b];
            }
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum8(acc[m]) + off[m];
#endif
    }
}

static void q8_0_rows_f32(const float *x, int M, int K, const int8_t *qs, const float *d, float *y, int N, int n0,
                          int n1) {
    int nb = K / QK;
    for (int n = n0; n < n1; n++) {
        const int8_t *row = qs + (int64_t)n * K;
        const float *dn = d + (int64_t)n * nb;
#ifdef __AVX512F__
        __m512 acc16[MAX_ROWS];
        for (int m = 0; m < M; m++) acc16[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + b * QK))));
            __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + b * QK + 16))));
            __m512 scale = _mm512_set1_ps(dn[b]);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (int64_t)m * K + b * QK;
                __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
                acc16[m] = _mm512_fmadd_ps(scale, s, acc16[m]);
            }
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = _mm512_reduce_add_ps(acc16[m]);
#else
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(row + b * QK));
            __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)));
            __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1));
            __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)));
            __m256 scale = _mm256_set1_ps(dn[b]);
            for (int m = 0; m < M; m++)
                acc[m] = _mm256_fmadd_ps(scale, dot_block(w0, w1, w2, w3, x + (int64_t)m * K + b * QK), acc[m]);
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum8(acc[m]);
#endif
    }
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
 * vdpbf16ps, reading the bf16 activations as they are. */
static inline __m512bh q4_1_block_pbh(const uint8_t *bytes, float d, float mn) {
#ifdef __AVX512BW__
    /* a block has only 16 distinct weights, bf16(d * j + mn) for j = 0..15: build them once (the same
     * fmadd and rounding as dequantizing each weight, so the same values) and look every weight up
     * by its nibble, instead of widening, converting and scaling 32 lanes */
    const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                       14.f, 15.f);
    const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(mn));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);  /* words 16..31 repeat 0..15 */
    /* word k < 16: byte k (vpermw reads 5 bits: the low nibble, plus 16 for an odd high nibble, which
     * the repeated table absorbs); word k >= 16: byte k - 16 >> 4, its high nibble */
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i idx = _mm512_srlv_epi16(
        _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes))), shifts);
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
#else
    const __m128i raw = _mm_loadu_si128((const __m128i *)bytes), nib = _mm_set1_epi8(0x0F);
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(mn);
    const __m512 lo = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, nib))), mv);
    const __m512 hi = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                              _mm_and_si128(_mm_srli_epi16(raw, 4), nib))), mv);
    return _mm512_cvtne2ps_pbh(hi, lo);  /* k 0..15 from lo, 16..31 from hi */
#endif
}

static inline __m512bh q8_0_block_pbh(const int8_t *bytes, float d) {
    const __m512 dv = _mm512_set1_ps(d);
    const __m512 lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes))));
    const __m512 hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128((const __m128i *)(bytes + 16)))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __attribute__((always_inline)) __m512bh block_pbh(int kind, const void *qs, const float *d,
                                                                 const float *mn, int64_t n, int nb, int b) {
    const int64_t i = n * nb + b;
    if (kind == 0) return q4_1_block_pbh((const uint8_t *)qs + i * 16, d[i], mn[i]);
    if (kind == 1) return q8_0_block_pbh((const int8_t *)qs + i * QK, d[i]);
    return (__m512bh)_mm512_loadu_si512((const uint16_t *)qs + i * QK);  /* kind 3 */
}

/* one activation row (the single stream), NR output features at a time: NR independent pairs of
 * accumulator chains keep the core busy where one feature's chain waits on vdpbf16ps latency, and each
 * x block is loaded once for all NR (a Q4_1 GEMV at one row, weights in cache: 2.4x faster than one
 * feature at a time, with the table lookup above). Every feature's sum runs in the same order as in rows_bf16 below (even blocks into acc,
 * odd into accb, then one reduce of acc + accb), so the result is the same bits. */
#define NR 4
static inline __attribute__((always_inline)) int row1_bf16(const uint16_t *x, int K, int kind, const void *qs,
                                                            const float *d, const float *mn, uint16_t *y, int n0,
                                                            int n1) {
    const int nb = K / QK;
    int n = n0;
    for (; n + NR <= n1; n += NR) {
        __m512 acc[NR], accb[NR];
        for (int r = 0; r < NR; r++) acc[r] = accb[r] = _mm512_setzero_ps();
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + b * QK);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + (b + 1) * QK);
            for (int r = 0; r < NR; r++) {
                acc[r] = _mm512_dpbf16_ps(acc[r], block_pbh(kind, qs, d, mn, n + r, nb, b), x0);
                accb[r] = _mm512_dpbf16_ps(accb[r], block_pbh(kind, qs, d, mn, n + r, nb, b + 1), x1);
            }
        }
        if (b < nb) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + b * QK);
            for (int r = 0; r < NR; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], block_pbh(kind, qs, d, mn, n + r, nb, b), x0);
        }
        for (int r = 0; r < NR; r++) store1(y, n + r, _mm512_reduce_add_ps(_mm512_add_ps(acc[r], accb[r])), 1);
    }
    return n;
}

/* M rows (2..MAX_ROWS, a compile-time constant at each call site, so the accumulators stay in registers
 * instead of a stack array indexed by m) times NF output features: each block is dequantized once for
 * all M rows and each x block loaded once for all NF features. Same order per (row, feature) as above:
 * even blocks into acc, odd into accb, then one reduce of acc + accb, so the bits do not depend on M or
 * NF. Returns the first feature it left (n1 - n < NF). */
static inline __attribute__((always_inline)) int rowsm_bf16(const uint16_t *x, const int M, const int NF, int K,
                                                             const int kind, const void *qs, const float *d,
                                                             const float *mn, uint16_t *y, int N, int n0, int n1) {
    const int nb = K / QK;
    int n = n0;
    for (; n + NF <= n1; n += NF) {
        __m512 acc[4][MAX_ROWS], accb[4][MAX_ROWS];  /* NF <= 4 */
#pragma GCC unroll 8
        for (int r = 0; r < NF; r++)
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) acc[r][m] = accb[r][m] = _mm512_setzero_ps();
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            __m512bh w0[4], w1[4];
#pragma GCC unroll 8
            for (int r = 0; r < NF; r++) {
                w0[r] = block_pbh(kind, qs, d, mn, n + r, nb, b);
                w1[r] = block_pbh(kind, qs, d, mn, n + r, nb, b + 1);
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + b * QK);
                const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + (b + 1) * QK);
#pragma GCC unroll 8
                for (int r = 0; r < NF; r++) {
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w0[r], x0);
                    accb[r][m] = _mm512_dpbf16_ps(accb[r][m], w1[r], x1);
                }
            }
        }
        if (b < nb) {
#pragma GCC unroll 8
            for (int r = 0; r < NF; r++) {
                const __m512bh w0 = block_pbh(kind, qs, d, mn, n + r, nb, b);
#pragma GCC unroll 8
                for (int m = 0; m < M; m++)
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w0, (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + b * QK));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < NF; r++)
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                store1(y, (int64_t)m * N + n + r, _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m], accb[r][m])), 1);
    }
    return n;
}

/* one group of M rows over features [n0, n1): NF features at a time, then the rest one by one */
static inline __attribute__((always_inline)) void rowsm_kind(const uint16_t *x, const int M, int K, const int kind,
                                                              const void *qs, const float *d, const float *mn,
                                                              uint16_t *y, int N, int n0, int n1) {
    const int NF = M <= 2 ? 4 : M <= 4 ? 2 : 1;
    n0 = rowsm_bf16(x, M, NF, K, kind, qs, d, mn, y, N, n0, n1);
    if (NF > 1) rowsm_bf16(x, M, 1, K, kind, qs, d, mn, y, N, n0, n1);
}

static inline __attribute__((always_inline)) void rowsm_any(const uint16_t *x, const int M, int K, int kind,
                                                             const void *qs, const float *d, const float *mn,
                                                             uint16_t *y, int N, int n0, int n1) {
    if (kind == 0) rowsm_kind(x, M, K, 0, qs, d, mn, y, N, n0, n1);
    else if (kind == 1) rowsm_kind(x, M, K, 1, qs, d, mn, y, N, n0, n1);
    else rowsm_kind(x, M, K, 3, qs, d, mn, y, N, n0, n1);
}

static void rows_bf16(const uint16_t *x, int M, int K, int kind, const void *qs, const float *d, const float *mn,
                      uint16_t *y, int N, int n0, int n1) {
    int nb = K / QK;
    switch (M) {
    case 2: rowsm_any(x, 2, K, kind, qs, d, mn, y, N, n0, n1); return;
    case 3: rowsm_any(x, 3, K, kind, qs, d, mn, y, N, n0, n1); return;
    case 4: rowsm_any(x, 4, K, kind, qs, d, mn, y, N, n0, n1); return;
    case 5: rowsm_any(x, 5, K, kind, qs, d, mn, y, N, n0, n1); return;
    case 6: rowsm_any(x, 6, K, kind, qs, d, mn, y, N, n0, n1); return;
    case 7: rowsm_any(x, 7, K, kind, qs, d, mn, y, N, n0, n1); return;
    case 8: rowsm_any(x, 8, K, kind, qs, d, mn, y, N, n0, n1); return;
    default: break;
    }
    /* M == 1: one copy of the loop per weight kind, the kind's branch out of the inner loop; not for Q8_0
     * (the LM head: one large matrix, which streams faster one feature at a time) */
    if (kind != 1) {
        if (kind == 0) n0 = row1_bf16(x, K, 0, qs, d, mn, y, n0, n1);
        else n0 = row1_bf16(x, K, 3, qs, d, mn, y, n0, n1);
    }
    for (int n = n0; n < n1; n++) {
        __m512 acc[MAX_ROWS], accb[MAX_ROWS];  /* even and odd blocks: two dependency chains */
        for (int m = 0; m < M; m++) acc[m] = accb[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const __m512bh wb = block_pbh(kind, qs, d, mn, n, nb, b);
            for (int m = 0; m < M; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + b * QK);
                if (b & 1) accb[m] = _mm512_dpbf16_ps(accb[m], wb, xv);
                else acc[m] = _mm512_dpbf16_ps(acc[m], wb, xv);
            }
        }
        for (int m = 0; m < M; m++)
            store1(y, (int64_t)m * N + n, _mm512_reduce_add_ps(_mm512_add_ps(acc[m], accb[m])), 1);
    }
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
 * scratch: M * K floats for bf16 input (unused on CPUs with AVX-512 BF16), plus M * K/32 for Q4_1. */
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
    if (path == 0 && kind == 0) block_sums(xf, M, K, scratch);
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int n0 = (int)((int64_t)N * t / nt), n1 = (int)((int64_t)N * (t + 1) / nt);
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int rows = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            char *yg = (char *)y + (int64_t)m0 * N * es;
            if (path == 2) {
#ifdef __AVX512BF16__
                rows_bf16((const uint16_t *)x_in + (int64_t)m0 * K, rows, K, kind, qs, d, mn, (uint16_t *)yg, N, n0, n1);
#endif
            } else if (path == 1) {
                rows_f32lanes(xf + (int64_t)m0 * K, rows, K, kind, qs, d, mn, yg, N, dtype == 1, n0, n1);
            } else if (kind == 0) {
                q4_1_rows_f32(xf + (int64_t)m0 * K, rows, K, (const uint8_t *)qs, d, mn, (float *)yg, N,
                              scratch + (int64_t)m0 * (K / QK), n0, n1);
            } else {
                q8_0_rows_f32(xf + (int64_t)m0 * K, rows, K, (const int8_t *)qs, d, (float *)yg, N, n0, n1);
            }
        }
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
