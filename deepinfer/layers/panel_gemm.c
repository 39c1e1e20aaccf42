/*
 * Matrix products from weights packed in panels of output features: float32 on AVX2 CPUs (16 features
 * per panel), and bfloat16 on CPUs with AVX-512 BF16 (32 features per panel, below: vector tiles, or AMX tiles on
 * CPUs that have them).
 *
 *   y[m, n] = sum_k x[m, k] * w[n, k]      x: [M, K], y: [M, N] float32 (row-major, y's row stride N)
 *
 * Packed layout (Linear.pack builds it with torch): p[N/16][K][16], p[j][k][i] = w[16 j + i, k].
 * Each panel is multiplied by 6 rows of x at a time with 12 accumulator registers (6 rows x 16
 * features): per k, two loads of the panel, six broadcasts of x and twelve FMAs. That keeps both FMA
 * pipes of a core busy; oneDNN's float32 kernels on an AVX2-only AMD EPYC reached 51-67% of the FMA peak
 * at 64 rows (2 threads) where this reaches ~95% (benchmarks/BENCHMARKS.md, session 19).
 * A row's sums run in k order whatever M is, so its result depends on that row alone.
 * On AVX-512 builds two adjacent panels go through 12-row tiles of 512-bit registers instead (pair_tile),
 * with the same order of operations per feature.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"

#define PANEL 16
#define TILE_ROWS 6

static inline __attribute__((always_inline)) void panel_tile(const float *x, const int rows, int K,
                                                            const float *panel, float *y, int N,
                                                            const float *prefetch) {
    __m256 c[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        if (prefetch) _mm_prefetch((const char *)(prefetch + (int64_t)k * PANEL), _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(panel + (int64_t)k * PANEL), b1 = _mm256_loadu_ps(panel + (int64_t)k * PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < TILE_ROWS; r++)
            if (r < rows) {
                const __m256 a = _mm256_broadcast_ss(x + (int64_t)r * K + k);
                c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
            }
    }
    for (int r = 0; r < TILE_ROWS; r++)
        if (r < rows) {
            _mm256_storeu_ps(y + (int64_t)r * N, c[r][0]);
            _mm256_storeu_ps(y + (int64_t)r * N + 8, c[r][1]);
        }
}

/* all M rows against one panel; the tail tile's row count is a constant in each call (unrolled). The
 * first tile also prefetches `next` (the panel this thread takes next, or NULL), one 64-byte line per k:
 * the weights come from memory once per step, and at 16 rows this was ~10% faster. */
static void panel_rows(const float *x, int M, int K, const float *panel, float *y, int N, const float *next) {
    int m = 0;
    for (; m + TILE_ROWS <= M; m += TILE_ROWS, next = NULL)
        panel_tile(x + (int64_t)m * K, TILE_ROWS, K, panel, y + (int64_t)m * N, N, next);
    const float *xt = x + (int64_t)m * K;
    float *yt = y + (int64_t)m * N;
    switch (M - m) {
        case 1: panel_tile(xt, 1, K, panel, yt, N, next); break;
        case 2: panel_tile(xt, 2, K, panel, yt, N, next); break;
        case 3: panel_tile(xt, 3, K, panel, yt, N, next); break;
        case 4: panel_tile(xt, 4, K, panel, yt, N, next); break;
        case 5: panel_tile(xt, 5, K, panel, yt, N, next); break;
        default: break;
    }
}

#ifdef __AVX512F__
/* AVX-512: two adjacent panels (32 features) against up to 12 rows of x at a time, 24 accumulators of 16
 * lanes: per k, two loads, twelve broadcasts and 24 FMAs. Each feature's lane adds its products in k order
 * with one fused multiply-add each, as the AVX2 tile does, so both builds give a row the same bits. `two`
 * (a constant at each call): 0 for an odd last panel. The first tile also asks for the next pair's panels
 * (prefetch0/1) into L2, a line each per k: oneDNN's packed float32 kernels read their weights from
 * memory at ~60% of their in-cache rate in a 64-row decode step (2-core Zen 5), and a pair's panels
 * (~74 KB at K = 576) overflow L1.
 * x is read either as it is (row r at x + r * K) or packed per tile as [k][12] (`packed`, a constant at
 * each call): then the broadcasts come from one pointer at fixed offsets, where the twelve row pointers
 * of plain x overflow the general registers and are reloaded from the stack every k (~4% of a 12-row
 * tile in cache on the 2-core Zen 4). */
