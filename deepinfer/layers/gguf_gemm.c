/*
 * Matrix products straight from GGUF block-quantized weights, for a few activation rows.
 *
 * Decoding a handful of sequences on a CPU is limited by reading the weights from memory;
 * reading the GGUF blocks (Q4_1: 20 bytes per 32 weights, Q8_0: 34) instead of float32
 * (128 bytes) is what makes it fast. Each block is dequantized in registers and multiplied
 * in float32, so the weights are exactly the file's values.
 *
 *   y[m, n] = sum_k x[m, k] * w[n, k]        x: [M, K] float32, y: [M, N] float32
 *
 * Layouts (rows of w are output features, blocks of 32 run along k):
 *   Q4_1: qs [N, K/32, 16] uint8 (byte j: low nibble = q[j], high nibble = q[j+16]),
 *         d, mn [N, K/32] float32; w = d * q + mn
 *   Q8_0: qs [N, K] int8, d [N, K/32] float32; w = d * q
 * x and y are float32 or bfloat16 (dtype 0 / 1); bf16 rows are widened into `scratch` first.
 * Built together with paged_attention.c by deepinfer/layers/cpu_kernels.py.
 */
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

/* bf16 -> float32 rows (x is [M, K]); returns the float32 view to multiply with */
static const float *widen(const void *x, int M, int K, int dtype, float *scratch) {
    if (dtype == 0) return (const float *)x;
    for (int64_t i = 0; i < (int64_t)M * K; i++) scratch[i] = load1(x, i, 1);
    return scratch;
}

/* scratch: [M * K/32] floats, plus M * K in front of them for bf16 input */
void q4_1_gemm(const void *x_in, int M, int K, const uint8_t *qs, const float *d, const float *mn,
               void *y, int N, float *scratch, int dtype) {
    int nb = K / QK;
    const float *x = widen(x_in, M, K, dtype, scratch);
    if (dtype != 0) scratch += (int64_t)M * K;
    block_sums(x, M, K, scratch);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
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
                off[m] += mnn[b] * scratch[m * nb + b] + mnn[b + 1] * scratch[m * nb + b + 1];
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
                off[m] += mnn[b] * scratch[m * nb + b];
            }
        }
        for (int m = 0; m < M; m++)
            store1(y, (int64_t)m * N + n, _mm512_reduce_add_ps(_mm512_add_ps(acc16[m], acc16b[m])) + off[m], dtype == 1);
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
                off[m] += mnn[b] * scratch[m * nb + b];
            }
        }
        for (int m = 0; m < M; m++) store1(y, (int64_t)m * N + n, hsum8(acc[m]) + off[m], dtype == 1);
#endif
    }
}

/* scratch: [M * K] floats (used for bf16 input only) */
void q8_0_gemm(const void *x_in, int M, int K, const int8_t *qs, const float *d, void *y, int N, float *scratch,
               int dtype) {
    int nb = K / QK;
    const float *x = widen(x_in, M, K, dtype, scratch);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
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
        for (int m = 0; m < M; m++) store1(y, (int64_t)m * N + n, _mm512_reduce_add_ps(acc16[m]), dtype == 1);
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
        for (int m = 0; m < M; m++) store1(y, (int64_t)m * N + n, hsum8(acc[m]), dtype == 1);
#endif
    }
}

int max_rows(void) { return MAX_ROWS; }
