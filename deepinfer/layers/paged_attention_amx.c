/*
 * Decode attention on AMX tiles: the bf16 path of paged_decode_attention (paged_attention.c) on CPUs with AMX.
 *
 * Same arguments: q, out [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks];
 * context_lens [B] (tokens to attend, the new one included). Each of the B rows ("entries": a decoding sequence, a
 * speculative row, a row of a prompt) attends its context in segments of SEG tokens counted from token 0:
 *   scores  = q rows x the segment's keys (one tile product; the keys transposed into B tiles, pack_keys),
 *   softmax over the segment alone in float32, each probability split into a bf16 leading part and a bf16
 *             remainder (16 bits of it kept, where one bf16 rounding changed a quarter of the outputs' last bit),
 *   partial = probabilities x the segment's values (a second tile product, both parts; the values interleaved in
 *             key pairs, pack_values),
 * and each row's segment states (partial sum, maximum, normaliser) are folded in order into its result (merge_rows).
 * Every output of a tile product is a function of its own row, so a row's bits depend on its q and its context
 * alone, never on which rows share its tiles: the rows whose segment covers the same physical blocks (sequences
 * with a common prefix from the prefix cache, a sequence's grouped query heads, the rows of one prompt) are
 * gathered into 16-row tiles, and a shared prefix's keys and values are transposed and multiplied once per step for
 * all of them (a "cascade", without a second numerics for the shared part).
 *
 * Work: the segments of a window of segment indices are grouped by their blocks and valid length (a hash per
 * index); a task is a shared group's kv head and TASK_ROWS of its rows, or an unshared segment's one or all kv
 * heads; each writes one record per (row, segment) and a second pass folds a window's records into each row's
 * running state. TDPBF16PS rounds inside a k pair otherwise than the vector kernel's VDPBF16PS: the two kernels
 * agree to bf16 rounding (a CPU runs one of them). Built with the other kernels by deepinfer/layers/cpu_kernels.py.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"

#if HAVE_AMX
#define SEG 64                 /* tokens per segment: four 16-key score tiles, two 32-key probability tiles */
#define AMX_ATT_MAX_D 256
#define RECORD_BUDGET (8 << 20) /* bytes of segment records per window */
#define TASK_ROWS 96            /* rows of a shared group per task */
/* an unshared segment's task asks for the blocks of the task this many further on (1-3 and none measured alike on a
 * 2-core Xeon: those tasks read scattered blocks at ~13 GB/s, where the vector kernel reads them at ~14) */
#define REQUEST_AHEAD 1

/* the 16 x 16 transpose of r's 32-bit elements, in place */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* Where a segment's tokens lie: slot[i] is token t0 + i's row in the cache's [num_blocks * block_size] rows */
typedef struct {
    int64_t slot[SEG];
    int n; /* its tokens (1..SEG) */
} segment;

/* the segment of `table` (an entry's block table) from token t0, n tokens; block_size = 1 << shift */
static inline void locate(segment *sg, const int64_t *table, int shift, int64_t t0, int n) {
    const int64_t mask = ((int64_t)1 << shift) - 1;
    sg->n = n;
    for (int i = 0; i < n; i++) sg->slot[i] = (table[(t0 + i) >> shift] << shift) + ((t0 + i) & mask);
}

static inline const uint16_t *token_row(const uint16_t *cache, const segment *sg, int i, int KVH, int h, int D) {
    return cache + (sg->slot[i] * KVH + h) * D;
}

/* ask for the segment's keys and values of kv heads h0 .. h0 + span - 1 (blocks lie anywhere in the pool, so the
 * hardware prefetcher cannot run ahead across them) */
static inline void request(const uint16_t *k_cache, const uint16_t *v_cache, const segment *sg, int KVH, int h0,
                           int span, int D) {
    const int bytes = span * D * 2;
    for (int i = 0; i < sg->n; i++) {
        const char *k = (const char *)token_row(k_cache, sg, i, KVH, h0, D);
        const char *v = (const char *)token_row(v_cache, sg, i, KVH, h0, D);
        for (int o = 0; o < bytes; o += 64) {
            _mm_prefetch(k + o, _MM_HINT_T0);
            _mm_prefetch(v + o, _MM_HINT_T0);
        }
    }
}