#define TILE_ROWS16 12

static inline __attribute__((always_inline)) void pair_tile(const float *x, const int packed, const int rows, int K,
                                                           const float *p0, const float *p1, const int two,
                                                           const int gated, float *y, int N, const float *prefetch0,
                                                           const float *prefetch1) {
    const int64_t rs = packed ? 1 : K, ks = packed ? TILE_ROWS16 : 1;
    __m512 c[TILE_ROWS16][2];
#pragma GCC unroll 12
    for (int r = 0; r < TILE_ROWS16; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        if (prefetch0) _mm_prefetch((const char *)(prefetch0 + (int64_t)k * PANEL), _MM_HINT_T1);
        if (prefetch1) _mm_prefetch((const char *)(prefetch1 + (int64_t)k * PANEL), _MM_HINT_T1);
        const __m512 b0 = _mm512_loadu_ps(p0 + (int64_t)k * PANEL);
        const __m512 b1 = two ? _mm512_loadu_ps(p1 + (int64_t)k * PANEL) : _mm512_setzero_ps();
        const float *xk = x + k * ks;
#pragma GCC unroll 12
        for (int r = 0; r < TILE_ROWS16; r++)
            if (r < rows) {
                const __m512 a = _mm512_set1_ps(xk[r * rs]);
                c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
                if (two) c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
            }
    }
#pragma GCC unroll 12
    for (int r = 0; r < TILE_ROWS16; r++)
        if (r < rows) {
#if SILU_WIDE
            if (gated) {  /* p0 a gate panel, p1 its up panel: y = silu(gate) * up, as silu_mul computes it */
                _mm512_storeu_ps(y + (int64_t)r * N, _mm512_mul_ps(silu16(c[r][0]), c[r][1]));
                continue;
            }
#endif
            _mm512_storeu_ps(y + (int64_t)r * N, c[r][0]);
            if (two) _mm512_storeu_ps(y + (int64_t)r * N + PANEL, c[r][1]);
        }
}

/* M rows in ceil(M / 12) tiles as even as can be: tile t holds rows [*r0, *r0 + *rows). At 64 rows
 * 11, 11, 11, 11, 10, 10, where 12-row tiles left a 4-row tail at a fraction of the FMA rate. */
static inline void tile_span(int M, int t, int *r0, int *rows) {
    const int tiles = (M + TILE_ROWS16 - 1) / TILE_ROWS16, base = M / tiles, extra = M % tiles;
    *r0 = t * base + (t < extra ? t : extra);
    *rows = base + (t < extra);
}

/* all M rows against panels p0 (and p1 when two), tile by tile; x packed (pack_tiles) or as it is */
static inline __attribute__((always_inline)) void pair_rows(const float *x, const int packed, int M, int K,
                                                           const float *p0, const float *p1, const int two,
                                                           const int gated, float *y, int N, const float *next0,
                                                           const float *next1) {
    const int tiles = (M + TILE_ROWS16 - 1) / TILE_ROWS16;
    for (int t = 0; t < tiles; t++, next0 = next1 = NULL) {
        int r0, rows;
        tile_span(M, t, &r0, &rows);
        const float *xt = packed ? x + (int64_t)t * TILE_ROWS16 * K : x + (int64_t)r0 * K;
        float *yt = y + (int64_t)r0 * N;
        switch (rows) {
#define PAIR_TILE(R) case R: pair_tile(xt, packed, R, K, p0, p1, two, gated, yt, N, next0, next1); break;
            PAIR_TILE(1) PAIR_TILE(2) PAIR_TILE(3) PAIR_TILE(4) PAIR_TILE(5) PAIR_TILE(6)
            PAIR_TILE(7) PAIR_TILE(8) PAIR_TILE(9) PAIR_TILE(10) PAIR_TILE(11) PAIR_TILE(12)
#undef PAIR_TILE
            default: break;
        }
    }
}

