/*
 * Fused element-wise layers for CPU: residual add + RMSNorm, rotary embedding on q and k
 * in place, SiLU(gate) * up. Each replaces 4-8 small torch ops per layer, whose dispatch
 * overhead dominates a decode step of a small model.
 *
 * Tensors are float32 or bfloat16 (dtype 0 / 1); math is float32 and every value the
 * reference stores in the model dtype (the residual sum, the normalised row, x*cos) is
 * rounded to it at the same point. Intrinsics spell out each multiply and add, so float32
 * results follow the reference's operation order (no fused multiply-adds it does not do).
 */
#include <math.h>

#include "cpu_common.h"

/* residual == NULL: out = rmsnorm(x) * w.
 * Otherwise: residual = x + residual (stored), out = rmsnorm(residual) * w.
 * x, out, residual: [M, N] contiguous; w: [N]; N % 8 == 0. */
void rms_norm(const void *x, void *residual, const void *w, void *out, int M, int N, float eps, int dtype) {
    const int bf16 = dtype == 1, es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if ((int64_t)M * N >= 65536)
    for (int m = 0; m < M; m++) {
        const int64_t row = (int64_t)m * N * es;
        const char *xr = (const char *)x + row;
        char *rr = residual ? (char *)residual + row : NULL;
        char *orow = (char *)out + row;
        __m256 ss = _mm256_setzero_ps();
        for (int n = 0; n < N; n += 8) {
            __m256 v = load8(xr + n * es, bf16);
            if (rr) {
                v = round8(_mm256_add_ps(v, load8(rr + n * es, bf16)), bf16);
                store8(rr + n * es, v, bf16);
            }
            ss = _mm256_add_ps(ss, _mm256_mul_ps(v, v));
        }
        const char *src = rr ? rr : xr;
        const __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum8(ss) / (float)N + eps));
        for (int n = 0; n < N; n += 8) {
            const __m256 normed = round8(_mm256_mul_ps(load8(src + n * es, bf16), inv), bf16);
            store8(orow + n * es, _mm256_mul_ps(load8((const char *)w + n * es, bf16), normed), bf16);
        }
    }
}

/* x[t, h, :] rotated in place by position-specific cos/sin rows (half-rotation layout):
 *   x'[i] = x[i] cos[i] - x[i + D/2] sin[i];  x'[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
 * x: [T, heads, D] with `stride` elements between tokens; cos, sin: [T, D]; D % 16 == 0. */
static void rotate(void *x, int64_t stride, int heads, int T, int D, const void *cos, const void *sin, int bf16) {
    const int half = D / 2, es = bf16 ? 2 : 4;
    const __m256 sign = _mm256_set1_ps(-0.f);
#pragma omp parallel for schedule(static) if ((int64_t)T * heads * D >= 65536)
    for (int t = 0; t < T; t++) {
        const char *c = (const char *)cos + (int64_t)t * D * es, *s = (const char *)sin + (int64_t)t * D * es;
        for (int h = 0; h < heads; h++) {
            char *row = (char *)x + ((int64_t)t * stride + (int64_t)h * D) * es;
            for (int i = 0; i < half; i += 8) {
                const __m256 a = load8(row + i * es, bf16), b = load8(row + (i + half) * es, bf16);
                /* the reference forms x*cos and rotate_half(x)*sin in the model dtype, then adds */
                const __m256 lo = _mm256_add_ps(round8(_mm256_mul_ps(a, load8(c + i * es, bf16)), bf16),
                                                round8(_mm256_mul_ps(_mm256_xor_ps(b, sign), load8(s + i * es, bf16)), bf16));
                const __m256 hi = _mm256_add_ps(round8(_mm256_mul_ps(b, load8(c + (i + half) * es, bf16)), bf16),
                                                round8(_mm256_mul_ps(a, load8(s + (i + half) * es, bf16)), bf16));
                store8(row + i * es, lo, bf16);
                store8(row + (i + half) * es, hi, bf16);
            }
        }
    }
}

void rotary_qk(void *q, int64_t q_stride, int q_heads, void *k, int64_t k_stride, int k_heads, int T, int D,
               const void *cos, const void *sin, int dtype) {
    rotate(q, q_stride, q_heads, T, D, cos, sin, dtype == 1);
    rotate(k, k_stride, k_heads, T, D, cos, sin, dtype == 1);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]; gu: [M, 2I], out: [M, I]; I % 8 == 0 */
void silu_mul(const void *gu, void *out, int M, int I, int dtype) {
    const int bf16 = dtype == 1, es = bf16 ? 2 : 4;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
#pragma omp parallel for schedule(static) if ((int64_t)M * I >= 65536)
    for (int m = 0; m < M; m++) {
        const char *g_row = (const char *)gu + (int64_t)m * 2 * I * es, *u_row = g_row + (int64_t)I * es;
        char *o_row = (char *)out + (int64_t)m * I * es;
        for (int i = 0; i < I; i += 8) {
            const __m256 g = load8(g_row + i * es, bf16);
            const __m256 act = round8(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)))), bf16);
            store8(o_row + i * es, _mm256_mul_ps(act, load8(u_row + i * es, bf16)), bf16);
        }
    }
}


