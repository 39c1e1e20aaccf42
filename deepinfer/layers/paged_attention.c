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
 * Long contexts are attended in fixed segments whose states merge in order, so that a few sequences can
 * spread one context over every thread and a row's bits still depend on its context alone (SEG_BLOCKS).
 * One loop (decode_attention_tasks) over tasks of one sequence's kv heads, with its block arithmetic in two
 * widths: 16 lanes (AVX-512, head_dim a multiple of 16, on CPUs that have it; in bf16 on CPUs with
 * AVX512-BF16 its scores use vdpbf16ps on the bf16 query rows, see block_scores_bf16) and 8 lanes
 * (AVX2: every other case). Both prefetch the blocks ahead and load each K row once for all grouped heads.
 * Built together with gguf_gemm.c by deepinfer/layers/cpu_kernels.py.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

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

/* ---- 8 lanes (AVX2; built on every x86 CPU) ----
 * A task's state: its G query rows (scaled) as float32, its G output rows, and per row the running max m
 * and sum l of the online softmax; `row` is the first query head's index in [B * H]. */
static inline void start_task8(const void *q, float (*qf)[MAX_D], float (*acc)[MAX_D], float *m, float *l,
                               int64_t row, int G, int D, float scale, int bf16) {
    const int esize = bf16 ? 2 : 4;
    const char *qb = (const char *)q + row * D * esize;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d += 8) {
            _mm256_store_ps(&qf[g][d], _mm256_mul_ps(load8(qb + (int64_t)(g * D + d) * esize, bf16), sc));
            _mm256_store_ps(&acc[g][d], _mm256_setzero_ps());
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
}

/* normalise and store the task's G output rows (and their log-sum-exp when asked) */
static inline void finish_task8(void *out, float *lse, float (*acc)[MAX_D], const float *m, const float *l,
                                int64_t row, int G, int D, int bf16) {
    const int esize = bf16 ? 2 : 4;
    for (int g = 0; g < G; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        if (lse) lse[row + g] = l[g] > 0.f ? m[g] + logf(l[g]) : -INFINITY;
        const __m256 iv = _mm256_set1_ps(inv);
        char *o = (char *)out + (row + g) * D * esize;
        for (int d = 0; d < D; d += 8) store8(o + (int64_t)d * esize, _mm256_mul_ps(_mm256_load_ps(&acc[g][d]), iv), bf16);
    }
}

/* s[g][t..t+3] = q[g] . K[t..t+3] for the G (<= 4, constant after inlining) grouped heads: each K row is
 * loaded (and widened) once and multiplied by every grouped query; four dot products per head in flight */
static inline __attribute__((always_inline)) void scores_quad8(const float (*qf)[MAX_D], float (*s)[MAX_BS], int G,
                                                               const char *k0, int64_t tstride, int D, int esize,
                                                               int bf16, int t) {
    __m256 a[4][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 k[4];
        for (int j = 0; j < 4; j++) k[j] = load8(k0 + j * tstride + d * esize, bf16);
        for (int g = 0; g < G; g++) {
            const __m256 qv = _mm256_load_ps(&qf[g][d]);
            for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(qv, k[j], a[g][j]);
        }
    }
    for (int g = 0; g < G; g++) _mm_storeu_ps(&s[g][t], hsum4x8(a[g][0], a[g][1], a[g][2], a[g][3]));
}

static void block_scores8(const float (*qf)[MAX_D], float (*s)[MAX_BS], int G, const char *kb, int64_t tstride,
                          int n, int D, int esize, int bf16) {
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        const char *k0 = kb + t * tstride;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const float (*qg)[MAX_D] = qf + g0;
            float (*sg)[MAX_BS] = s + g0;
            switch (G - g0 < 4 ? G - g0 : 4) {  /* constant G: the accumulators stay in registers */
                case 1: scores_quad8(qg, sg, 1, k0, tstride, D, esize, bf16, t); break;
                case 2: scores_quad8(qg, sg, 2, k0, tstride, D, esize, bf16, t); break;
                case 3: scores_quad8(qg, sg, 3, k0, tstride, D, esize, bf16, t); break;
                default: scores_quad8(qg, sg, 4, k0, tstride, D, esize, bf16, t);
            }
        }
    }
    for (; t < n; t++) {
        const char *kt = kb + t * tstride;
        for (int g = 0; g < G; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_load_ps(&qf[g][d]), load8(kt + d * esize, bf16), a);
            s[g][t] = hsum8(a);
        }
    }
}

/* online softmax over one block's n scores of one head: updates m, l; leaves probabilities in s;
 * returns the factor by which the head's accumulated output must be rescaled */
