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
    /* 16k elements (~10 us on one core) is where splitting rows beats the parallel region's start-up;
     * 64 decode rows of a 576-wide model (37k) are past it. Rows are independent: any split gives the
     * same values. */
#pragma omp parallel for schedule(static) if ((int64_t)M * N >= 16384)
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

/* One head's D values rotated by a position's cos/sin rows (half-rotation layout), src -> dst (may be
 * the same row):
 *   x'[i] = x[i] cos[i] - x[i + D/2] sin[i];  x'[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
static inline void rotate_head(const char *src, char *dst, const char *c, const char *s, int half, int bf16) {
    const int es = bf16 ? 2 : 4;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < half; i += 8) {
        const __m256 a = load8(src + i * es, bf16), b = load8(src + (i + half) * es, bf16);
        /* the reference forms x*cos and rotate_half(x)*sin in the model dtype, then adds */
        const __m256 lo = _mm256_add_ps(round8(_mm256_mul_ps(a, load8(c + i * es, bf16)), bf16),
                                        round8(_mm256_mul_ps(_mm256_xor_ps(b, sign), load8(s + i * es, bf16)), bf16));
        const __m256 hi = _mm256_add_ps(round8(_mm256_mul_ps(b, load8(c + (i + half) * es, bf16)), bf16),
                                        round8(_mm256_mul_ps(a, load8(s + (i + half) * es, bf16)), bf16));
        store8(dst + i * es, lo, bf16);
        store8(dst + (i + half) * es, hi, bf16);
    }
}

/* x[t, h, :] rotated in place by position-specific cos/sin rows;
 * x: [T, heads, D] with `stride` elements between tokens; cos, sin: [T, D]; D % 16 == 0. */
static void rotate(void *x, int64_t stride, int heads, int T, int D, const void *cos, const void *sin, int bf16) {
    const int es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if ((int64_t)T * heads * D >= 65536)
    for (int t = 0; t < T; t++) {
        const char *c = (const char *)cos + (int64_t)t * D * es, *s = (const char *)sin + (int64_t)t * D * es;
        for (int h = 0; h < heads; h++) {
            char *row = (char *)x + ((int64_t)t * stride + (int64_t)h * D) * es;
            rotate_head(row, row, c, s, D / 2, bf16);
        }
    }
}

void rotary_qk(void *q, int64_t q_stride, int q_heads, void *k, int64_t k_stride, int k_heads, int T, int D,
               const void *cos, const void *sin, int dtype) {
    rotate(q, q_stride, q_heads, T, D, cos, sin, dtype == 1);
    rotate(k, k_stride, k_heads, T, D, cos, sin, dtype == 1);
}

/* A decode step's fused QKV output [T, (Hq + 2 Hk) * D] -> the rotated queries into q_out [T, Hq * D]
 * (contiguous, as the attention kernel reads them), the rotated keys and the values into their cache
 * slots (caches: [slots, Hk, D]). The same values as rotary_qk in place followed by copying q and
 * writing k and v to the cache, in one pass over the rows. */
