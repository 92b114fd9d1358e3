/* Independent yardsticks for fusedmha's probes (test_peak_probes.py): plain C, no
 * fusedmha and no torch, built with -O2 -march=native -fopenmp.
 *
 *   peak_probes fma [rounds]    fp32 FMA GFLOP/s on every OpenMP thread: 12 independent
 *                               chains of vector FMAs held in registers per thread (the
 *                               widest vectors the flags allow: -mavx512f, -mavx2 -mfma, or
 *                               the SSE2 baseline, which multiplies and adds instead)
 *   peak_probes read [MiB]      memory-read GB/s on every OpenMP thread: a buffer far larger
 *                               than the caches, summed with vector loads
 *
 * Each prints the best of five timed rounds (a round: every thread at once, timed from the
 * barrier before to the barrier after). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define LOAD(p) _mm512_load_ps(p)
#define ADD(a, b) _mm512_add_ps(a, b)
#define FIRST(v) _mm512_cvtss_f32(v)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define LOAD(p) _mm256_load_ps(p)
#define ADD(a, b) _mm256_add_ps(a, b)
#define FIRST(v) _mm256_cvtss_f32(v)
#else /* the x86-64 baseline, SSE2: no FMA instruction; multiplies and adds in pipes of their own */
typedef __m128 vec;
#define LANES 4
#define SET1(x) _mm_set1_ps(x)
#define LOAD(p) _mm_load_ps(p)
#define ADD(a, b) _mm_add_ps(a, b)
#define FIRST(v) _mm_cvtss_f32(v)
#define SSE_BASELINE 1
#endif

/* n iterations of 12 independent chains held in registers (more than latency x pipes on
 * current x86 cores, few enough to need no spill); returns a value that depends on all of them
 * and the flops done. With FMA: 12 FMA chains (2 flops a lane each). On the SSE2 baseline: 6
 * multiply chains and 6 add chains (1 flop a lane each), which keep both kinds of pipe busy
 * as a multiply-add does (a multiply feeding an add within one chain would be latency-bound). */
#define CHAINS 12
static float fma_chains(long n, double* flops) {
  vec a0 = SET1(0.0f), a1 = SET1(0.1f), a2 = SET1(0.2f), a3 = SET1(0.3f), a4 = SET1(0.4f);
  vec a5 = SET1(0.5f), a6 = SET1(0.6f), a7 = SET1(0.7f), a8 = SET1(0.8f), a9 = SET1(0.9f);
  vec a10 = SET1(0.15f), a11 = SET1(0.25f);
#if defined(SSE_BASELINE)
  vec m = SET1(1.0f), c = SET1(1e-7f);
  __asm__ volatile("" : "+x"(m));  /* (x * 1 is not folded away: m is opaque) */
#define STEP_MUL(x) x = _mm_mul_ps(x, m)
#define STEP_ADD(x) x = _mm_add_ps(x, c)
  for (long i = 0; i < n; ++i) {
    STEP_MUL(a0); STEP_ADD(a1); STEP_MUL(a2); STEP_ADD(a3); STEP_MUL(a4); STEP_ADD(a5);
    STEP_MUL(a6); STEP_ADD(a7); STEP_MUL(a8); STEP_ADD(a9); STEP_MUL(a10); STEP_ADD(a11);
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    __asm__ volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
  *flops = 1.0 * CHAINS * LANES * (double)n;
#else
  const vec m = SET1(0.999999f), c = SET1(1e-7f);
  for (long i = 0; i < n; ++i) {
    a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c); a3 = FMA(a3, m, c);
    a4 = FMA(a4, m, c); a5 = FMA(a5, m, c); a6 = FMA(a6, m, c); a7 = FMA(a7, m, c);
    a8 = FMA(a8, m, c); a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c);
    /* (opaque to the optimiser: the chains stay as written, in registers) */
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    __asm__ volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
  *flops = 2.0 * CHAINS * LANES * (double)n;
#endif
  return FIRST(ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),
                   ADD(ADD(a8, a9), ADD(a10, a11))));
}

static double fma_gflops(long rounds) {
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < 5; ++r) {
    double t0 = 0, t1 = 0, flops = 0;
#pragma omp parallel
    {
      double f = 0;
#pragma omp barrier
#pragma omp master
      t0 = now();
      const float s = fma_chains(rounds, &f);
#pragma omp barrier
#pragma omp master
      {
        t1 = now();
        flops = f * omp_get_num_threads();
      }
#pragma omp atomic
      sink += s;
    }
    if (flops / (t1 - t0) > best) best = flops / (t1 - t0);
  }
  return best / 1e9;
}

static double read_gbps(size_t bytes) {
  const size_t n = bytes / sizeof(float);
  float* data = aligned_alloc(64, n * sizeof(float));
  if (!data) return 0;
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) data[i] = 1.0f;  /* first touch by the reading thread */
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now();
#pragma omp parallel
    {
      vec s0 = SET1(0), s1 = SET1(0), s2 = SET1(0), s3 = SET1(0);
#pragma omp for schedule(static)
      for (size_t i = 0; i < n; i += 4 * LANES) {
        s0 = ADD(s0, LOAD(data + i));
        s1 = ADD(s1, LOAD(data + i + LANES));
        s2 = ADD(s2, LOAD(data + i + 2 * LANES));
        s3 = ADD(s3, LOAD(data + i + 3 * LANES));
      }
      const float s = FIRST(ADD(ADD(s0, s1), ADD(s2, s3)));
#pragma omp atomic
      sink += s;
    }
    const double t = now() - t0;
    if (bytes / t > best) best = bytes / t;
  }
  free(data);
  return best / 1e9;
}

int main(int argc, char** argv) {
  if (argc >= 2 && strcmp(argv[1], "fma") == 0) {
    const long rounds = argc >= 3 ? atol(argv[2]) : 50000000;
    printf("%.2f\n", fma_gflops(rounds));
    return 0;
  }
  if (argc >= 2 && strcmp(argv[1], "read") == 0) {
    const size_t mib = argc >= 3 ? (size_t)atol(argv[2]) : 512;
    printf("%.2f\n", read_gbps(mib << 20));
    return 0;
  }
  fprintf(stderr, "usage: %s fma [rounds] | read [MiB]\n", argv[0]);
  return 2;
}