/* The segment's keys of kv head h as B tiles for q . k: tile (j, c) (1 KB at kt + (j * D / 32 + c) * 512) holds
 * keys 16 j .. 16 j + 15 as columns and their dims 32 c .. 32 c + 31 as 16 rows of pairs (k[2 i], k[2 i + 1]): the
 * 32-bit transpose of 16 key rows. Keys past n are zeros. */
static void pack_keys(const uint16_t *k_cache, const segment *sg, int KVH, int h, int D, uint16_t *kt) {
    for (int j = 0; j < SEG / 16; j++)
        for (int c = 0; c < D / 32; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = 16 * j + i < sg->n ? _mm512_loadu_si512(token_row(k_cache, sg, 16 * j + i, KVH, h, D) + 32 * c)
                                          : _mm512_setzero_si512();
            transpose16(r);
            uint16_t *tile = kt + (int64_t)(j * (D / 32) + c) * 512;
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(tile + 32 * i, r[i]);
        }
}

/* The segment's values of kv head h as B tiles for p . v: tile (g, e) (1 KB at vp + (g * D / 16 + e) * 512) holds
 * keys 32 g .. 32 g + 31 as 16 rows of key pairs and dims 16 e .. 16 e + 15 as columns, each (v[2 i][d],
 * v[2 i + 1][d]). Keys past n are zeros (their probabilities are zero too, but 0 x NaN is not). */
static void pack_values(const uint16_t *v_cache, const segment *sg, int KVH, int h, int D, uint16_t *vp) {
    /* quadwords (4 dims each) reordered so that the in-lane word interleaves leave dims in order: lane l of the
     * result takes dims 4 l .. 4 l + 3 and 16 + 4 l .. 16 + 4 l + 3 */
    const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < SEG / 32; g++)
        for (int i = 0; i < 16; i++) {
            const int k0 = 32 * g + 2 * i, k1 = k0 + 1;
            const uint16_t *a = k0 < sg->n ? token_row(v_cache, sg, k0, KVH, h, D) : NULL;
            const uint16_t *b = k1 < sg->n ? token_row(v_cache, sg, k1, KVH, h, D) : NULL;
            for (int c = 0; c < D / 32; c++) {
                const __m512i va = _mm512_permutexvar_epi64(order, a ? _mm512_loadu_si512(a + 32 * c)
                                                                     : _mm512_setzero_si512());
                const __m512i vb = _mm512_permutexvar_epi64(order, b ? _mm512_loadu_si512(b + 32 * c)
                                                                     : _mm512_setzero_si512());
                uint16_t *t = vp + (int64_t)(g * (D / 16) + 2 * c) * 512 + 32 * i;
                _mm512_storeu_si512(t, _mm512_unpacklo_epi16(va, vb));
                _mm512_storeu_si512(t + 512, _mm512_unpackhi_epi16(va, vb));
            }
        }
}

/* s[16][SEG] = the 16 query rows of qt ([16][D] bf16) . the packed keys, unscaled */
static inline void score_tiles(const uint16_t *qt, const uint16_t *kt, int D, float *s) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    const int chunks = D / 32;
    for (int c = 0; c < chunks; c++) {
        _tile_loadd(0, qt + 32 * c, 2 * D);
        _tile_loadd(1, kt + (int64_t)(0 * chunks + c) * 512, 64);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kt + (int64_t)(1 * chunks + c) * 512, 64);
        _tile_dpbf16ps(3, 0, 1);
        _tile_loadd(1, kt + (int64_t)(2 * chunks + c) * 512, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, kt + (int64_t)(3 * chunks + c) * 512, 64);
        _tile_dpbf16ps(5, 0, 1);
    }
    _tile_stored(2, s, SEG * 4);
    _tile_stored(3, s + 16, SEG * 4);
    _tile_stored(4, s + 32, SEG * 4);
    _tile_stored(5, s + 48, SEG * 4);
}

/* o[16][D] = p . the packed values, p = its bf16 leading part ([16][SEG] at p) plus its bf16 remainder (at
 * p + 16 * SEG): each 32-key step adds the leading part's products, then the remainder's */
