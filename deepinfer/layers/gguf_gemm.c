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
 * Built by deepinfer/layers/gguf_kernels.py with: gcc -O3 -mavx2 -mfma -fopenmp -shared -fPIC
 */
#include <immintrin.h>
#include <stdint.h>

#define QK 32
#define MAX_ROWS 8

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

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
            out[m * nb + b] = hsum256(s);
        }
}

void q4_1_gemm(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *mn,
               float *y, int N, float *scratch /* [M * K/32] */) {
    int nb = K / QK;
    block_sums(x, M, K, scratch);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        __m256 acc[MAX_ROWS];
        float off[MAX_ROWS];
        for (int m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); off[m] = 0.f; }
        const uint8_t *row = qs + (int64_t)n * nb * 16;
        const float *dn = d + (int64_t)n * nb, *mnn = mn + (int64_t)n * nb;
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
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum256(acc[m]) + off[m];
    }
}

void q8_0_gemm(const float *x, int M, int K, const int8_t *qs, const float *d, float *y, int N) {
    int nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        const int8_t *row = qs + (int64_t)n * K;
        const float *dn = d + (int64_t)n * nb;
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
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum256(acc[m]);
    }
}

int max_rows(void) { return MAX_ROWS; }
