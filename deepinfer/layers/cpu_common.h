/* Helpers shared by the CPU kernels: float32 / bfloat16 loads and stores (bf16 is the top half
 * of a float32; stores round to nearest even, as torch does), horizontal sums, a vector exp. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Growable scratch buffers of the calling thread, kept between calls (a decode step calls a kernel once per layer;
 * allocating and freeing ~100 KB a call had glibc trim the heap's top and fault it back in, with TLB shootdowns);
 * which: 0 or 1, each source file its own pair. NULL if out of memory. */
static __attribute__((unused)) void *thread_scratch(int which, size_t bytes) {
    static __thread void *buf[2];
    static __thread size_t cap[2];
    if (bytes > cap[which]) {
        free(buf[which]);
        cap[which] = bytes + bytes / 4;
        buf[which] = aligned_alloc(64, (cap[which] + 63) / 64 * 64);
        if (!buf[which]) cap[which] = 0;
    }
    return buf[which];
}

/* AMX tiles (Sapphire Rapids and later): the bf16 panel products of panel_gemm.c and the bf16 decode attention of
 * paged_attention_amx.c */
#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Linux hands a process the tiles' 8 KB of state only on request (once; later requests are no-ops) */
static inline int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* every tile 16 rows x 64 bytes; per thread (the configuration is thread state) */
static inline void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
#endif

/* element i as float32; bf16 != 0 means the memory holds bfloat16 */
static inline float load1(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* element i = v, rounded to bfloat16 (nearest even) when bf16 != 0 */
static inline void store1(void *p, int64_t i, float v, int bf16) {
    if (!bf16) { ((float *)p)[i] = v; return; }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

/* 8 consecutive elements as float32; bf16 != 0 means the memory holds bfloat16 */
static inline __m256 load8(const void *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* float32 lanes rounded to the nearest bfloat16 (kept as float32 bit patterns) */
static inline __m256i round8_bits(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}

static inline __m256 round8(__m256 v, int bf16) {
    if (!bf16) return v;
    return _mm256_castsi256_ps(_mm256_and_si256(round8_bits(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void store8(void *p, __m256 v, int bf16) {
    if (!bf16) { _mm256_storeu_ps((float *)p, v); return; }
    __m256i hi = _mm256_srli_epi32(round8_bits(v), 16);             /* 8 x uint32 holding uint16 */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* e^x for 8 lanes: 2^n * p(r), r in [-ln2/2, ln2/2]; relative error ~2e-7; clamps to [-87, 88] */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    /* n can reach 128 at x = 88: build 2^n as two factors so the exponent field never overflows */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 e2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, e1), e2);
}

#ifdef __AVX512F__
/* 16-lane twins of load8 / round8 / store8 / exp8: every lane runs the same operations as the 8-lane
 * versions, so the values are the same; half the instructions per value. */
static inline __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512i round16_bits(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}

static inline __m512 round16(__m512 v, int bf16) {
    if (!bf16) return v;
    return _mm512_castsi512_ps(_mm512_and_si512(round16_bits(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 16 lanes stored as float32, or rounded to bfloat16 (nearest even) when bf16 != 0 */
static inline void store16(void *p, __m512 v, int bf16) {
    if (!bf16) { _mm512_storeu_ps((float *)p, v); return; }
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round16_bits(v), 16)));
}

static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i half = _mm512_srai_epi32(ni, 1);
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(127)), 23));
    const __m512 e2 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), _mm512_set1_epi32(127)), 23));
    return _mm512_mul_ps(_mm512_mul_ps(p, e1), e2);
}
#endif

/* silu over 16 lanes where the CPU has the AVX-512 parts it needs (silu_mul's wide loop, and the gate/up
 * products of panel_gemm.c that apply it in their tiles: both through silu16, so both give the same bits) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SILU_WIDE 1
/* g / (1 + e^-g), in float32 */
static inline __m512 silu16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_xor_ps(g, _mm512_set1_ps(-0.f)))));
}
#else
#define SILU_WIDE 0
#endif

/* R rows' online-softmax state (acc rows of stride as, running max m, sum l) merged into the state (macc,
 * stride ms; mm, ml); first: copied. One function, not inlined, for every merge of paged_attention.c (in order on
 * one thread, and of split segments) and paged_attention_amx.c's folds, so that each gives the same bits. */
static __attribute__((noinline, unused)) void merge_rows(float *macc, int ms, float *mm, float *ml, const float *acc,
                                                         int as, const float *m, const float *l, int R, int D, int first) {
    for (int r = 0; r < R; r++) {
        float *a = macc + (int64_t)r * ms;
        const float *b = acc + (int64_t)r * as;
        if (first) {
            memcpy(a, b, (size_t)D * sizeof(float));
            mm[r] = m[r];
            ml[r] = l[r];
            continue;
        }
        const float mx = mm[r] > m[r] ? mm[r] : m[r];
        const float ca = expf(mm[r] - mx), cb = expf(m[r] - mx);
        ml[r] = fmaf(ml[r], ca, l[r] * cb);
        mm[r] = mx;
        const __m256 va = _mm256_set1_ps(ca), vb = _mm256_set1_ps(cb);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(_mm256_loadu_ps(a + d), va,
                                                    _mm256_mul_ps(_mm256_loadu_ps(b + d), vb)));
    }
}