static inline void value_tiles(const uint16_t *p, const uint16_t *vp, int D, float *o) {
    const int groups = D / 16;
    for (int e = 0; e < groups; e += 4) {
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int g = 0; g < SEG / 32; g++) {
            const uint16_t *v = vp + (int64_t)(g * groups + e) * 512;
            _tile_loadd(6, p + 32 * g, SEG * 2);
            _tile_loadd(0, p + 16 * SEG + 32 * g, SEG * 2);
            _tile_loadd(7, v, 64);
            _tile_dpbf16ps(2, 6, 7);
            _tile_dpbf16ps(2, 0, 7);
            _tile_loadd(7, v + 512, 64);
            _tile_dpbf16ps(3, 6, 7);
            _tile_dpbf16ps(3, 0, 7);
            _tile_loadd(7, v + 1024, 64);
            _tile_dpbf16ps(4, 6, 7);
            _tile_dpbf16ps(4, 0, 7);
            _tile_loadd(7, v + 1536, 64);
            _tile_dpbf16ps(5, 6, 7);
            _tile_dpbf16ps(5, 0, 7);
        }
        _tile_stored(2, o + 16 * e, D * 4);
        _tile_stored(3, o + 16 * e + 16, D * 4);
        _tile_stored(4, o + 16 * e + 32, D * 4);
        _tile_stored(5, o + 16 * e + 48, D * 4);
    }
}

/* e^x for x <= 0 to a relative error of ~3e-6 (the probabilities keep 16 bits): degree 5 about 0 after the 2^n
 * split, and the power of two by scalef (half the operations of exp16) */
static inline __m512 exp16_prob(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 120);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Four rows' softmax over the segment's n scores (rows s, s + SEG, ..., unscaled), four rows at a time so that
 * their reductions overlap: each row's probabilities as bf16 leading parts into p and remainders into p + 16 SEG
 * (SEG values a row, zeros past n); m[r] = its maximum scaled score, l[r] = the sum of its probabilities. Each row's
 * operations are the same whichever rows it is computed with. */
static inline void softmax_rows4(const float *s, int n, float scale, uint16_t *p, float *m, float *l) {
    __m512 x[4][SEG / 16];
    __mmask16 valid[SEG / 16];
    const __m512 sv = _mm512_set1_ps(scale);
    float top[4];
    for (int j = 0; j < SEG / 16; j++) {
        const int left = n - 16 * j;
        valid[j] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    }
    for (int r = 0; r < 4; r++) {
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < SEG / 16; j++) {
            x[r][j] = _mm512_mul_ps(_mm512_loadu_ps(s + r * SEG + 16 * j), sv);
            mx = _mm512_mask_max_ps(mx, valid[j], mx, x[r][j]);
        }
        top[r] = _mm512_reduce_max_ps(mx);
    }
    for (int r = 0; r < 4; r++) {
        __m512 sum = _mm512_setzero_ps();
        const __m512 t = _mm512_set1_ps(top[r]);
        for (int j = 0; j < SEG / 16; j++) {
            const __m512 e = _mm512_maskz_mov_ps(valid[j], exp16_prob(_mm512_sub_ps(x[r][j], t)));
            const __m256bh hi = _mm512_cvtneps_pbh(e);
            const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_cvtpbh_ps(hi)));
            _mm256_storeu_si256((__m256i *)(p + r * SEG + 16 * j), (__m256i)hi);
            _mm256_storeu_si256((__m256i *)(p + 16 * SEG + r * SEG + 16 * j), (__m256i)lo);
            sum = _mm512_add_ps(sum, e);
        }
        m[r] = top[r];
        l[r] = _mm512_reduce_add_ps(sum);
    }
}

/* A task's buffers: the packed keys and values of one head, 16 query rows, their scores, probabilities, sums */
typedef struct {
    uint16_t kt[SEG * AMX_ATT_MAX_D] __attribute__((aligned(64)));
    uint16_t vp[SEG * AMX_ATT_MAX_D] __attribute__((aligned(64)));
    uint16_t qt[16 * AMX_ATT_MAX_D] __attribute__((aligned(64)));
    uint16_t p[2 * 16 * SEG] __attribute__((aligned(64))); /* probabilities: leading bf16 parts, remainders */
    float sc[16 * SEG] __attribute__((aligned(64)));
    float o[16 * AMX_ATT_MAX_D] __attribute__((aligned(64)));
} task_buffers;