void rope_kv_write(const void *qkv, int T, int q_heads, int k_heads, int D, const void *cos, const void *sin,
                   const int64_t *slots, void *k_cache, void *v_cache, void *q_out, int dtype) {
    const int bf16 = dtype == 1, es = bf16 ? 2 : 4;
    const int64_t q_size = (int64_t)q_heads * D, kv_size = (int64_t)k_heads * D, row_len = q_size + 2 * kv_size;
#pragma omp parallel for schedule(static) if ((int64_t)T * row_len >= 16384)
    for (int t = 0; t < T; t++) {
        const char *row = (const char *)qkv + t * row_len * es;
        const char *c = (const char *)cos + (int64_t)t * D * es, *s = (const char *)sin + (int64_t)t * D * es;
        char *q = (char *)q_out + t * q_size * es;
        char *k = (char *)k_cache + slots[t] * kv_size * es;
        for (int h = 0; h < q_heads; h++)
            rotate_head(row + (int64_t)h * D * es, q + (int64_t)h * D * es, c, s, D / 2, bf16);
        for (int h = 0; h < k_heads; h++)
            rotate_head(row + (q_size + (int64_t)h * D) * es, k + (int64_t)h * D * es, c, s, D / 2, bf16);
        memcpy((char *)v_cache + slots[t] * kv_size * es, row + (q_size + kv_size) * es, (size_t)kv_size * es);
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]; gu: [M, 2I], out: [M, I]; I % 8 == 0 */
void silu_mul(const void *gu, void *out, int M, int I, int dtype) {
    const int bf16 = dtype == 1, es = bf16 ? 2 : 4;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
#pragma omp parallel for schedule(static) if ((int64_t)M * I >= 65536)
    for (int m = 0; m < M; m++) {
        const char *g_row = (const char *)gu + (int64_t)m * 2 * I * es, *u_row = g_row + (int64_t)I * es;
        char *o_row = (char *)out + (int64_t)m * I * es;
        int i = 0;
#if SILU_WIDE
        for (; i + 16 <= I; i += 16) {
            const __m512 g = load16(g_row + i * es, bf16);
            const __m512 act = round16(silu16(g), bf16);
            store16(o_row + i * es, _mm512_mul_ps(act, load16(u_row + i * es, bf16)), bf16);
        }
#endif
        for (; i < I; i += 8) {
            const __m256 g = load8(g_row + i * es, bf16);
            const __m256 act = round8(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign)))), bf16);
            store8(o_row + i * es, _mm256_mul_ps(act, load8(u_row + i * es, bf16)), bf16);
        }
    }
}


/* index of the largest value of a row: the first one on ties, NaNs never chosen unless row[0] is one
 * (then 0): a scalar `>` scan from row[0]. x is float32 (bf16 == 0) or bfloat16 (widened exactly, so
 * the answer is the float32 copy's). */
static inline int row_argmax_scalar(const void *row, int N, int bf16) {
    int best = 0;
    float bv = load1(row, 0, bf16);
    for (int n = 1; n < N; n++) {
        const float v = load1(row, n, bf16);
        if (v > bv) { bv = v; best = n; }
    }
    return best;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 elements from p as float32, lanes at or past `left` set to -inf */
static inline __m512 argmax_load16(const void *p, int left, int bf16) {
    const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    if (!bf16) return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, p);
    const __m256i h = _mm256_maskz_loadu_epi16(k, p);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), v);
}

/* The same answer as the scalar scan in one vector pass: each lane keeps its first strict maximum
 * (NaN compares false, so it is skipped), then the lowest index among the lanes holding the overall
 * maximum (== treats -0 and +0 alike, as the scan's `>` does). Four independent lane sets, so the
 * compare -> select chain of one does not stall the next load. */
static inline int row_argmax(const void *row, int N, int bf16) {
    const float first = load1(row, 0, bf16);
    if (first != first || N < 32) return row_argmax_scalar(row, N, bf16);
    const int es = bf16 ? 2 : 4;
    const char *p = (const char *)row;
    __m512 vmax[4];
    __m512i vidx[4], idx[4];
    for (int j = 0; j < 4; j++) {
        vmax[j] = _mm512_set1_ps(-INFINITY);
        vidx[j] = _mm512_setzero_si512();
        idx[j] = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                  _mm512_set1_epi32(16 * j));
    }
    const __m512i step = _mm512_set1_epi32(64);
    int n = 0;
    for (; n + 64 <= N; n += 64) {
        for (int j = 0; j < 4; j++) {
            const __m512 v = argmax_load16(p + (int64_t)(n + 16 * j) * es, 16, bf16);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax[j], _CMP_GT_OQ);
            vmax[j] = _mm512_mask_mov_ps(vmax[j], gt, v);
            vidx[j] = _mm512_mask_mov_epi32(vidx[j], gt, idx[j]);
            idx[j] = _mm512_add_epi32(idx[j], step);
        }
    }
    for (int j = 0; n < N; n += 16, j++) {  /* the last < 64 values: lane set j's next indices are n.. */
        const __m512 v = argmax_load16(p + (int64_t)n * es, N - n, bf16);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax[j], _CMP_GT_OQ);
        vmax[j] = _mm512_mask_mov_ps(vmax[j], gt, v);
        vidx[j] = _mm512_mask_mov_epi32(vidx[j], gt, idx[j]);
    }
    float lanes[64];
    int32_t where[64];
    for (int j = 0; j < 4; j++) {
        _mm512_storeu_ps(lanes + 16 * j, vmax[j]);
        _mm512_storeu_si512(where + 16 * j, vidx[j]);
    }
    float bv = first;
    int best = 0;
    for (int l = 0; l < 64; l++)
        if (lanes[l] > bv || (lanes[l] == bv && where[l] < best)) { bv = lanes[l]; best = where[l]; }
    return best;
}
#else
/* 8 elements from p as float32, lanes at or past `left` set to -inf */
static inline __m256 argmax_load8(const void *p, int left, int bf16) {
    if (left >= 8) return load8(p, bf16);
    float tail[8];
    for (int k = 0; k < 8; k++) tail[k] = k < left ? load1(p, k, bf16) : -INFINITY;
    return _mm256_loadu_ps(tail);
}