/* pair_rows from this thread's packed copy of x (xp, thread_packed_x) where it has one, else from x as it is */
static inline __attribute__((always_inline)) void pair_rows_from(const float *x, const float *xp, int M, int K,
                                                                const float *p0, const float *p1, const int two,
                                                                const int gated, float *y, int N, const float *next0,
                                                                const float *next1) {
    if (xp) pair_rows(xp, 1, M, K, p0, p1, two, gated, y, N, next0, next1);
    else pair_rows(x, 0, M, K, p0, p1, two, gated, y, N, next0, next1);
}

/* x [M, K] into xp, tile t at xp + t * 12 * K as [k][12] (a shorter tile's unused lanes unwritten) */
static void pack_tiles(const float *x, int M, int K, float *xp) {
    const int tiles = (M + TILE_ROWS16 - 1) / TILE_ROWS16;
    for (int t = 0; t < tiles; t++) {
        int r0, rows;
        tile_span(M, t, &r0, &rows);
        float *o = xp + (int64_t)t * TILE_ROWS16 * K;
        for (int k = 0; k < K; k++)
            for (int r = 0; r < rows; r++) o[(int64_t)k * TILE_ROWS16 + r] = x[(int64_t)(r0 + r) * K + k];
    }
}

/* Each thread packs x for itself (a copy shared between the threads cost more in cross-core reads than
 * it saved), and only where the product is wide enough to repay the copy: ~0.3-0.5 ns per element of x
 * against N / 2 multiply-adds per element on each thread (576 features: 3% slower packed, 3072 and the
 * LM head's 49152: 3-4% faster), and x is at most PACK_MAX_FLOATS (8 MB: a 64-row step's x is 0.15 MB
 * at K = 576, a 2,048-token prefill chunk's 4.7 MB). The buffer is per thread, grown as needed and kept:
 * the pool's threads persist. */
#define PACK_MIN_N 2048
#define PACK_MAX_FLOATS ((size_t)1 << 21)
static __thread float *packed_x;
static __thread size_t packed_x_floats;

static float *thread_pack_buffer(size_t floats) {
    if (floats > packed_x_floats) {
        free(packed_x);
        packed_x = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        packed_x_floats = packed_x ? floats : 0;
    }
    return packed_x;
}

/* the calling thread's packed copy of x for a product of N features, or NULL: read x as it is */
static float *thread_packed_x(const float *x, int M, int K, int N) {
    const size_t floats = (size_t)(M + TILE_ROWS16 - 1) / TILE_ROWS16 * TILE_ROWS16 * K;
    float *xp = N >= PACK_MIN_N && floats <= PACK_MAX_FLOATS ? thread_pack_buffer(floats) : NULL;
    if (xp) pack_tiles(x, M, K, xp);
    return xp;
}
#endif

/* One parallel region: each thread takes a fixed share of the panels (its weights stay in its cache); on
 * AVX-512 builds, pairs of panels. N must be a multiple of PANEL. */