static inline float block_softmax8(float *s, int n, float *m, float *l) {
    float mx = *m;
    for (int t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    const float correction = *m == mx ? 1.f : expf(*m - mx);  /* expf(0) is exactly 1: the same bits, no call */
    *m = mx;
    *l *= correction;
    exp_shifted(s, n, mx, l);
    return correction;
}

/* acc[g] = acc[g] * corr[g] + sum over t of p[g][t] V[t] for GN grouped heads and ND 8-wide slices from
 * lane d0 (GN x ND accumulators, GN broadcasts and one V slice: at most 16 registers); each output lane
 * sums its products in t order */
static inline __attribute__((always_inline)) void values_tile8(float (*acc)[MAX_D], const float (*s)[MAX_BS],
                                                               const float *corr, int GN, int ND, const char *vb,
                                                               int64_t tstride, int n, int d0, int esize, int bf16) {
    __m256 a[4][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < ND; i++)
            a[g][i] = _mm256_mul_ps(_mm256_set1_ps(corr[g]), _mm256_load_ps(&acc[g][d0 + 8 * i]));
    for (int t = 0; t < n; t++) {
        __m256 p[4];
        for (int g = 0; g < GN; g++) p[g] = _mm256_set1_ps(s[g][t]);
        for (int i = 0; i < ND; i++) {
            const __m256 v = load8(vb + t * tstride + (d0 + 8 * i) * esize, bf16);
            for (int g = 0; g < GN; g++) a[g][i] = _mm256_fmadd_ps(p[g], v, a[g][i]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < ND; i++) _mm256_store_ps(&acc[g][d0 + 8 * i], a[g][i]);
}

/* acc = acc * correction + p . V over one block, for the G grouped heads of a kv head: up to 3 heads
 * take 32 lanes of the head per pass over the block's V rows, 4 heads 16 lanes */
static void block_values8(float (*acc)[MAX_D], const float (*s)[MAX_BS], const float *corr, int G, const char *vb,
                          int64_t tstride, int n, int D, int esize, int bf16) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? G - g0 : 4;
        float (*ag)[MAX_D] = acc + g0;
        const float (*sg)[MAX_BS] = s + g0;
        const float *cg = corr + g0;
        int d = 0;
        if (gn == 4) {
            for (; d + 16 <= D; d += 16) values_tile8(ag, sg, cg, 4, 2, vb, tstride, n, d, esize, bf16);
        } else {
            for (; d + 32 <= D; d += 32)
                switch (gn) {
                    case 1: values_tile8(ag, sg, cg, 1, 4, vb, tstride, n, d, esize, bf16); break;
                    case 2: values_tile8(ag, sg, cg, 2, 4, vb, tstride, n, d, esize, bf16); break;
                    default: values_tile8(ag, sg, cg, 3, 4, vb, tstride, n, d, esize, bf16);
                }
        }
        for (; d < D; d += 8)
            switch (gn) {
                case 1: values_tile8(ag, sg, cg, 1, 1, vb, tstride, n, d, esize, bf16); break;
                case 2: values_tile8(ag, sg, cg, 2, 1, vb, tstride, n, d, esize, bf16); break;
                case 3: values_tile8(ag, sg, cg, 3, 1, vb, tstride, n, d, esize, bf16); break;
                default: values_tile8(ag, sg, cg, 4, 1, vb, tstride, n, d, esize, bf16);
            }
    }
}

#ifdef __AVX512F__
/* ---- 16 lanes (AVX-512): the same steps as the 8-lane helpers above, 16 lanes wide (the softmax's
 * masked tail and the bf16 dot product make its float rounding differ from theirs) ---- */

/* the 8-lane sum of the two halves (AVX-512F only: no DQ extract needed) */
static inline __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* start_task and finish_task, 16 lanes at a time (the scalar loops were ~10% of a chat-length task);
 * the same values. with_q = 0 leaves qf unset: the bf16 dot product reads the query rows itself. */
static inline void start_task16(const void *q, float (*qf)[MAX_D], float (*acc)[MAX_D], float *m, float *l,
                                int64_t row, int G, int D, float scale, int bf16, int with_q) {
    const int esize = bf16 ? 2 : 4;
    const char *qb = (const char *)q + row * D * esize;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d += 16) {
            if (with_q) _mm512_store_ps(&qf[g][d], _mm512_mul_ps(load16(qb + (int64_t)(g * D + d) * esize, bf16), sc));
            _mm512_store_ps(&acc[g][d], _mm512_setzero_ps());
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
}

static inline void finish_task16(void *out, float *lse, float (*acc)[MAX_D], const float *m, const float *l,
                                 int64_t row, int G, int D, int bf16) {
    const int esize = bf16 ? 2 : 4;
    for (int g = 0; g < G; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        if (lse) lse[row + g] = l[g] > 0.f ? m[g] + logf(l[g]) : -INFINITY;
        const __m512 iv = _mm512_set1_ps(inv);
        char *o = (char *)out + (row + g) * D * esize;
        for (int d = 0; d < D; d += 16) store16(o + (int64_t)d * esize, _mm512_mul_ps(_mm512_load_ps(&acc[g][d]), iv), bf16);
    }
}

/* s[g][t..t+3] = q[g] . K[t..t+3] for the G (constant after inlining) grouped heads: each K row
 * is loaded once and multiplied by every grouped query */
static inline __attribute__((always_inline)) void scores_quad(const float (*qf)[MAX_D], float (*s)[MAX_BS], int G,
                                                              const char *k0, int64_t tstride, int D, int esize,
                                                              int bf16, int t) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512 k[4];
        for (int j = 0; j < 4; j++) k[j] = load16(k0 + j * tstride + d * esize, bf16);
        for (int g = 0; g < G; g++) {
            const __m512 qv = _mm512_loadu_ps(&qf[g][d]);
            for (int j = 0; j < 4; j++) a[g][j] = _mm512_fmadd_ps(qv, k[j], a[g][j]);
        }
    }
    for (int g = 0; g < G; g++)
        _mm_storeu_ps(&s[g][t], hsum4x8(fold16(a[g][0]), fold16(a[g][1]), fold16(a[g][2]), fold16(a[g][3])));
}

