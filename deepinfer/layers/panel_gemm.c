/*
 * Float32 matrix products on AVX2 CPUs from weights packed in panels of 16 output features.
 *
 *   y[m, n] = sum_k x[m, k] * w[n, k]      x: [M, K], y: [M, N] float32 (row-major, y's row stride N)
 *
 * Packed layout (Linear.pack builds it with torch): p[N/16][K][16], p[j][k][i] = w[16 j + i, k].
 * Each panel is multiplied by 6 rows of x at a time with 12 accumulator registers (6 rows x 16
 * features): per k, two loads of the panel, six broadcasts of x and twelve FMAs. That keeps both FMA
 * pipes of a core busy; oneDNN's float32 kernels on an AVX2-only AMD EPYC reached 51-67% of the FMA peak
 * at 64 rows (2 threads) where this reaches ~95% (benchmarks/BENCHMARKS.md, session 19).
 * A row's sums run in k order whatever M is, so its result depends on that row alone.
 * The same AVX2 code is built on every x86 CPU, but panel_gemm_preferred() is 0 where the compiler
 * targets AVX-512: there the engine keeps oneDNN's kernels, which use the wider registers.
 */
#include <omp.h>

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

/* One parallel region: each thread takes a fixed share of the panels (its weights stay in its cache).
 * N must be a multiple of PANEL. */
void panel_gemm_f32(const float *x, int M, int K, const float *packed, float *y, int N) {
    const int panels = N / PANEL;
#pragma omp parallel for schedule(static)
    for (int j = 0; j < panels; j++)
        panel_rows(x, M, K, packed + (int64_t)j * K * PANEL, y + (int64_t)j * PANEL, N,
                   j + 1 < panels ? packed + (int64_t)(j + 1) * K * PANEL : NULL);
}

int panel_gemm_preferred(void) {
#ifdef __AVX512F__
    return 0;
#else
    return 1;
#endif
}