void panel_gemm_f32(const float *x, int M, int K, const float *packed, float *y, int N) {
    const int panels = N / PANEL;
#ifdef __AVX512F__
    const int pairs = (panels + 1) / 2;
#pragma omp parallel
    {
        const float *xp = thread_packed_x(x, M, K, N);
#pragma omp for schedule(static) nowait
        for (int j = 0; j < pairs; j++) {
            const float *p0 = packed + (int64_t)2 * j * K * PANEL, *p1 = p0 + (int64_t)K * PANEL;
            const float *n0 = j + 1 < pairs ? p0 + (int64_t)2 * K * PANEL : NULL;
            const float *n1 = 2 * j + 3 < panels ? p0 + (int64_t)3 * K * PANEL : NULL;
            float *yj = y + (int64_t)2 * j * PANEL;
            if (2 * j + 1 < panels) pair_rows_from(x, xp, M, K, p0, p1, 1, 0, yj, N, n0, n1);
            else pair_rows_from(x, xp, M, K, p0, NULL, 0, 0, yj, N, n0, n1);
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int j = 0; j < panels; j++)
        panel_rows(x, M, K, packed + (int64_t)j * K * PANEL, y + (int64_t)j * PANEL, N,
                   j + 1 < panels ? packed + (int64_t)(j + 1) * K * PANEL : NULL);
#endif
}

/* out [M, I] = silu(x g^T) * (x u^T) for a gate/up weight [2I, K] packed as panel_gemm_f32's (gate features
 * 0..I-1, up I..2I-1; I a multiple of 16): each tile takes gate panel j and up panel j as its pair and
 * applies silu_mul's operations to the sums in its registers, so out has the bits of panel_gemm_f32 then
 * silu_mul, without writing the [M, 2I] product and reading it back (at 64 rows and I = 1536, 0.8 MB a layer
 * each way, and silu_mul's own parallel region). Returns 0 where the build has no such tile (nothing
 * computed): the caller then runs the two steps. */
int panel_gemm_f32_silu(const float *x, int M, int K, const float *packed, float *out, int I) {
#if defined(__AVX512F__) && SILU_WIDE
    const int half = I / PANEL;
#pragma omp parallel
    {
        const float *xp = thread_packed_x(x, M, K, 2 * I);
#pragma omp for schedule(static) nowait
        for (int j = 0; j < half; j++) {
            const float *p0 = packed + (int64_t)j * K * PANEL, *p1 = p0 + (int64_t)half * K * PANEL;
            const float *n0 = j + 1 < half ? p0 + (int64_t)K * PANEL : NULL, *n1 = n0 ? p1 + (int64_t)K * PANEL : NULL;
            pair_rows_from(x, xp, M, K, p0, p1, 1, 1, out + (int64_t)j * PANEL, I, n0, n1);
        }
    }
    return 1;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)out, (void)I;
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* bfloat16 activations and weights on CPUs with AVX-512 BF16, float32 sums, y rounded to bf16 once.
 * Packed layout (linear.py's pack_panels of a bf16 weight): p[N/32][K/2][32][2],
 * p[j][kp][i][e] = w[32 j + i, 2 kp + e]: per pair of k, one panel is two 64-byte loads, each 16
 * features' (k, k+1) weight pairs, which vdpbf16ps multiplies by a broadcast (k, k+1) pair of one row of
 * x and adds into 16 float32 sums. 12 rows x 32
 * features = 24 accumulators per tile. The threads split the panels statically, so one product has no
 * synchronisation inside it: oneDNN's packed bf16 kernels at 64 rows ran only ~1.3x faster on 2 threads
 * than on 1 (576x3072 on a 2-core Zen 5), where large products scale ~1.9x. */
#define BF_PANEL 32
#define BF_TILE_ROWS 12

/* row r's (k, k + 1) pair of x at pair index kp, in every 32-bit lane */
static inline __m512bh x_pair_bf16(const uint16_t *x, int64_t r, int K, int kp) {
    int32_t pair;
    memcpy(&pair, x + r * K + 2 * kp, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, const int rows, int K,
                                                           const uint16_t *panel, const float *bias, uint16_t *y,
                                                           int N, const uint16_t *prefetch) {
    __m512 c[BF_TILE_ROWS][2];
#pragma GCC unroll 12
    for (int r = 0; r < BF_TILE_ROWS; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int kp = 0; kp < K / 2; kp++) {
        const uint16_t *pk = panel + (int64_t)kp * 2 * BF_PANEL;
        if (prefetch) {
            _mm_prefetch((const char *)(prefetch + (int64_t)kp * 2 * BF_PANEL), _MM_HINT_T0);
            _mm_prefetch((const char *)(prefetch + (int64_t)kp * 2 * BF_PANEL + 32), _MM_HINT_T0);
        }
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pk), b1 = (__m512bh)_mm512_loadu_si512(pk + 32);
#pragma GCC unroll 12
        for (int r = 0; r < BF_TILE_ROWS; r++)
            if (r < rows) {
                const __m512bh a = x_pair_bf16(x, r, K, kp);
                c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
                c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
            }
    }
    const __m512 bias0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < BF_TILE_ROWS; r++)
        if (r < rows) {
            store16(y + (int64_t)r * N, _mm512_add_ps(c[r][0], bias0), 1);
            store16(y + (int64_t)r * N + 16, _mm512_add_ps(c[r][1], bias1), 1);
        }
}

/* all M rows against one panel, as panel_rows */
static void bf16_panel_rows(const uint16_t *x, int M, int K, const uint16_t *panel, const float *bias, uint16_t *y,
                            int N, const uint16_t *next) {
    int m = 0;
    for (; m + BF_TILE_ROWS <= M; m += BF_TILE_ROWS, next = NULL)
        bf16_tile(x + (int64_t)m * K, BF_TILE_ROWS, K, panel, bias, y + (int64_t)m * N, N, next);
    const uint16_t *xt = x + (int64_t)m * K;
    uint16_t *yt = y + (int64_t)m * N;
    switch (M - m) {
#define BF_TAIL(R) case R: bf16_tile(xt, R, K, panel, bias, yt, N, next); break;
        BF_TAIL(1) BF_TAIL(2) BF_TAIL(3) BF_TAIL(4) BF_TAIL(5) BF_TAIL(6)
        BF_TAIL(7) BF_TAIL(8) BF_TAIL(9) BF_TAIL(10) BF_TAIL(11)
#undef BF_TAIL
        default: break;
    }
}
#endif

#if HAVE_AMX
/* The same products on AMX tiles (Sapphire Rapids and later). Each output is one float32 sum over k in order, as
 * in bf16_tile, but TDPBF16PS rounds inside a k pair otherwise than VDPBF16PS: a few outputs in a thousand differ by
 * one bf16 unit from the vector tiles' (a CPU runs one kernel or the other, never both). Where oneDNN's tile
 * kernels choose their blocking by the row count (a row's result then depends on the batch: two steps that split
 * the same prompts differently gave different greedy tokens on a 2-core Xeon), a row's sums here never depend on
 * M. A bf16 panel (pack_panels) is [K/2][32][2]: its k pairs 16 at a time, one half of the panel's
 * features, are a B tile of 16 rows x 64 bytes at a row stride of 128 bytes, so the panels serve both kernels.
 * Blocking: 32 rows x 32 features (2 A tiles, 2 B tiles, 4 accumulator tiles), k 32 at a time. */
#define AMX_K 32 /* bf16 values of x per A tile row: K must be a multiple */
#ifndef AMX_CHUNK
#define AMX_CHUNK 16 /* 16-row blocks of x per pass over a thread's panels */
#endif
/* bf16 values ahead of the tile loads that the first pass over a panel asks for (8 KB: four k steps; tile loads
 * alone read the weights at ~10 GB/s on a 2-core Xeon, with these requests at ~13-17, benchmarks/BENCHMARKS.md) */
#define AMX_AHEAD 4096

/* The sums of A tiles a0 (and a1 when groups is 2: rows K apart, k 32 at a time) against B tiles b0 and b1 (k pairs
 * at a row stride of 128 bytes, BF_PANEL k's further per step) into c[2 q + i] (row group q, B tile i). pre0 / pre1
 * (or NULL): the weight streams to ask for AMX_AHEAD further on, on a first pass over weights from memory. */
static inline __attribute__((always_inline)) void amx_sums(const uint16_t *a0, const uint16_t *a1, int groups, int K,
                                                          const uint16_t *b0, const uint16_t *b1, const uint16_t *pre0,
                                                          const uint16_t *pre1, float c[4][16][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += AMX_K) {
        const int64_t o = (int64_t)k * BF_PANEL;
        for (int l = 0; pre0 && l < AMX_K * BF_PANEL; l += 32) {
            _mm_prefetch((const char *)(pre0 + o + AMX_AHEAD + l), _MM_HINT_T2);
            if (pre1) _mm_prefetch((const char *)(pre1 + o + AMX_AHEAD + l), _MM_HINT_T2);
        }
        _tile_loadd(4, b0 + o, 128);
        _tile_loadd(5, b1 + o, 128);
        _tile_loadd(6, a0 + k, 2 * K);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        if (groups > 1) {
            _tile_loadd(7, a1 + k, 2 * K);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (groups > 1) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
}

/* The last M % 16 rows of x zero-padded to a tile's 16 (freed by the caller), NULL where M is a multiple of 16;
 * *ok = 0 where memory ran out */
static uint16_t *amx_pad(const uint16_t *x, int M, int K, int *ok) {
    const int full = M / 16 * 16;
    *ok = 1;
    if (M == full) return NULL;
    uint16_t *pad = calloc((size_t)16 * K, sizeof *pad);
    if (!pad) *ok = 0;
    else memcpy(pad, x + (int64_t)full * K, (size_t)(M - full) * K * sizeof *pad);
    return pad;
}

/* rows [r0, r0 + 16 * groups) of x (groups 1 or 2; rows past M read from `pad`) */
static inline const uint16_t *amx_rows(const uint16_t *x, const uint16_t *pad, int M, int K, int r0) {
    return r0 + 16 <= M ? x + (int64_t)r0 * K : pad;
}

static int amx_gemm_bf16(const uint16_t *x, int M, int K, const uint16_t *packed, const float *bias, uint16_t *y,
                         int N) {
    int ok;
    if (K % AMX_K || !amx_permitted()) return 0;
    uint16_t *pad = amx_pad(x, M, K, &ok);
    if (!ok) return 0;
    const int panels = N / BF_PANEL, blocks = (M + 15) / 16;
#pragma omp parallel
    {
        amx_configure();
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int j0 = (int)((int64_t)panels * t / nt), j1 = (int)((int64_t)panels * (t + 1) / nt);
        float c[4][16][16];
        /* rows AMX_CHUNK blocks at a time across the thread's panels: the chunk of x stays in the core's L2 */
        for (int c0 = 0; c0 < blocks; c0 += AMX_CHUNK)
            for (int j = j0; j < j1; j++) {
                const uint16_t *p = packed + (int64_t)j * K * BF_PANEL;
                const float *bj = bias ? bias + j * BF_PANEL : NULL;
                const __m512 bias0 = bj ? _mm512_loadu_ps(bj) : _mm512_setzero_ps();
                const __m512 bias1 = bj ? _mm512_loadu_ps(bj + 16) : _mm512_setzero_ps();
                const int c1 = c0 + AMX_CHUNK < blocks ? c0 + AMX_CHUNK : blocks;
                for (int g = c0; g < c1; g += 2) {
                    const int r0 = 16 * g, groups = c1 - g > 1 ? 2 : 1;
                    amx_sums(amx_rows(x, pad, M, K, r0), amx_rows(x, pad, M, K, r0 + 16), groups, K, p, p + 32,
                             g == c0 ? p : NULL, NULL, c);
                    for (int q = 0; q < groups; q++)
                        for (int r = 0; r < 16 && r0 + 16 * q + r < M; r++) {
                            uint16_t *yr = y + (int64_t)(r0 + 16 * q + r) * N + j * BF_PANEL;
                            store16(yr, _mm512_add_ps(_mm512_loadu_ps(c[2 * q][r]), bias0), 1);
                            store16(yr + 16, _mm512_add_ps(_mm512_loadu_ps(c[2 * q + 1][r]), bias1), 1);
                        }
                }
            }
        _tile_release();
    }
    free(pad);
    return 1;
}

/* out = silu(gate) * up for the gate/up panels of a fused projection (gate panels 0 .. I/32 - 1, then up), with
 * the bits of amx_gemm_bf16 followed by silu_mul: each 32-row block takes a gate panel and its up panel half by
 * half (4 accumulators: two row groups x gate, up), the sums rounded to bf16 as the products' outputs are, then
 * silu_mul's operations */
static int amx_gemm_bf16_silu(const uint16_t *x, int M, int K, const uint16_t *packed, uint16_t *out, int I) {
    int ok;
    if (K % AMX_K || !amx_permitted()) return 0;
    uint16_t *pad = amx_pad(x, M, K, &ok);
    if (!ok) return 0;
    const int half = I / BF_PANEL, blocks = (M + 15) / 16;
#pragma omp parallel
    {
        amx_configure();
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int j0 = (int)((int64_t)half * t / nt), j1 = (int)((int64_t)half * (t + 1) / nt);
        float c[4][16][16];
        const __m512 zero = _mm512_setzero_ps();
        for (int c0 = 0; c0 < blocks; c0 += AMX_CHUNK)
            for (int j = j0; j < j1; j++) {
                const uint16_t *gp = packed + (int64_t)j * K * BF_PANEL, *up = gp + (int64_t)half * K * BF_PANEL;
                const int c1 = c0 + AMX_CHUNK < blocks ? c0 + AMX_CHUNK : blocks;
                for (int g = c0; g < c1; g += 2) {
                    const int r0 = 16 * g, groups = c1 - g > 1 ? 2 : 1;
                    for (int h = 0; h < 2; h++) { /* features 16 h .. 16 h + 15 of the gate and up panels */
                        const int first = g == c0 && h == 0;
                        amx_sums(amx_rows(x, pad, M, K, r0), amx_rows(x, pad, M, K, r0 + 16), groups, K, gp + 32 * h,
                                 up + 32 * h, first ? gp : NULL, first ? up : NULL, c);
                        for (int q = 0; q < groups; q++)
                            for (int r = 0; r < 16 && r0 + 16 * q + r < M; r++) {
                                const __m512 gv = round16(_mm512_add_ps(_mm512_loadu_ps(c[2 * q][r]), zero), 1);
                                const __m512 uv = round16(_mm512_add_ps(_mm512_loadu_ps(c[2 * q + 1][r]), zero), 1);
                                store16(out + (int64_t)(r0 + 16 * q + r) * I + j * BF_PANEL + 16 * h,
                                        _mm512_mul_ps(round16(silu16(gv), 1), uv), 1);
                            }
                    }
                }
            }
        _tile_release();
    }
    free(pad);
    return 1;
}
#endif

int panel_gemm_bf16_vector(const void *x, int M, int K, const void *packed, const float *bias, void *y, int N,
                           int prefetch);

/* y = x w^T (+ bias, float32, or NULL) in bfloat16 from the bf16 panels of pack_panels; N a multiple of 32,
 * K even. `prefetch`: each thread asks for its next panel while its first tile computes (1), or leaves the
 * weights to the hardware prefetcher (0: what the engine passes). A panel is one sequential run of 36-98 KB
 * (SmolLM2-135M), which the hardware prefetcher follows; on a 2-core Zen 4 the requests made a 64-row chat
 * step's layer products ~2% slower and its LM head ~3% (benchmarks/BENCHMARKS.md, session 37). The same bits
 * either way. With AMX (and K a multiple of 32) AMX tiles compute it (amx_gemm_bf16, whose bits are not quite the
 * vector tiles'; `prefetch` is then unused). Returns 0 where the CPU has no AVX-512 BF16 (nothing computed). */
int panel_gemm_bf16(const void *x, int M, int K, const void *packed, const float *bias, void *y, int N,
                    int prefetch) {
#if HAVE_AMX
    if (amx_gemm_bf16((const uint16_t *)x, M, K, (const uint16_t *)packed, bias, (uint16_t *)y, N)) return 1;
#endif
    return panel_gemm_bf16_vector(x, M, K, packed, bias, y, N, prefetch);
}

/* panel_gemm_bf16 on AVX-512 BF16 vector registers, with AMX too (benchmarks/panel_gemm.py compares them) */
int panel_gemm_bf16_vector(const void *x, int M, int K, const void *packed, const float *bias, void *y, int N,
                           int prefetch) {
#ifdef __AVX512BF16__
    const int panels = N / BF_PANEL;
    const uint16_t *xb = (const uint16_t *)x, *pb = (const uint16_t *)packed;
    uint16_t *yb = (uint16_t *)y;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < panels; j++)
        bf16_panel_rows(xb, M, K, pb + (int64_t)j * K * BF_PANEL, bias ? bias + j * BF_PANEL : NULL,
                        yb + (int64_t)j * BF_PANEL, N,
                        prefetch && j + 1 < panels ? pb + (int64_t)(j + 1) * K * BF_PANEL : NULL);
    return 1;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)bias, (void)y, (void)N, (void)prefetch;
    return 0;
#endif
}

#if defined(__AVX512BF16__) && SILU_WIDE
/* rows (<= 6) of x against gate panel gp and up panel up (32 features each): 4 accumulators a row. Each
 * feature's lane sums its products in the same order as bf16_tile's, then takes panel_gemm_bf16's rounding
 * (+ a zero bias, then bf16) and silu_mul's operations, into y = silu(gate) * up rounded to bf16. */
#define BF_GATED_ROWS 6
static inline __attribute__((always_inline)) void bf16_gated_tile(const uint16_t *x, const int rows, int K,
                                                                 const uint16_t *gp, const uint16_t *up, uint16_t *y,
                                                                 int N) {
    __m512 c[BF_GATED_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < BF_GATED_ROWS; r++) c[r][0] = c[r][1] = c[r][2] = c[r][3] = _mm512_setzero_ps();
    for (int kp = 0; kp < K / 2; kp++) {
        const uint16_t *gk = gp + (int64_t)kp * 2 * BF_PANEL, *uk = up + (int64_t)kp * 2 * BF_PANEL;
        const __m512bh g0 = (__m512bh)_mm512_loadu_si512(gk), g1 = (__m512bh)_mm512_loadu_si512(gk + 32);
        const __m512bh u0 = (__m512bh)_mm512_loadu_si512(uk), u1 = (__m512bh)_mm512_loadu_si512(uk + 32);
#pragma GCC unroll 6
        for (int r = 0; r < BF_GATED_ROWS; r++)
            if (r < rows) {
                const __m512bh a = x_pair_bf16(x, r, K, kp);
                c[r][0] = _mm512_dpbf16_ps(c[r][0], a, g0);
                c[r][1] = _mm512_dpbf16_ps(c[r][1], a, g1);
                c[r][2] = _mm512_dpbf16_ps(c[r][2], a, u0);
                c[r][3] = _mm512_dpbf16_ps(c[r][3], a, u1);
            }
    }
    const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < BF_GATED_ROWS; r++)
        if (r < rows)
            for (int h = 0; h < 2; h++) {
                const __m512 g = round16(_mm512_add_ps(c[r][h], zero), 1), u = round16(_mm512_add_ps(c[r][2 + h], zero), 1);
                store16(y + (int64_t)r * N + 16 * h, _mm512_mul_ps(round16(silu16(g), 1), u), 1);
            }
}
#endif