/* index of the largest value of a row (the first one on ties) */
static inline int row_argmax(const float *row, int N) {
    int best = 0;
    float bv = row[0];
    for (int n = 1; n < N; n++)
        if (row[n] > bv) { bv = row[n]; best = n; }
    return best;
}

/* index of the largest value of each row of a float32 [M, N] matrix (first one on ties) */
void argmax_rows(const float *x, int M, int N, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int m = 0; m < M; m++) out[m] = row_argmax(x + (int64_t)m * N, N);
}

/* Row weights for sample_rows, 8 at a time: exp((x - max) * inv_temp) from logits, or x itself
   from unnormalised probabilities. A weight whose exponent is under -87 (e^-87 ~ 1.6e-38), or a
   -inf, NaN or non-positive probability, is exactly 0, so a banned token can never be drawn. */
static inline __m256 sample_weights8(__m256 x, __m256 max, __m256 inv_temp, int from_logits) {
    if (!from_logits) return _mm256_and_ps(x, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256 a = _mm256_mul_ps(_mm256_sub_ps(x, max), inv_temp);
    return _mm256_and_ps(exp8(a), _mm256_cmp_ps(a, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}

/* row[n .. n+8), padded with -inf (weight 0) past N */
static inline __m256 load_row8(const float *row, int n, int N) {
    if (n + 8 <= N) return _mm256_loadu_ps(row + n);
    float tail[8];
    for (int k = 0; k < 8; k++) tail[k] = n + k < N ? row[n + k] : -INFINITY;
    return _mm256_loadu_ps(tail);
}

/* Inverse-CDF draws from categorical rows: for each listed row, the first token where the running
   sum of the weights (see sample_weights8) passes u[r] * their total. Both passes add the same
   8-wide chunk sums in the same order, so the running sum reaches the total exactly and the
   target (u < 1) is always passed. x: [*, ld] float32; N need not be a multiple of 8. A row whose weights are all 0 gets its largest value's index. */
void sample_rows(const float *x, int ld, const int64_t *rows, int nrows, int N, const float *inv_temp,
                 const double *u, int from_logits, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < nrows; r++) {
        const float *row = x + rows[r] * (int64_t)ld;
        const int best = row_argmax(row, N);
        const __m256 vmax = _mm256_set1_ps(row[best]), vtemp = _mm256_set1_ps(inv_temp ? inv_temp[r] : 1.f);
        double total = 0.0;
        for (int n = 0; n < N; n += 8)
            total += hsum8(sample_weights8(load_row8(row, n, N), vmax, vtemp, from_logits));
        out[r] = best;
        if (!(total > 0.0)) continue;
        const double target = u[r] * total;
        double running = 0.0;
        for (int n = 0; n < N; n += 8) {
            const __m256 w = sample_weights8(load_row8(row, n, N), vmax, vtemp, from_logits);
            const float chunk = hsum8(w);
            if (running + chunk > target) {
                float ws[8];
                _mm256_storeu_ps(ws, w);
                double within = running;
                int pick = -1;
                for (int k = 0; k < 8 && n + k < N; k++) {
                    if (ws[k] <= 0.f) continue;
                    pick = n + k;  /* the chunk's last positive weight when rounding never passes target */
                    within += ws[k];
                    if (within > target) break;
                }
                if (pick >= 0) out[r] = pick;
                break;
            }
            running += chunk;
        }
    }
}

/* Grammar token masks: for each listed row, logits[row][t] = -inf where bit t of the row's bitmask
   (32 tokens per int32 word, low bit first, as xgrammar packs it) is 0. A fully-allowed word is
   skipped, a fully-forbidden one filled; tokens past `vocab` are left alone. */
void apply_token_bitmask(float *logits, int ld, const int32_t *bitmask, int words, const int64_t *rows,
                         int nrows, int vocab) {
    const float ninf = -INFINITY;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < nrows; r++) {
        float *row = logits + rows[r] * (int64_t)ld;
        const int32_t *bits = bitmask + rows[r] * (int64_t)words;
        for (int w = 0; w < words; w++) {
            uint32_t word = (uint32_t)bits[w];
            if (word == 0xFFFFFFFFu) continue;
            int base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            if (word == 0) {
                for (int t = base; t < end; t++) row[t] = ninf;
            } else {
                for (int t = base; t < end; t++)
                    if (!((word >> (t - base)) & 1u)) row[t] = ninf;
            }
        }
    }
}