static void block_scores(const float (*qf)[MAX_D], float (*s)[MAX_BS], int G, const char *kb, int64_t tstride,
                         int n, int D, int esize, int bf16) {
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        const char *k0 = kb + t * tstride;
        switch (G) {  /* constant G: the accumulators stay in registers */
            case 1: scores_quad(qf, s, 1, k0, tstride, D, esize, bf16, t); break;
            case 2: scores_quad(qf, s, 2, k0, tstride, D, esize, bf16, t); break;
            case 3: scores_quad(qf, s, 3, k0, tstride, D, esize, bf16, t); break;
            case 4: scores_quad(qf, s, 4, k0, tstride, D, esize, bf16, t); break;
            default:
                for (int g0 = 0; g0 < G; g0 += 4) {
                    const int gn = G - g0 < 4 ? G - g0 : 4;
                    scores_quad(qf + g0, s + g0, gn, k0, tstride, D, esize, bf16, t);
                }
        }
    }
    for (; t < n; t++) {
        const char *kt = kb + t * tstride;
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(&qf[g][d]), load16(kt + d * esize, bf16), a);
            s[g][t] = _mm512_reduce_add_ps(a);
        }
    }
}

#ifdef __AVX512BF16__
/* ---- bf16 scores with vdpbf16ps ----
 * In bf16 the query rows are bf16 already, so q . k needs no widening: vdpbf16ps multiplies bf16 pairs
 * exactly (8-bit significands: every product fits a float32) and adds them into float32 lanes, the same
 * products the widening loop above forms; only the order of the float32 additions differs, and the scale
 * is applied to the finished score (the widening loop folds it into q; for a power-of-two scale, head
 * sizes 64 and 256, the two agree exactly up to that order). Per token and 32 lanes of the head this is
 * one 64-byte load and G dot instructions, where the widening loop takes two loads, two zero-extending
 * shuffles, two shifts and 2 x G FMAs, and reloads the G queries every four tokens. */

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: two in-lane transposing adds, then the four 128-bit lanes folded
 * (8 shuffles for four 16-lane sums; fold16 + hsum4x8 took 11) */
static inline __m128 hsum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d x = _mm512_castps_pd(b01), y = _mm512_castps_pd(b23);
    const __m512 c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const __m256 d = fold16(c);
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

/* the 16 bf16 values at p, in the low half of a vector whose high half is zero */
static inline __m512i load16_bf16_low(const void *p) {
    return _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p));
}

/* s[g][t] = scale * (q[g] . K[t]) for the G (<= 4) grouped heads and the n tokens of a block, four tokens
 * at a time. ND 32-lane chunks of the head plus TAIL (0/1) 16-lane ones; G, ND and TAIL are constants
 * after inlining, so the G queries stay in registers for the whole block and each K row is loaded once. */
static inline __attribute__((always_inline)) void scores_bf16(const uint16_t *qrow, float (*s)[MAX_BS], int G,
                                                              int ND, int TAIL, const char *kb, int64_t tstride,
                                                              int n, float scale) {
    const int D = 32 * ND + 16 * TAIL;
    __m512i qv[4][MAX_D / 32];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < ND; c++) qv[g][c] = _mm512_loadu_si512(qrow + g * D + 32 * c);
        if (TAIL) qv[g][ND] = load16_bf16_low(qrow + g * D + 32 * ND);
    }
    const __m128 sc = _mm_set1_ps(scale);
    for (int t = 0; t < n; t += 4) {
        const char *kr[4];
        for (int j = 0; j < 4; j++) kr[j] = kb + (t + j < n ? t + j : n - 1) * tstride;  /* a short quad repeats its last row */
        __m512 a[4][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
        for (int c = 0; c < ND + TAIL; c++) {
            __m512i k[4];
            for (int j = 0; j < 4; j++)
                k[j] = c < ND ? _mm512_loadu_si512(kr[j] + 64 * c) : load16_bf16_low(kr[j] + 64 * c);
            for (int g = 0; g < G; g++)
                for (int j = 0; j < 4; j++) a[g][j] = _mm512_dpbf16_ps(a[g][j], (__m512bh)qv[g][c], (__m512bh)k[j]);
        }
        for (int g = 0; g < G; g++) {
            const __m128 r = _mm_mul_ps(hsum4x16(a[g][0], a[g][1], a[g][2], a[g][3]), sc);
            if (t + 4 <= n) {
                _mm_storeu_ps(&s[g][t], r);
            } else {
                float tmp[4];
                _mm_storeu_ps(tmp, r);
                for (int j = 0; t + j < n; j++) s[g][t + j] = tmp[j];
            }
        }
    }
}

/* scores of one block from the task's bf16 query rows (qrow: G rows of D) */
static void block_scores_bf16(const uint16_t *qrow, float (*s)[MAX_BS], int G, const char *kb, int64_t tstride,
                              int n, int D, float scale) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? G - g0 : 4;
        const uint16_t *qg = qrow + (int64_t)g0 * D;
        float (*sg)[MAX_BS] = s + g0;
#define SCORES_BF16_G(ND, TAIL)                                                       \
    switch (gn) {                                                                     \
        case 1: scores_bf16(qg, sg, 1, ND, TAIL, kb, tstride, n, scale); break;       \
        case 2: scores_bf16(qg, sg, 2, ND, TAIL, kb, tstride, n, scale); break;       \
        case 3: scores_bf16(qg, sg, 3, ND, TAIL, kb, tstride, n, scale); break;       \
        default: scores_bf16(qg, sg, 4, ND, TAIL, kb, tstride, n, scale);             \
    }
        if (D == 64) {
            SCORES_BF16_G(2, 0)
        } else if (D == 128) {
            SCORES_BF16_G(4, 0)
        } else {
            SCORES_BF16_G(D / 32, (D % 32) / 16)
        }