/* panel_gemm_f32_silu for bf16 panels (I a multiple of 32), with the bits of panel_gemm_bf16 (no bias) then
 * silu_mul. Returns 0 where the CPU has no AVX-512 BF16 (nothing computed). */
int panel_gemm_bf16_silu(const void *x, int M, int K, const void *packed, void *out, int I) {
#if HAVE_AMX && SILU_WIDE
    if (amx_gemm_bf16_silu((const uint16_t *)x, M, K, (const uint16_t *)packed, (uint16_t *)out, I)) return 1;
#endif
#if defined(__AVX512BF16__) && SILU_WIDE
    const int half = I / BF_PANEL;
    const uint16_t *xb = (const uint16_t *)x, *pb = (const uint16_t *)packed;
    uint16_t *ob = (uint16_t *)out;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < half; j++) {
        const uint16_t *gp = pb + (int64_t)j * K * BF_PANEL, *up = gp + (int64_t)half * K * BF_PANEL;
        uint16_t *oj = ob + (int64_t)j * BF_PANEL;
        int m = 0;
        for (; m + BF_GATED_ROWS <= M; m += BF_GATED_ROWS)
            bf16_gated_tile(xb + (int64_t)m * K, BF_GATED_ROWS, K, gp, up, oj + (int64_t)m * I, I);
        const uint16_t *xt = xb + (int64_t)m * K;
        uint16_t *yt = oj + (int64_t)m * I;
        switch (M - m) {
#define BF_GATED_TAIL(R) case R: bf16_gated_tile(xt, R, K, gp, up, yt, I); break;
            BF_GATED_TAIL(1) BF_GATED_TAIL(2) BF_GATED_TAIL(3) BF_GATED_TAIL(4) BF_GATED_TAIL(5)
#undef BF_GATED_TAIL
            default: break;
        }
    }
    return 1;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)out, (void)I;
    return 0;
#endif
}

/* 1 where panel_gemm_bf16 runs on AMX tiles (for the tests; K a multiple of 32) */
int amx_tiles_granted(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* 1 where panel_gemm_bf16 computes (AVX-512 BF16) */
int panel_gemm_bf16_supported(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* 1 where the engine should use it: AVX-512 BF16, and with AMX where Linux lets the process use the tiles */
int panel_gemm_bf16_preferred(void) {
#if HAVE_AMX
    return amx_permitted();
#elif defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* 1: the engine multiplies float32 batches here rather than with oneDNN (every build: AVX2, and AVX-512 with
 * its pair tiles, which read weights from memory faster than oneDNN's packed kernels) */
int panel_gemm_preferred(void) { return 1; }