/* AVX2 twin of the 16-lane pass above, with 4 sets of 8 lanes: each lane keeps its first strict maximum
 * (NaN compares false), then the lowest index among the lanes holding the overall maximum; the same
 * answer as the scalar scan (6-7x fewer instructions on a 49k-token row). */
static inline int row_argmax(const void *row, int N, int bf16) {
    const float first = load1(row, 0, bf16);
    if (first != first || N < 32) return row_argmax_scalar(row, N, bf16);
    const int es = bf16 ? 2 : 4;
    const char *p = (const char *)row;
    __m256 vmax[4];
    __m256i vidx[4], idx[4];
    for (int j = 0; j < 4; j++) {
        vmax[j] = _mm256_set1_ps(-INFINITY);
        vidx[j] = _mm256_setzero_si256();
        idx[j] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * j));
    }
    const __m256i step = _mm256_set1_epi32(32);
    int n = 0;
    for (; n + 32 <= N; n += 32) {
        for (int j = 0; j < 4; j++) {
            const __m256 v = load8(p + (int64_t)(n + 8 * j) * es, bf16);
            const __m256 gt = _mm256_cmp_ps(v, vmax[j], _CMP_GT_OQ);
            vmax[j] = _mm256_blendv_ps(vmax[j], v, gt);
            vidx[j] = _mm256_blendv_epi8(vidx[j], idx[j], _mm256_castps_si256(gt));
            idx[j] = _mm256_add_epi32(idx[j], step);
        }
    }
    for (int j = 0; n < N; n += 8, j++) {  /* the last < 32 values: lane set j's next indices are n.. */
        const __m256 v = argmax_load8(p + (int64_t)n * es, N - n, bf16);
        const __m256 gt = _mm256_cmp_ps(v, vmax[j], _CMP_GT_OQ);
        vmax[j] = _mm256_blendv_ps(vmax[j], v, gt);
        vidx[j] = _mm256_blendv_epi8(vidx[j], idx[j], _mm256_castps_si256(gt));
    }
    float lanes[32];
    int32_t where[32];
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(lanes + 8 * j, vmax[j]);
        _mm256_storeu_si256((__m256i *)(where + 8 * j), vidx[j]);
    }
    float bv = first;
    int best = 0;
    for (int l = 0; l < 32; l++)
        if (lanes[l] > bv || (lanes[l] == bv && where[l] < best)) { bv = lanes[l]; best = where[l]; }
    return best;
}
#endif

/* index of the largest value of each row of a [M, N] matrix (float32 or bfloat16; first one on ties) */
void argmax_rows(const void *x, int M, int N, int64_t *out, int dtype) {
    const int bf16 = dtype == 1, es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int m = 0; m < M; m++) out[m] = row_argmax((const char *)x + (int64_t)m * N * es, N, bf16);
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
        const int best = row_argmax(row, N, 0);
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