#undef SCORES_BF16_G
    }
}
#endif

/* online softmax over one block's n scores of one head: updates m, l; leaves probabilities in s;
 * returns the factor by which the head's accumulated output must be rescaled */
static inline float block_softmax(float *s, int n, float *m, float *l) {
    __m512 mx = _mm512_set1_ps(*m);
    for (int c = 0; c < n; c += 16) {
        const __mmask16 k = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, k, s + c));
    }
    const float new_max = _mm512_reduce_max_ps(mx);
    /* the running maximum stays put for most blocks of a long context: expf(0) is exactly 1, so skipping the
     * call keeps the bits (3.9% of a 2,048-token prefill's time went to these calls) */
    const float correction = *m == new_max ? 1.f : expf(*m - new_max);
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 16) {
        const __mmask16 k = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + c), shift));
        _mm512_mask_storeu_ps(s + c, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    *m = new_max;
    *l = *l * correction + _mm512_reduce_add_ps(sum);
    return correction;
}

/* acc[g] = acc[g] * corr[g] + sum over t of p[g][t] V[t] for the GN (constant after inlining) grouped heads
 * g0.. and all ND 16-wide slices of a head: every accumulator stays in a register for the whole block, so
 * each probability is broadcast once per token and each V row loaded once (the slice-by-slice loop
 * broadcast every probability once per slice). Every output lane sums the same products in the same
 * order (t ascending) as that loop. */
static inline __attribute__((always_inline)) void values_tile(float (*acc)[MAX_D], const float (*s)[MAX_BS],
                                                              const float *corr, int GN, int ND, const char *vb,
                                                              int64_t tstride, int n, int d0, int esize, int bf16) {
    __m512 a[4][8];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < ND; i++)
            a[g][i] = _mm512_mul_ps(_mm512_set1_ps(corr[g]), _mm512_load_ps(&acc[g][d0 + 16 * i]));
    for (int t = 0; t < n; t++) {
        __m512 p[4];
        for (int g = 0; g < GN; g++) p[g] = _mm512_set1_ps(s[g][t]);
        for (int i = 0; i < ND; i++) {
            const __m512 v = load16(vb + t * tstride + (d0 + 16 * i) * esize, bf16);
            for (int g = 0; g < GN; g++) a[g][i] = _mm512_fmadd_ps(p[g], v, a[g][i]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < ND; i++) _mm512_store_ps(&acc[g][d0 + 16 * i], a[g][i]);
}

/* acc = acc * correction + p . V over one block, for the G grouped heads of a kv head */
static void block_values(float (*acc)[MAX_D], const float (*s)[MAX_BS], const float *corr, int G, const char *vb,
                         int64_t tstride, int n, int D, int esize, int bf16) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? G - g0 : 4;
        float (*ag)[MAX_D] = acc + g0;
        const float (*sg)[MAX_BS] = s + g0;
        if (D == 64) {  /* up to 4 heads x 4 slices: 16 accumulators */
            switch (gn) {
                case 1: values_tile(ag, sg, corr + g0, 1, 4, vb, tstride, n, 0, esize, bf16); break;
                case 2: values_tile(ag, sg, corr + g0, 2, 4, vb, tstride, n, 0, esize, bf16); break;
                case 3: values_tile(ag, sg, corr + g0, 3, 4, vb, tstride, n, 0, esize, bf16); break;
                default: values_tile(ag, sg, corr + g0, 4, 4, vb, tstride, n, 0, esize, bf16);
            }
            continue;
        }
        /* other head sizes: 4 slices (64 lanes of the head) per pass, as many passes as D needs */
        for (int d = 0; d < D; d += 16) {
            if (d + 64 <= D) {
                switch (gn) {
                    case 1: values_tile(ag, sg, corr + g0, 1, 4, vb, tstride, n, d, esize, bf16); break;
                    case 2: values_tile(ag, sg, corr + g0, 2, 4, vb, tstride, n, d, esize, bf16); break;
                    case 3: values_tile(ag, sg, corr + g0, 3, 4, vb, tstride, n, d, esize, bf16); break;
                    default: values_tile(ag, sg, corr + g0, 4, 4, vb, tstride, n, d, esize, bf16);
                }
                d += 48;
                continue;
            }
            switch (gn) {
                case 1: values_tile(ag, sg, corr + g0, 1, 1, vb, tstride, n, d, esize, bf16); break;
                case 2: values_tile(ag, sg, corr + g0, 2, 1, vb, tstride, n, d, esize, bf16); break;
                case 3: values_tile(ag, sg, corr + g0, 3, 1, vb, tstride, n, d, esize, bf16); break;
                default: values_tile(ag, sg, corr + g0, 4, 1, vb, tstride, n, d, esize, bf16);
            }
        }
    }
}

#endif  /* __AVX512F__ */

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1  /* how many blocks ahead of the one computing are requested (2 and more: slower
                            * on a 2-core EPYC Zen 5, the requests outnumber what a core keeps in flight) */
#endif

/* prefetch the first `bytes` of n token rows (tstride apart) starting at p; p NULL: nothing. Into L2 (T1), not
 * L1: on a 2-core EPYC Zen 4 (32 KB L1) the same requests into L1 made the kernel twice as slow (chat contexts at
 * B = 64: 38 -> 19 ns per token and kv head; a 1,900-token context 3.3 -> 1.6 ms per step), the block ahead
 * pushing out the rows in use; the GGUF kernels' sequential weight reads stay faster with T0 there. */
