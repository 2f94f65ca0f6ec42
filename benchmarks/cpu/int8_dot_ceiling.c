// The integer core of the CPU backend's GGUF panel tile (quant_impl.h, panel_tile), alone:
// broadcast 4 int8 activations, vpmaddubsw against 8 interleaved weight vectors (in L1),
// int16 adds, one vpmaddwd per row and chunk; no float scaling. Two layouts: one 8-column
// panel x 4 rows (the kernel's), and two panels x 2 rows (each broadcast feeding two dots).
// Prints GMAC/s on one core: the ceiling of the panel formulation on this machine.
//   gcc -O3 -mavx2 -mfma benchmarks/cpu/int8_dot_ceiling.c -o /tmp/int8_dot && /tmp/int8_dot
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 20000000L
static __m256i W[64];
int main(){
  for(int i=0;i<64;i++) W[i]=_mm256_set1_epi8(i+1);
  static signed char xs[4096]; for(int i=0;i<4096;i++) xs[i]=(signed char)(i*7);
  __m256i s[8]; for(int r=0;r<8;r++) s[r]=_mm256_setzero_si256();
  double t0=now(), t;
  for(long n=0;n<N;n++){
    const signed char* x = xs + (n & 31) * 128;
    const __m256i* w0 = W + (n & 1) * 16; const __m256i* w1 = w0 + 8;
    _Pragma("GCC unroll 2") for(int r=0;r<2;r++){
      __m256i b = _mm256_set1_epi32(*(const int*)(x + 32*r));
      __m256i a0 = _mm256_maddubs_epi16(w0[0], b), a1 = _mm256_maddubs_epi16(w1[0], b);
      _Pragma("GCC unroll 8") for(int j=1;j<8;j++){ b=_mm256_set1_epi32(*(const int*)(x+32*r+4*j)); a0=_mm256_add_epi16(a0,_mm256_maddubs_epi16(w0[j], b)); a1=_mm256_add_epi16(a1,_mm256_maddubs_epi16(w1[j], b)); }
      s[2*r]=_mm256_add_epi32(s[2*r], _mm256_madd_epi16(a0, _mm256_set1_epi16(1)));
      s[2*r+1]=_mm256_add_epi32(s[2*r+1], _mm256_madd_epi16(a1, _mm256_set1_epi16(1)));
    }
  }
  t=now()-t0;
  printf("two panels, 2 rows, weights from L1: %.1f GMAC/s\n", N*32*32/t/1e9);
  t0=now();
  for(long n=0;n<N;n++){
    const signed char* x = xs + (n & 31) * 128;
    const __m256i* w0 = W + (n & 1) * 16;
    _Pragma("GCC unroll 4") for(int r=0;r<4;r++){
      __m256i a0 = _mm256_maddubs_epi16(w0[0], _mm256_set1_epi32(*(const int*)(x + 32*r)));
      _Pragma("GCC unroll 8") for(int j=1;j<8;j++) a0=_mm256_add_epi16(a0,_mm256_maddubs_epi16(w0[j], _mm256_set1_epi32(*(const int*)(x+32*r+4*j))));
      s[r]=_mm256_add_epi32(s[r], _mm256_madd_epi16(a0, _mm256_set1_epi16(1)));
    }
  }
  t=now()-t0;
  printf("one panel, 4 rows, weights from L1: %.1f GMAC/s\n", N*32*32/t/1e9);
  __m256i r=s[0]; for(int i=1;i<8;i++) r=_mm256_add_epi32(r,s[i]);
  printf("sink %d\n", _mm256_extract_epi32(r,0));
}