/* The rows [r0, r1) of a group (its entries `members`, G query rows each: entry i's rows i G .. i G + G - 1) against
 * segment sg of kv head h, each row's record written to records (row (b, hq) of the window's segment widx, at
 * records + ((b * W + widx) * H + hq) * (D + 2)) */
static void attend_rows(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const segment *sg,
                        const int *members, int r0, int r1, int h, int H, int KVH, int D, float scale, float *records,
                        int64_t W, int64_t widx, task_buffers *t) {
    const int G = H / KVH, RS = D + 2;
    pack_keys(k_cache, sg, KVH, h, D, t->kt);
    pack_values(v_cache, sg, KVH, h, D, t->vp);
    for (int a = r0; a < r1; a += 16) {
        const int R = r1 - a < 16 ? r1 - a : 16;
        int entry[16], head[16]; /* the tile's rows: entry (of B) and query head */
        for (int r = 0, i = a / G, g = a % G; r < R; r++) {
            entry[r] = members[i];
            head[r] = h * G + g;
            if (++g == G) g = 0, i++;
            const uint16_t *src = q + ((int64_t)entry[r] * H + head[r]) * D;
            for (int d = 0; d < D; d += 32) _mm512_store_si512(t->qt + r * D + d, _mm512_loadu_si512(src + d));
        }
        score_tiles(t->qt, t->kt, D, t->sc);
        float m[16], l[16];
        /* rows past R (stale query rows of an earlier tile, or zeros) are computed and never read */
        for (int r = 0; r < R; r += 4) softmax_rows4(t->sc + r * SEG, sg->n, scale, t->p + r * SEG, m + r, l + r);
        value_tiles(t->p, t->vp, D, t->o);
        for (int r = 0; r < R; r++) {
            float *rec = records + (((int64_t)entry[r] * W + widx) * H + head[r]) * RS;
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(rec + d, _mm512_load_ps(t->o + r * D + d));
            rec[D] = m[r];
            rec[D + 1] = l[r];
        }
    }
}

static inline int64_t segments_of(int64_t ctx) { return (ctx + SEG - 1) / SEG; }

/* tokens of segment s of a context of ctx tokens */
static inline int seg_tokens(int64_t ctx, int64_t s) { return (int)(ctx - s * SEG < SEG ? ctx - s * SEG : SEG); }

/* 1 where amx_decode_attention runs these shapes on this CPU */
int amx_attention_applies(int H, int KVH, int D, int block_size) {
    return D % 64 == 0 && D <= AMX_ATT_MAX_D && block_size >= 1 && SEG % block_size == 0 && H % KVH == 0 &&
           amx_permitted();
}

/* Returns 0 when done, 1 where this path does not apply (the caller takes the vector kernel), -2 when memory ran
 * out. dtype must be bf16. */