static inline __attribute__((always_inline)) void prefetch_rows(const char *p, int n, int64_t tstride, int bytes) {
    if (!p) return;
    for (int t = 0; t < n; t++)
        for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + t * tstride + off, _MM_HINT_T1);
}

/* prefetch heads h..h+nh-1's rows of block `block` (the first `rows` tokens of it) for K and V */
static inline void prefetch_block(const void *k_cache, const void *v_cache, int64_t block, int block_size,
                                  int64_t row_stride, int h, int nh, int D, int esize, int64_t rows) {
    const int n = rows < block_size ? (int)rows : block_size;
    const int64_t first = (block * block_size * row_stride + (int64_t)h * D) * esize;
    prefetch_rows((const char *)k_cache + first, n, row_stride * esize, nh * D * esize);
    prefetch_rows((const char *)v_cache + first, n, row_stride * esize, nh * D * esize);
}

/* one block of a task in the width the loop was built for (wide: 16 lanes, AVX-512 builds only; dot_bf16:
 * the scores from the bf16 query rows qrow). pk, pv (or NULL): this head's rows of a block ahead, requested
 * from memory in two small batches, K's before the scores and V's before the values, rather than every head's
 * rows of two blocks ahead at once: a core keeps only a couple of dozen L1 misses in flight, and one burst
 * of 192 requests (a 16-token block of 3 kv heads, K and V) stalled the loop until they drained (B = 32 chat
 * contexts: 4.9 -> 3.1 ms per step of 30 layers on a 2-core EPYC). */
static inline __attribute__((always_inline)) void task_block(int wide, int dot_bf16, float (*qf)[MAX_D],
                                                             const void *qrow, float (*acc)[MAX_D],
                                                             float (*s)[MAX_BS], float *m, float *l, float *corr,
                                                             int G, const char *kb, const char *vb, int64_t tstride,
                                                             int n, int D, float scale, int esize, int bf16,
                                                             const char *pk, const char *pv, int pn) {
    prefetch_rows(pk, pn, tstride, D * esize);
#ifdef __AVX512F__
    if (wide) {
#ifdef __AVX512BF16__
        if (dot_bf16)
            block_scores_bf16((const uint16_t *)qrow, s, G, kb, tstride, n, D, scale);
        else
#endif
            block_scores((const float (*)[MAX_D])qf, s, G, kb, tstride, n, D, esize, bf16);
        for (int g = 0; g < G; g++) corr[g] = block_softmax(s[g], n, &m[g], &l[g]);
        prefetch_rows(pv, pn, tstride, D * esize);
        block_values(acc, (const float (*)[MAX_BS])s, corr, G, vb, tstride, n, D, esize, bf16);
        return;
    }
#endif
    (void)wide, (void)dot_bf16, (void)qrow, (void)scale;
    block_scores8((const float (*)[MAX_D])qf, s, G, kb, tstride, n, D, esize, bf16);
    for (int g = 0; g < G; g++) corr[g] = block_softmax8(s[g], n, &m[g], &l[g]);
    prefetch_rows(pv, pn, tstride, D * esize);
    block_values8(acc, (const float (*)[MAX_BS])s, corr, G, vb, tstride, n, D, esize, bf16);
}

/* whether the task that attended context [.., ctx) of `earlier` (NULL: none) read the physical block that holds
 * token `at` of `table` */
static inline int read_before(const int64_t *earlier, int64_t ctx, const int64_t *table, int64_t at, int block_size) {
    return earlier && at < ctx && earlier[at / block_size] == table[at / block_size];
}

/* Segments: a context is attended in segments of SEG_BLOCKS blocks (boundaries at multiples of
 * SEG_BLOCKS * block_size from token 0), each from a fresh online-softmax state, and the segments' states
 * are merged in order (merge_rows). A row's result is then a function of its context alone, whether one
 * thread walks all its segments (many sequences: a task per sequence or kv head) or the segments run as
 * tasks of their own on different threads (a few sequences: `split`). Splitting is what lets a single long
 * sequence use every thread: with one task per kv head, 3 kv heads on 2 threads kept one thread idle a
 * third of the time (a batch-1 step over a 1,900-token context: 17.4 ms of CPU for 12.0 ms of work).
 * Contexts of one segment (up to 256 tokens at 16-token blocks) are computed exactly as before. */
#define SEG_BLOCKS 16

/* segments of a context [skip, ctx) (skip and the segment length seg are multiples of the block size) */
static inline int64_t seg_count(int64_t skip, int64_t ctx, int64_t seg) {
    return ctx <= skip ? 0 : (ctx - 1) / seg - skip / seg + 1;
}

/* normalise and store R output rows in the width the loop was built for (finish_task16 / finish_task8) */
static inline __attribute__((always_inline)) void finish_task(int wide, void *out, float *lse, float (*acc)[MAX_D],
                                                              const float *m, const float *l, int64_t row, int R,
                                                              int D, int bf16) {
#ifdef __AVX512F__
    if (wide) {
        finish_task16(out, lse, acc, m, l, row, R, D, bf16);
        return;
    }
#endif
    (void)wide;
    finish_task8(out, lse, acc, m, l, row, R, D, bf16);
}

