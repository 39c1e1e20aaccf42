/*
 * Decode attention straight from the paged KV cache (one new token per sequence).
 *
 * The pure-torch path gathers every sequence's blocks into a padded tensor before SDPA,
 * which copies the whole context of the batch each step. Here each (sequence, kv head)
 * pair walks its block table and reads K/V where they lie, with an online softmax over
 * one block (block_size tokens) at a time, so nothing is copied. Grouped query heads
 * that share a kv head are computed together so each K/V row is loaded once.
 *
 *   q, out: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]
 *   block_tables: [B, max_blocks] int64; context_lens: [B] int64 (tokens to attend, new one included)
 *   dtype: 0 = float32, 1 = bfloat16 (q, out and the caches share it); math is float32.
 *   skip: context tokens to leave out at the start (a multiple of block_size; a shared prefix the
 *   caller attends separately); lse, if not NULL: [B, H] log-sum-exp of the scaled scores, so the
 *   caller can merge this partial result with its own.
 * Built together with gguf_gemm.c by deepinfer/layers/cpu_kernels.py.
 */
#include <math.h>

#include "cpu_common.h"

#define MAX_D 256
#define MAX_GROUP 64
#define MAX_BS 64

/* the four horizontal sums of a0..a3, in one vector */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* s[t] = e^(s[t] - mx) for t < n, adding them to *sum */
static inline void exp_shifted(float *s, int n, float mx, float *sum) {
    const __m256 m8 = _mm256_set1_ps(mx);
    int t = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float total = hsum8(acc);
    for (; t < n; t++) {
        s[t] = expf(s[t] - mx);
        total += s[t];
    }
    *sum += total;
}

int paged_decode_attention(const void *q, void *out, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                           int B, int H, int KVH, int D, int block_size, float scale, int dtype,
                           int64_t skip, float *lse) {
    if (D > MAX_D || D % 8 || H % KVH || H / KVH > MAX_GROUP || block_size > MAX_BS) return -1;
    const int G = H / KVH, bf16 = dtype == 1, esize = bf16 ? 2 : 4;
    const int64_t row_stride = (int64_t)KVH * D;  /* elements between consecutive tokens of one head */
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < KVH; h++) {
            float qf[MAX_GROUP][MAX_D], acc[MAX_GROUP][MAX_D], m[MAX_GROUP], l[MAX_GROUP];
            float s[MAX_GROUP][MAX_BS], corr[MAX_GROUP];
            for (int g = 0; g < G; g++) {
                const int64_t base = ((int64_t)b * H + h * G + g) * D;
                for (int d = 0; d < D; d++) qf[g][d] = load1(q, base + d, bf16) * scale;
                for (int d = 0; d < D; d++) acc[g][d] = 0.f;
                m[g] = -INFINITY;
                l[g] = 0.f;
            }
            const int64_t ctx = context_lens[b];
            const int64_t *table = block_tables + (int64_t)b * max_blocks;
            for (int64_t start = skip; start < ctx; start += block_size) {
                const int n = (int)(ctx - start < block_size ? ctx - start : block_size);
                const int64_t first = (table[start / block_size] * block_size * row_stride + (int64_t)h * D);
                const char *kb = (const char *)k_cache + first * esize;
                const char *vb = (const char *)v_cache + first * esize;
                const int64_t tstride = row_stride * esize;  /* bytes between tokens */
                /* scores of this block: four tokens at a time, so four dot products are in flight */
                for (int g = 0; g < G; g++) {
                    int t = 0;
                    for (; t + 4 <= n; t += 4) {
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                        const char *k0 = kb + t * tstride;
                        for (int d = 0; d < D; d += 8) {
                            const __m256 qv = _mm256_loadu_ps(&qf[g][d]);
                            a0 = _mm256_fmadd_ps(qv, load8(k0 + d * esize, bf16), a0);
                            a1 = _mm256_fmadd_ps(qv, load8(k0 + tstride + d * esize, bf16), a1);
                            a2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * tstride + d * esize, bf16), a2);
                            a3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * tstride + d * esize, bf16), a3);
                        }
                        _mm_storeu_ps(&s[g][t], hsum4x8(a0, a1, a2, a3));
                    }
                    for (; t < n; t++) {
                        __m256 a = _mm256_setzero_ps();
                        for (int d = 0; d < D; d += 8)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(&qf[g][d]), load8(kb + t * tstride + d * esize, bf16), a);
                        s[g][t] = hsum8(a);
                    }
                }
                /* online softmax: new running max, rescale, probabilities of this block */
                for (int g = 0; g < G; g++) {
                    float mx = m[g];
                    for (int t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
                    const float correction = expf(m[g] - mx);
                    m[g] = mx;
                    l[g] *= correction;
                    exp_shifted(s[g], n, mx, &l[g]);
                    corr[g] = correction;
                }
                /* acc = acc * correction + p . V, one 8-wide slice of the head at a time: each V slice
                 * is loaded (and widened) once for all grouped query heads; up to 4 groups stay in registers */
                for (int d = 0; d < D; d += 8) {
                    for (int g0 = 0; g0 < G; g0 += 4) {
                        const int gn = G - g0 < 4 ? G - g0 : 4;
                        __m256 a[4];
                        for (int j = 0; j < gn; j++)
                            a[j] = _mm256_mul_ps(_mm256_set1_ps(corr[g0 + j]), _mm256_loadu_ps(&acc[g0 + j][d]));
                        for (int t = 0; t < n; t++) {
                            const __m256 v = load8(vb + t * tstride + d * esize, bf16);
                            for (int j = 0; j < gn; j++)
                                a[j] = _mm256_fmadd_ps(_mm256_set1_ps(s[g0 + j][t]), v, a[j]);
                        }
                        for (int j = 0; j < gn; j++) _mm256_storeu_ps(&acc[g0 + j][d], a[j]);
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                const int64_t base = ((int64_t)b * H + h * G + g) * D;
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
                if (lse) lse[(int64_t)b * H + h * G + g] = l[g] > 0.f ? m[g] + logf(l[g]) : -INFINITY;
                for (int d = 0; d < D; d++) store1(out, base + d, acc[g][d] * inv, bf16);
            }
        }
    }
    return 0;
}
