"""What the instructions of the bf16 1-row GGUF kernel cost on this CPU, in core cycles.

The 1-row Q4_1 kernel (`gguf_gemm.c`, `q4_1_pair_pbh` + VDPBF16PS) spends per pair of blocks: two FMAs and a
VCVTNE2PS2BF16 building the pair's 32-entry bf16 table, a widening and three index operations, two VPERMW lookups
and two VDPBF16PS. Whether a single stream is bound by memory or by these instructions depends on what they cost on
the core at hand, which differs between kinds of machine (and between a VM's view of a core and the bare part).
This script compiles a microbenchmark with the system's gcc (`-march=native`) and prints, in cycles of the core's
clock (measured first by a chain of dependent adds):

* throughput: 8 independent instructions per iteration, cycles per instruction;
* latency: one dependent chain, cycles per instruction;
* the kernel's pair loop over weights in L1 (64 features of 18 blocks, SmolLM2-135M's K = 576), cycles per block
  pair, as it is and with one part replaced (values not meaningful, time only): a constant table (no table
  build), XOR for VPERMW, one FMA for each VDPBF16PS.

    python3 benchmarks/isa_costs.py

Needs gcc and AVX-512 BF16 (prints why and exits 1 otherwise). Results: benchmarks/BENCHMARKS.md, session 56.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 50000000L
static double cycle_s;
#define TP(name, ins) { double t = now(); for (long i = 0; i < N; i++) __asm__ volatile( \
    ins(8) ins(9) ins(10) ins(11) ins(12) ins(13) ins(14) ins(15) ::: "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
    "xmm13", "xmm14", "xmm15"); printf("  %-16s throughput %5.2f cycles\n", name, (now() - t) / (N * 8.0) / cycle_s); }
#define LAT(name, body) { double t = now(); for (long i = 0; i < N; i++) __asm__ volatile(body ::: "xmm8"); \
    printf("  %-16s latency    %5.2f cycles\n", name, (now() - t) / N / cycle_s); }
#define CVT(r) "vcvtne2ps2bf16 %%zmm1, %%zmm2, %%zmm" #r "\n"
#define DP(r) "vdpbf16ps %%zmm1, %%zmm2, %%zmm" #r "\n"
#define PERMW(r) "vpermw %%zmm1, %%zmm2, %%zmm" #r "\n"
#define FMA(r) "vfmadd231ps %%zmm1, %%zmm2, %%zmm" #r "\n"
#define ZXBW(r) "vpmovzxbw %%ymm1, %%zmm" #r "\n"
#define TERN(r) "vpternlogd $0xEA, %%zmm1, %%zmm2, %%zmm" #r "\n"
#define SRLW(r) "vpsrlw $4, %%zmm1, %%zmm" #r "\n"
#define CVTPH(r) "vcvtph2ps %%ymm1, %%zmm" #r "\n"

#define NB 18
static inline __m512 vals(float d, float m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
}
/* one feature of NB blocks as the kernel's pair loop does it; V: 0 as is, 1 constant table, 2 xor for vpermw,
 * 3 one fma for each vdpbf16ps */
__attribute__((noinline)) static __m512 feature(int V, const uint16_t *x, const uint8_t *q, const float *d,
                                                const float *mn) {
    __m512 acc = _mm512_setzero_ps(), accb = _mm512_setzero_ps();
    const __m512i block = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const __m512i ctab = (__m512i)_mm512_cvtne2ps_pbh(vals(0.01f, 0.1f), vals(0.02f, 0.2f));
    for (int b = 0; b < NB; b += 2) {
        const __m512i table = V == 1 ? ctab
            : (__m512i)_mm512_cvtne2ps_pbh(vals(d[b + 1], mn[b + 1]), vals(d[b], mn[b]));
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + b * 16)));
        const __m512i li = _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x0F), block, 0xEA);
        const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(w, 4), block);
        const __m512i lo = V == 2 ? _mm512_xor_si512(li, table) : _mm512_permutexvar_epi16(li, table);
        const __m512i hv = V == 2 ? _mm512_xor_si512(hi, table) : _mm512_permutexvar_epi16(hi, table);
        if (V == 3) {
            acc = _mm512_fmadd_ps((__m512)lo, _mm512_loadu_ps((const float *)(x + b * 32)), acc);
            accb = _mm512_fmadd_ps((__m512)hv, _mm512_loadu_ps((const float *)(x + b * 32 + 32)), accb);
        } else {
            acc = _mm512_dpbf16_ps(acc, (__m512bh)lo, (__m512bh)_mm512_loadu_si512(x + b * 32));
            accb = _mm512_dpbf16_ps(accb, (__m512bh)hv, (__m512bh)_mm512_loadu_si512(x + b * 32 + 32));
        }
    }
    return _mm512_add_ps(acc, accb);
}

int main(void) {
    double t = now();
    long v = 0;
    for (long i = 0; i < 4 * N; i++) __asm__ volatile("add $1, %0" : "+r"(v));
    cycle_s = (now() - t) / (4 * N);
    printf("core clock %.2f GHz (a chain of dependent adds)\n", 1e-9 / cycle_s);
    __asm__ volatile("vpxord %%zmm1, %%zmm1, %%zmm1\n vpxord %%zmm2, %%zmm2, %%zmm2\n vpxord %%zmm8, %%zmm8, %%zmm8"
                     ::: "xmm1", "xmm2", "xmm8");
    TP("vdpbf16ps", DP) TP("vcvtne2ps2bf16", CVT) TP("vpermw", PERMW) TP("vfmadd231ps", FMA) TP("vpmovzxbw", ZXBW)
    TP("vpternlogd", TERN) TP("vpsrlw", SRLW) TP("vcvtph2ps", CVTPH)
    LAT("vdpbf16ps", "vdpbf16ps %%zmm1, %%zmm2, %%zmm8\n") LAT("vcvtne2ps2bf16", "vcvtne2ps2bf16 %%zmm8, %%zmm8, %%zmm8\n")
    LAT("vpermw", "vpermw %%zmm8, %%zmm2, %%zmm8\n") LAT("vfmadd231ps", "vfmadd231ps %%zmm1, %%zmm2, %%zmm8\n")
    static uint8_t q[64 * NB * 16];
    static float d[64 * NB], mn[64 * NB];
    static uint16_t x[NB * 32 + 64];
    for (unsigned i = 0; i < sizeof q; i++) q[i] = (uint8_t)(i * 37);
    for (int i = 0; i < 64 * NB; i++) d[i] = 0.01f * (i % 7 + 1), mn[i] = -0.1f;
    for (int i = 0; i < NB * 32; i++) x[i] = (uint16_t)(0x3f80 + i % 5);
    const char *names[] = {"as it is", "constant table", "xor for vpermw", "fma for vdpbf16ps"};
    printf("the 1-row Q4_1 pair loop, weights in L1 (cycles per block pair):\n");
    for (int V = 0; V < 4; V++) {
        __m512 s = _mm512_setzero_ps();
        double best = 1e9;
        for (int r = 0; r < 5; r++) {
            t = now();
            for (int it = 0; it < 20000; it++)
                for (int f = 0; f < 64; f++) s = _mm512_add_ps(s, feature(V, x, q + f * NB * 16, d + f * NB, mn + f * NB));
            best = now() - t < best ? now() - t : best;
        }
        float o[16];
        _mm512_storeu_ps(o, s);  /* the sums are printed (in a way that shows nothing) so the loop is not dropped */
        printf("  %-18s %6.2f%s\n", names[V], best / (20000.0 * 64 * NB / 2) / cycle_s, o[0] == 12345.f ? " " : "");
    }
    return 0;
}
"""


def main() -> int:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512_bf16" not in flags or shutil.which("gcc") is None:
        print("needs gcc and a CPU with AVX-512 BF16")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "isa.c"), Path(tmp, "isa")
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        return subprocess.run([str(exe)]).returncode


if __name__ == "__main__":
    sys.exit(main())