/* a fresh online-softmax state for R rows */
static inline void reset_rows(float (*acc)[MAX_D], float *m, float *l, int R, int D) {
    for (int r = 0; r < R; r++) {
        memset(acc[r], 0, (size_t)D * sizeof(float));
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
}

/* A task is one sequence's kv heads h0..h0+span-1 over tokens [t0, t1): all of them (span = KVH) while there
 * are enough sequences to keep every thread busy, so that each block's K and V rows (all heads of a token
 * are contiguous) are read whole, one after the other, and the task walks the whole context (merging its
 * segments as it goes); otherwise single heads, and where a context has more than one segment each segment
 * is a task of its own (`split`: their states go to `part` and are merged after). With G <= 4 grouped query
 * heads every K row is loaded (and widened) once into registers for all of them. A loop that walked one kv
 * head through all blocks, then the next, reached ~7 GB/s on a 2-core Xeon and on a 2-core EPYC (scattered
 * 256-byte slices of 768-byte rows); `wide` is a constant in each caller. Returns -2 if the split state
 * cannot be allocated. */
static inline __attribute__((always_inline)) int decode_attention_tasks(
        const void *q, void *out, const void *k_cache, const void *v_cache, const int64_t *block_tables,
        int max_blocks, const int64_t *context_lens, int B, int H, int KVH, int D, int block_size, float scale,
        int dtype, int64_t skip, float *lse, int wide) {
    const int G = H / KVH, bf16 = dtype == 1, esize = bf16 ? 2 : 4;
    const int64_t row_stride = (int64_t)KVH * D, tstride = row_stride * esize;
    const int64_t seg = (int64_t)SEG_BLOCKS * block_size;
    const int span = B >= 4 * omp_get_max_threads() && H <= MAX_GROUP ? KVH : 1;
    const int per_seq = KVH / span, units = B * per_seq;
    int split = 0;
    if (span == 1)
        for (int b = 0; b < B && !split; b++) split = seg_count(skip, context_lens[b], seg) > 1;
    /* split: task -> (unit, segment); first[u]: unit u's first task */
    int64_t tasks = units, *first = NULL;
    float *part = NULL;
    if (split) {
        first = malloc(sizeof(int64_t) * (units + 1));
        if (!first) return -2;
        first[0] = 0;
        for (int u = 0; u < units; u++) {
            const int64_t n = seg_count(skip, context_lens[u / per_seq], seg);
            first[u + 1] = first[u] + (n > 0 ? n : 1);
        }
        tasks = first[units];
        part = malloc(sizeof(float) * tasks * G * (D + 2));  /* per task: G acc rows, G maxima, G sums */
        if (!part) {
            free(first);
            return -2;
        }
    }
#ifdef __AVX512BF16__
    const int dot_bf16 = wide && bf16;  /* scores from the bf16 query rows with vdpbf16ps (block_scores_bf16) */
#else
    const int dot_bf16 = 0;
#endif
    int64_t chunk = tasks / (4 * omp_get_max_threads());
    chunk = chunk < 1 ? 1 : !split && chunk > per_seq ? per_seq : chunk;
#pragma omp parallel
    {
    int64_t previous = -1;  /* the task this thread ran last: it has requested this task's first blocks */
#pragma omp for schedule(dynamic, chunk)
    for (int64_t task = 0; task < tasks; task++) {
        int unit = (int)task, sg = -1;  /* sg: the segment a split task computes */
        if (split) {
            int lo = 0, hi = units - 1;  /* the unit whose tasks include this one */
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (first[mid] <= task) lo = mid; else hi = mid - 1;
            }
            unit = lo;
            sg = (int)(task - first[unit]);
        }
        const int b = unit / per_seq, h0 = unit % per_seq * span, R = span * G;
        const int64_t row = (int64_t)b * H + h0 * G;  /* the task's first query head in [B * H] */
        float qf[MAX_GROUP][MAX_D] __attribute__((aligned(64)));
        float acc[MAX_GROUP][MAX_D] __attribute__((aligned(64)));
        float macc[MAX_GROUP][MAX_D] __attribute__((aligned(64)));  /* earlier segments, merged */
        float s[MAX_GROUP][MAX_BS] __attribute__((aligned(64)));
        float m[MAX_GROUP], l[MAX_GROUP], corr[MAX_GROUP], mm[MAX_GROUP], ml[MAX_GROUP];
#ifdef __AVX512F__
        if (wide)
            start_task16(q, qf, acc, m, l, row, R, D, scale, bf16, !dot_bf16);
        else
#endif
            start_task8(q, qf, acc, m, l, row, R, D, scale, bf16);
        const int64_t ctx = context_lens[b];
        const int64_t *table = block_tables + (int64_t)b * max_blocks;
        int64_t t0 = skip, t1 = ctx;
        if (split) {
            const int64_t s0 = (skip / seg + sg) * seg;
            t0 = s0 > skip ? s0 : skip;
            t1 = s0 + seg < ctx ? s0 + seg : ctx;
        }
        /* The rows of a prompt are tasks of their own (consecutive positions of one sequence, each attending
         * the blocks of the rows before it): a block the thread's previous task read comes from this core's
         * caches, and requesting it again only cost the loop (a 2,048-token prefill's attention 10% faster
         * without those requests, 16% with none at all). Decode rows whose sequences share a prefix skip its
         * blocks likewise. */
        const int64_t *prev_table = NULL;
        int64_t prev_ctx = 0;
        if (!split && per_seq == 1 && previous >= 0) {
            prev_table = block_tables + previous * max_blocks;
            prev_ctx = context_lens[previous];
        }
        if (previous != task - 1)
            for (int64_t ahead = t0; ahead < t1 && ahead < t0 + PREFETCH_BLOCKS * block_size; ahead += block_size)
                if (!read_before(prev_table, prev_ctx, table, ahead, block_size))
                    prefetch_block(k_cache, v_cache, table[ahead / block_size], block_size, row_stride, h0, span, D,
                                   esize, ctx - ahead);
        previous = task;
        /* where this task's blocks end (block-aligned), for prefetching past it into the next task */
        const int64_t end = t0 + (t1 - t0 + block_size - 1) / block_size * block_size;
        int merged = 0;  /* segments merged into macc so far (a task that walks a whole context) */
        for (int64_t start = t0; start < t1; start += block_size) {
            if (start > t0 && start % seg == 0) {  /* a segment ends: merge it, start the next one fresh */
                merge_rows(&macc[0][0], MAX_D, mm, ml, &acc[0][0], MAX_D, m, l, R, D, !merged);
                merged++;
                reset_rows(acc, m, l, R, D);
            }
            const int n = (int)(t1 - start < block_size ? t1 - start : block_size);
            /* blocks lie anywhere in the pool, so the hardware prefetcher cannot run ahead across
             * them: ask for the block ahead while this one computes (measured 3x on a Xeon: the kernel ran at
             * ~7 GB/s on scattered blocks and ~23 GB/s on cache-resident ones), one head at a time inside
             * task_block. Near the task's end the block ahead is the next task's: it usually runs next on
             * this thread (a split task's next segment, or the next sequence's heads), and a chat context of
             * 3-7 blocks otherwise starts every task on a block that nobody requested early. */
            const int64_t ahead = start + PREFETCH_BLOCKS * block_size;
            int64_t pblock = -1, prows = 0;  /* the block ahead and its rows to request; -1: none */
            int ph0 = h0;  /* its first head */
            if (ahead < ctx) {
                if (!read_before(prev_table, prev_ctx, table, ahead, block_size)) {
                    pblock = table[ahead / block_size];
                    prows = ctx - ahead;
                }
            } else if (!split && task + 1 < tasks && ahead >= end) {
                const int nb = (int)(task + 1) / per_seq;
                const int64_t at = skip + (ahead - end), nctx = context_lens[nb];
                /* the next task's block, unless it is one this task read (the next row of a prompt) */
                if (at < nctx && !(per_seq == 1 &&
                                   read_before(table, ctx, block_tables + (int64_t)nb * max_blocks, at, block_size))) {
                    pblock = block_tables[(int64_t)nb * max_blocks + at / block_size];
                    prows = nctx - at;
                    ph0 = (int)(task + 1) % per_seq * span;
                }
            }
            const int pn = prows < block_size ? (int)prows : block_size;
            const int64_t first_row = table[start / block_size] * block_size * row_stride;
            for (int h = h0; h < h0 + span; h++) {
                const char *pk = NULL, *pv = NULL;
                if (pblock >= 0) {
                    const int64_t off = (pblock * block_size * row_stride + (int64_t)(ph0 + h - h0) * D) * esize;
                    pk = (const char *)k_cache + off, pv = (const char *)v_cache + off;
                }
                const int i = (h - h0) * G;  /* this kv head's query heads in the task's state */
                const char *kb = (const char *)k_cache + (first_row + (int64_t)h * D) * esize;
                const char *vb = (const char *)v_cache + (first_row + (int64_t)h * D) * esize;
                task_block(wide, dot_bf16, qf + i, (const char *)q + (row + i) * D * esize, acc + i, s, m + i, l + i,
                           corr, G, kb, vb, tstride, n, D, scale, esize, bf16, pk, pv, pn);
            }
        }
        if (split) {  /* this segment's state, merged with its neighbours' below */
            float *p = part + task * G * (D + 2);
            for (int g = 0; g < G; g++) memcpy(p + (int64_t)g * D, acc[g], (size_t)D * sizeof(float));
            memcpy(p + (int64_t)G * D, m, (size_t)G * sizeof(float));
            memcpy(p + (int64_t)G * D + G, l, (size_t)G * sizeof(float));
            continue;
        }
        if (merged) {  /* the last segment, then the merged state is the task's */
            merge_rows(&macc[0][0], MAX_D, mm, ml, &acc[0][0], MAX_D, m, l, R, D, 0);
            finish_task(wide, out, lse, macc, mm, ml, row, R, D, bf16);
        } else {
            finish_task(wide, out, lse, acc, m, l, row, R, D, bf16);
        }
    }
    if (split) {
#pragma omp for schedule(static)
        for (int unit = 0; unit < units; unit++) {
            const int b = unit / per_seq, h0 = unit % per_seq;
            const int64_t row = (int64_t)b * H + h0 * G;
            float acc[MAX_GROUP][MAX_D] __attribute__((aligned(64)));
            float m[MAX_GROUP], l[MAX_GROUP];
            for (int64_t t = first[unit]; t < first[unit + 1]; t++) {
                const float *p = part + t * G * (D + 2);
                merge_rows(&acc[0][0], MAX_D, m, l, p, D, p + (int64_t)G * D, p + (int64_t)G * D + G, G, D,
                           t == first[unit]);
            }
            finish_task(wide, out, lse, acc, m, l, row, G, D, bf16);
        }
    }
    }
    free(part);
    free(first);
    return 0;
}

