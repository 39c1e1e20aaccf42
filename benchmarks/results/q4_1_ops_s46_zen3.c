// 1-row Q4_1 pair-kernel variants (AVX2, timing only): is the kernel bound by its instructions or by memory?
// Build: gcc -O3 -mavx2 -mfma -fopenmp -DVARIANT=v [-DPF=8] q4_1_ops_s46_zen3.c; run: ./a.out N_FEATURES REPEATS (K = 576)
// 0: the shipped conversion (and + cvt); 1: no nibble mask (wrong values); 2: no convert (wrong values);
// 3: k <= 4 by the 2^23 magic number (or + sub); 5: the mask as vandps. PF: software prefetch 8 features ahead (NTA).
// -DONECHAIN: one FMA chain per feature and pair (2 fewer FMAs a pair); -DNOPERM: the scales as a plain broadcast
// (as if the lanes alternated blocks; 2 fewer permutes a pair). Both would change the sums' bits; timing only here.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define QK 32
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static inline float hsum8(__m256 v){__m128 a=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1));a=_mm_hadd_ps(a,a);a=_mm_hadd_ps(a,a);return _mm_cvtss_f32(a);}
#ifdef NOPERM
static inline __m256 pd(const float*dn){return _mm256_castpd_ps(_mm256_broadcast_sd((const double*)dn));}
#else
static inline __m256 pd(const float*dn){return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double*)dn)),_mm256_setr_epi32(0,0,0,0,1,1,1,1));}
#endif
// VARIANT: 0 and+cvt ; 1 cvt only (no and) ; 2 and only (no cvt: bits as float) ; 3 magic or+sub for k<=4, cvt else; 4 magic for even k<=4
#ifndef VARIANT
#define VARIANT 0
#endif
static inline __attribute__((always_inline)) __m256 wq(const __m256i q, const int k){
#if VARIANT==0
  return _mm256_cvtepi32_ps(k<7?_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))):_mm256_srli_epi32(q,28));
#elif VARIANT==1
  return _mm256_cvtepi32_ps(k<7?q:_mm256_srli_epi32(q,28));
#elif VARIANT==2
  return _mm256_castsi256_ps(k<7?_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))):_mm256_srli_epi32(q,28));
#elif VARIANT==3
  if (k<=4) return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))),_mm256_set1_epi32(0x4B000000))),_mm256_set1_ps(8388608.f));
  return _mm256_cvtepi32_ps(k<7?_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))):_mm256_srli_epi32(q,28));
#elif VARIANT==5
  return _mm256_cvtepi32_ps(k<7?_mm256_castps_si256(_mm256_and_ps(_mm256_castsi256_ps(q),_mm256_castsi256_ps(_mm256_set1_epi32(0xF<<(4*k))))):_mm256_srli_epi32(q,28));
#elif VARIANT==6
  { __m256i r = k<7?_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))):_mm256_srli_epi32(q,28); return _mm256_cvtepi32_ps(r); }
#elif VARIANT==4
  if (k<=4 && (k&1)==0) return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))),_mm256_set1_epi32(0x4B000000))),_mm256_set1_ps(8388608.f));
  return _mm256_cvtepi32_ps(k<7?_mm256_and_si256(q,_mm256_set1_epi32(0xF<<(4*k))):_mm256_srli_epi32(q,28));
#endif
}
#ifdef ONECHAIN
static inline void step(int k,__m256 w,__m256 x,__m256*s,__m256*t){(void)t;if(k==0)*s=_mm256_mul_ps(w,x);else *s=_mm256_fmadd_ps(w,x,*s);}
#else
static inline void step(int k,__m256 w,__m256 x,__m256*s,__m256*t){if(k<2)*(k==0?s:t)=_mm256_mul_ps(w,x);else if(k%2==0)*s=_mm256_fmadd_ps(w,x,*s);else *t=_mm256_fmadd_ps(w,x,*t);}
#endif
__attribute__((noinline)) void row1(const float*x,int K,const uint8_t*qs,const float*d,float*y,int N){
  const int nb=K/QK;
#pragma omp parallel for schedule(static)
  for(int n=0;n<N-1;n+=2){
    const uint8_t*row=qs+(int64_t)n*nb*16;const float*dn=d+(int64_t)n*nb;
#ifdef PF
    if(n+PF+1<N){const char*p=(const char*)(row+(int64_t)PF*nb*16);for(int o=0;o<2*nb*16;o+=64)_mm_prefetch(p+o,_MM_HINT_NTA);
      const char*pd_=(const char*)(dn+(int64_t)PF*nb);for(int o=0;o<2*nb*4;o+=64)_mm_prefetch(pd_+o,_MM_HINT_NTA);
      const char*pm=(const char*)(d+(int64_t)N*nb+(int64_t)(n+PF)*nb);for(int o=0;o<2*nb*4;o+=64)_mm_prefetch(pm+o,_MM_HINT_NTA);}
#endif
    __m256 a0=_mm256_setzero_ps(),a1=a0;
    for(int b=0;b+2<=nb;b+=2){
      const __m256i q0=_mm256_loadu_si256((const __m256i*)(row+b*16));
      const __m256i q1=_mm256_loadu_si256((const __m256i*)(row+(nb+b)*16));
      __m256 s0,t0,s1,t1;
#pragma GCC unroll 8
      for(int k=0;k<8;k++){const __m256 xk=_mm256_loadu_ps(x+b*QK+8*k);step(k,wq(q0,k),xk,&s0,&t0);step(k,wq(q1,k),xk,&s1,&t1);}
      __m256 dv=pd(dn+b);
#ifdef ONECHAIN
      a0=_mm256_fmadd_ps(dv,s0,a0); dv=pd(dn+nb+b); a1=_mm256_fmadd_ps(dv,s1,a1); (void)t0; (void)t1;
#else
      a0=_mm256_fmadd_ps(dv,t0,_mm256_fmadd_ps(dv,s0,a0));
      dv=pd(dn+nb+b);a1=_mm256_fmadd_ps(dv,t1,_mm256_fmadd_ps(dv,s1,a1));
#endif
    }
    y[n]=hsum8(a0);y[n+1]=hsum8(a1);
  }
}
int main(int argc,char**argv){
  int K=576,N=argc>1?atoi(argv[1]):256; int nb=K/QK; int reps=argc>2?atoi(argv[2]):20000;
  uint8_t*qs=aligned_alloc(64,(size_t)N*nb*16);float*d=aligned_alloc(64,(size_t)N*nb*8);float*x=aligned_alloc(64,K*4);float*y=aligned_alloc(64,N*4);
  for(size_t i=0;i<(size_t)N*nb*16;i++)qs[i]=rand();for(int i=0;i<2*N*nb;i++)d[i]=1e-3f*(rand()%100);for(int i=0;i<K;i++)x[i]=(rand()%100)*1e-2f;
  row1(x,K,qs,d,y,N);
  double best=1e9;
  for(int r=0;r<7;r++){double t=now();for(int i=0;i<reps;i++){row1(x,K,qs,d,y,N);__asm__ volatile(""::"r"(y):"memory");}double e=now()-t;if(e<best)best=e;}
  double bytes=(double)N*nb*24*reps; // 16 qs + 8 scale bytes per block as in deepinfer
  printf("variant %d: %.2f GB/s (24 B/block), %.3f ns/block  y0=%g\n",VARIANT,bytes/best/1e9,best/((double)N*nb*reps)*1e9,y[0]);
}