int amx_decode_attention(const uint16_t *q, uint16_t *out, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int max_blocks, const int64_t *context_lens, int B, int H,
                         int KVH, int D, int block_size, float scale) {
    if (!amx_attention_applies(H, KVH, D, block_size)) return 1;
    int shift = 0;
    while ((1 << shift) < block_size) shift++;
    const int G = H / KVH, RS = D + 2; /* a record: D partial sums, the maximum, the normaliser */
    int64_t max_seg = 0;
    for (int b = 0; b < B; b++) {
        const int64_t n = segments_of(context_lens[b]);
        max_seg = n > max_seg ? n : max_seg;
    }
    /* W segment indices per window, so that the window's records stay within RECORD_BUDGET */
    const int64_t slab = (int64_t)B * H * RS * (int64_t)sizeof(float);
    int64_t W = RECORD_BUDGET / (slab > 0 ? slab : 1);
    W = W < 1 ? 1 : W > max_seg ? (max_seg > 0 ? max_seg : 1) : W;
    int hash_size = 16;
    while (hash_size < 2 * B) hash_size *= 2;
    /* scratch: the running states, a window's records, then the grouping's integer arrays */
    const int64_t items = (int64_t)B * W;
    const size_t state_bytes = (size_t)B * H * RS * sizeof(float), record_bytes = (size_t)items * H * RS * sizeof(float);
    const size_t int_bytes = sizeof(int) * (size_t)(6 * items + 1 + hash_size);
    char *mem = thread_scratch(0, state_bytes + record_bytes + int_bytes);
    if (!mem) return -2;
    float *state = (float *)mem, *records = (float *)(mem + state_bytes);
    int *group_of = (int *)(mem + state_bytes + record_bytes); /* item (b, s - w0) -> its group */
    /* per group: its segment index, entries, first member in `members`; hash: per segment index, slot -> group */
    int *g_seg = group_of + items, *g_count = g_seg + items, *g_fill = g_count + items, *members = g_fill + items;
    int *g_first = members + items, *hash = g_first + items + 1;
    const int nt = omp_get_max_threads();

    for (int64_t w0 = 0; w0 < max_seg; w0 += W) {
        const int64_t w1 = w0 + W < max_seg ? w0 + W : max_seg;
        /* group the window's segments: same index, same valid length, same blocks */
        int groups = 0;
        for (int64_t s = w0; s < w1; s++) {
            for (int i = 0; i < hash_size; i++) hash[i] = -1;
            for (int b = 0; b < B; b++) {
                const int64_t ctx = context_lens[b];
                int *slot = &group_of[(int64_t)b * W + (s - w0)];
                if (s >= segments_of(ctx)) {
                    *slot = -1;
                    continue;
                }
                const int64_t *table = block_tables + (int64_t)b * max_blocks;
                const int n = seg_tokens(ctx, s);
                const int64_t blk0 = s * SEG / block_size, nblk = (n + block_size - 1) / block_size;
                uint64_t key = (uint64_t)table[blk0] * 0x9E3779B97F4A7C15ull + (uint64_t)n;
                int h = (int)((key ^ key >> 29) & (uint64_t)(hash_size - 1)), g = -1;
                for (; hash[h] >= 0; h = (h + 1) & (hash_size - 1)) {
                    const int c = hash[h], lead = members[c]; /* members[c]: the group's first entry, for now */
                    if (seg_tokens(context_lens[lead], s) != n) continue;
                    const int64_t *lt = block_tables + (int64_t)lead * max_blocks;
                    int same = 1;
                    for (int64_t k = blk0; k < blk0 + nblk && same; k++) same = lt[k] == table[k];
                    if (same) {
                        g = c;
                        break;
                    }
                }
                if (g < 0) {
                    g = groups++;
                    hash[h] = g;
                    members[g] = b;
                    g_seg[g] = (int)s;
                    g_count[g] = 0;
                }
                g_count[g]++;
                *slot = g;
            }
        }
        g_first[0] = 0;
        for (int g = 0; g < groups; g++) {
            g_first[g + 1] = g_first[g] + g_count[g];
            g_fill[g] = 0;
        }
        for (int b = 0; b < B; b++)
            for (int64_t s = w0; s < w1; s++) {
                const int g = group_of[(int64_t)b * W + (s - w0)];
                if (g >= 0) members[g_first[g] + g_fill[g]++] = b;
            }
        /* Tasks: a shared group (more than one entry) per kv head and TASK_ROWS of its rows, first, one at a time
         * (their segment is read from memory once, then from the caches); then the groups of one entry, one or all
         * of their kv heads, `chunk` at a time so that each task asks for the next one's blocks */
        int shared = 0, solo = 0;
        for (int g = 0; g < groups; g++) {
            if (g_count[g] > 1) shared += KVH * ((g_count[g] * G + TASK_ROWS - 1) / TASK_ROWS);
            else solo++;
        }
        int *task_list = thread_scratch(1, sizeof(int) * (size_t)(3 * shared + solo + 1));
        if (!task_list) return -2;
        int *solo_groups = task_list + 3 * shared;
        for (int g = 0, i = 0, j = 0; g < groups; g++) {
            if (g_count[g] == 1) {
                solo_groups[j++] = g;
                continue;
            }
            for (int h = 0; h < KVH; h++)
                for (int r0 = 0; r0 < g_count[g] * G; r0 += TASK_ROWS, i += 3) {
                    task_list[i] = g;
                    task_list[i + 1] = h;
                    task_list[i + 2] = r0;
                }
        }
        const int span = solo >= 4 * nt ? KVH : 1, per_group = KVH / span;
        const int64_t tasks = (int64_t)solo * per_group;
        int64_t chunk = tasks / (4 * nt);
        chunk = chunk < 1 ? 1 : chunk;
#pragma omp parallel
        {
            amx_configure();
            task_buffers t;
            memset(t.qt, 0, sizeof t.qt); /* query rows past a tile's last are computed too: finite values */
            segment sg, next;
#pragma omp for schedule(dynamic, 1) nowait
            for (int i = 0; i < shared; i++) {
                const int g = task_list[3 * i], h = task_list[3 * i + 1], r0 = task_list[3 * i + 2];
                const int *mem_g = members + g_first[g], rows = g_count[g] * G;
                locate(&sg, block_tables + (int64_t)mem_g[0] * max_blocks, shift, (int64_t)g_seg[g] * SEG,
                       seg_tokens(context_lens[mem_g[0]], g_seg[g]));
                request(k_cache, v_cache, &sg, KVH, h, 1, D);
                attend_rows(q, k_cache, v_cache, &sg, mem_g, r0, r0 + TASK_ROWS < rows ? r0 + TASK_ROWS : rows, h, H,
                            KVH, D, scale, records, W, g_seg[g] - w0, &t);
            }
            int64_t previous = -2;
#pragma omp for schedule(dynamic, chunk)
            for (int64_t task = 0; task < tasks; task++) {
                const int g = solo_groups[task / per_group], h0 = (int)(task % per_group) * span;
                const int b = members[g_first[g]];
                locate(&sg, block_tables + (int64_t)b * max_blocks, shift, (int64_t)g_seg[g] * SEG,
                       seg_tokens(context_lens[b], g_seg[g]));
                if (task % chunk < REQUEST_AHEAD || task != previous + 1) request(k_cache, v_cache, &sg, KVH, h0, span, D);
                previous = task;
                /* the blocks of the task REQUEST_AHEAD further on, where this thread runs it */
                const int64_t ahead = task + REQUEST_AHEAD;
                if (ahead < tasks && ahead / chunk == task / chunk) {
                    const int ng = solo_groups[ahead / per_group], nb = members[g_first[ng]];
                    locate(&next, block_tables + (int64_t)nb * max_blocks, shift, (int64_t)g_seg[ng] * SEG,
                           seg_tokens(context_lens[nb], g_seg[ng]));
                    request(k_cache, v_cache, &next, KVH, (int)(ahead % per_group) * span, span, D);
                }
                for (int h = h0; h < h0 + span; h++)
                    attend_rows(q, k_cache, v_cache, &sg, members + g_first[g], 0, G, h, H, KVH, D, scale, records, W,
                                g_seg[g] - w0, &t);
            }
            /* fold the window's records into each row's state, in segment order; the last window writes out */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < (int64_t)B * H; row++) {
                const int b = (int)(row / H), hq = (int)(row % H);
                const int64_t nseg = segments_of(context_lens[b]);
                float *st = state + row * RS;
                for (int64_t sidx = w0; sidx < w1 && sidx < nseg; sidx++) {
                    const float *rec = records + (((int64_t)b * W + (sidx - w0)) * H + hq) * RS;
                    merge_rows(st, 0, st + D, st + D + 1, rec, 0, rec + D, rec + D + 1, 1, D, sidx == 0);
                }
                if (w1 < max_seg) continue;
                uint16_t *dst = out + row * D;
                if (nseg == 0) {
                    memset(dst, 0, (size_t)D * 2);
                    continue;
                }
                const __m512 inv = _mm512_set1_ps(st[D + 1] > 0.f ? 1.f / st[D + 1] : 0.f);
                for (int d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(st + d), inv), 1);
            }
            _tile_release();
        }
    }
    return 0;
}
#endif