/* the vector kernel above, on any CPU (paged_decode_attention takes AMX tiles instead where it can; the tests and
 * benchmarks/attn_kernel.py --vector compare the two) */
int paged_decode_attention_vector(const void *q, void *out, const void *k_cache, const void *v_cache,
                                  const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                                  int B, int H, int KVH, int D, int block_size, float scale, int dtype,
                                  int64_t skip, float *lse) {
    if (D > MAX_D || D % 8 || H % KVH || H / KVH > MAX_GROUP || block_size > MAX_BS) return -1;
#ifdef __AVX512F__
    if (D % 16 == 0)
        return decode_attention_tasks(q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, B, H, KVH, D,
                                      block_size, scale, dtype, skip, lse, 1);
#endif
    return decode_attention_tasks(q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, B, H, KVH, D,
                                  block_size, scale, dtype, skip, lse, 0);
}

#if HAVE_AMX
int amx_decode_attention(const uint16_t *q, uint16_t *out, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int max_blocks, const int64_t *context_lens, int B, int H,
                         int KVH, int D, int block_size, float scale);
int amx_attention_applies(int H, int KVH, int D, int block_size);

/* bf16 rows whose context has at least this many tokens take the AMX kernel: a row's own property, so its bits never
 * depend on the batch. The tiles pay where rows share a prefix's segments (a shared-prefix step's attention 1.2-1.5x
 * faster); a lone short context, its KV streamed from memory, ran ~15% slower there than in the vector kernel
 * (benchmarks/attn_kernel.py --vector; benchmarks/BENCHMARKS.md, session 53). */
#define AMX_MIN_CONTEXT 256

/* the bf16 rows `rows[0..n)` of a call through one kernel (amx: 1 the AMX one), gathered and scattered back */
static int attend_subset(int amx, const int *rows, int n, const uint16_t *q, uint16_t *out, const void *k_cache,
                         const void *v_cache, const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                         int H, int KVH, int D, int block_size, float scale) {
    const size_t qrow = (size_t)H * D;
    uint16_t *qs = malloc(sizeof(uint16_t) * 2 * qrow * n), *os = qs ? qs + qrow * n : NULL;
    int64_t *tables = malloc(sizeof(int64_t) * ((size_t)max_blocks + 1) * n);
    int64_t *lens = tables ? tables + (size_t)max_blocks * n : NULL;
    int rc = -2;
    if (qs && tables) {
        for (int i = 0; i < n; i++) {
            memcpy(qs + qrow * i, q + qrow * rows[i], qrow * sizeof(uint16_t));
            memcpy(tables + (size_t)max_blocks * i, block_tables + (size_t)max_blocks * rows[i],
                   sizeof(int64_t) * max_blocks);
            lens[i] = context_lens[rows[i]];
        }
        rc = amx ? amx_decode_attention(qs, os, k_cache, v_cache, tables, max_blocks, lens, n, H, KVH, D, block_size,
                                        scale)
                 : paged_decode_attention_vector(qs, os, k_cache, v_cache, tables, max_blocks, lens, n, H, KVH, D,
                                                 block_size, scale, 1, 0, NULL);
        for (int i = 0; rc == 0 && i < n; i++) memcpy(out + qrow * rows[i], os + qrow * i, qrow * sizeof(uint16_t));
    }
    free(qs);
    free(tables);
    return rc;
}

/* bf16 rows, each through the kernel its context length picks (AMX_MIN_CONTEXT) */
static int attend_bf16_amx(const uint16_t *q, uint16_t *out, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int max_blocks, const int64_t *context_lens, int B, int H,
                           int KVH, int D, int block_size, float scale) {
    int longer = 0;
    for (int b = 0; b < B; b++) longer += context_lens[b] >= AMX_MIN_CONTEXT;
    if (longer == B)
        return amx_decode_attention(q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, B, H, KVH, D,
                                    block_size, scale);
    if (longer == 0)
        return paged_decode_attention_vector(q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, B, H, KVH,
                                             D, block_size, scale, 1, 0, NULL);
    int *rows = malloc(sizeof(int) * B);
    if (!rows) return -2;
    int n = 0;
    for (int b = 0; b < B; b++)
        if (context_lens[b] >= AMX_MIN_CONTEXT) rows[n++] = b;
    for (int b = 0; b < B; b++)
        if (context_lens[b] < AMX_MIN_CONTEXT) rows[n++] = b;
    int rc = attend_subset(1, rows, longer, q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, H, KVH, D,
                           block_size, scale);
    if (rc == 0)
        rc = attend_subset(0, rows + longer, B - longer, q, out, k_cache, v_cache, block_tables, max_blocks, context_lens,
                           H, KVH, D, block_size, scale);
    free(rows);
    return rc;
}
#endif

/* Decode attention for B rows, each over its own paged context (arguments above): bf16 rows of contexts of at least
 * AMX_MIN_CONTEXT tokens on AMX tiles where the CPU has them and no skip / lse is asked (paged_attention_amx.c), the
 * vector kernel otherwise */
int paged_decode_attention(const void *q, void *out, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                           int B, int H, int KVH, int D, int block_size, float scale, int dtype,
                           int64_t skip, float *lse) {
#if HAVE_AMX
    if (dtype == 1 && skip == 0 && !lse && block_size <= MAX_BS && amx_attention_applies(H, KVH, D, block_size))
        return attend_bf16_amx(q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, B, H, KVH, D,
                               block_size, scale);
#endif
    return paged_decode_attention_vector(q, out, k_cache, v_cache, block_tables, max_blocks, context_lens, B, H, KVH,
                                         D, block_size, scale, dtype, skip, lse);
}
