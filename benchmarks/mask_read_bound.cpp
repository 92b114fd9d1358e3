// A bound for per-head masks on this machine: what reading one mask value
// per score costs beside the FMAs that the scores and P·V must do anyway,
// with no fusedmha code. Plain loops, so the figures measure the core and
// its memory system, not our kernel.
//
// A (B, H, L, S) float mask with S = 1024 has each row on a 4 KiB page of
// its own, and every element is read once. The forward kernel walks it as
// this model does: query blocks of 128 rows, key blocks of 64; per block,
// panels of 2 vectors of queries, each panel's score GEMM (64 keys × E dims)
// and P·V GEMM (E dims × 64 keys) as register-blocked micro-kernels over
// operands of the kernel's sizes (about 27 KiB at E = 64 with AVX-512, so in
// L1; 46 KiB at E = 128, part of them in L2, as the kernel's are), while the
// next block's mask tile (128 rows × 64 floats) is prefetched into L2
// (prefetcht1), a burst per micro-kernel call. Each row of the table is a variant, as a fraction of the speed of
// the FMAs alone (medians of rounds that alternate them):
//  - "prefetch": the next tile prefetched, never read;
//  - "+ read": and each panel's rows of the tile read after its scores and
//    added onto the panel's score tile in L1: one vector load and add per
//    vector of scores, no transposes (the least any kernel with the keys in
//    the vector lanes does; fusedmha's kernel, with the queries in the lanes,
//    also transposes 16 × 16 blocks);
//  - "+ read in GEMM": the mask rows loaded as the score GEMM's initial
//    accumulators instead (no pass of their own);
//  - "+ read from L1": the adds of "+ read" from lines the GEMMs keep in L1
//    (the real tile still prefetched): what the lines' way from L2 costs.
// Columns: E = 64 and 128, the mask on 4 KiB pages (MADV_NOHUGEPAGE), and on
// 2 MiB pages where transparent huge pages can be had (MADV_HUGEPAGE); the
// program prints how much of the masks Linux put on huge pages.
//
// What it says on a Zen 4 EPYC (2 threads, AVX-512, 32 KiB L1d and 1 MiB L2
// per core; the FMAs alone at 200-222 GFLOP/s, 88-98% of the FMA peak),
// three runs of 25 rounds, 4 KiB pages / 2 MiB pages:
//
//   variant           E = 64                  E = 128
//   prefetch          0.93-0.95 / 0.95-0.96   0.96-0.97 / 0.97-0.99
//   + read            0.89-0.91 / 0.89-0.92   0.93-0.95 / 0.94-0.96
//   + read in GEMM    0.89-0.92 / 0.93-0.94   0.95-0.96 / 0.95-0.97
//   + read from L1    0.91-0.94 / 0.93-0.94   0.93-0.96 / 0.96-0.98
//
// So at E = 64 the least a per-head float mask asks of this machine (its
// lines into L2, then one load and add per vector of scores) adds 10-13% to
// the GEMMs' time, with no transposes, softmax or rescaling. fusedmha's
// unmasked call (B=4, H=8, L=S=1024) ran at 157-165 GFLOP/s where these
// GEMMs ran at 200-217, so 74-82% of its time is GEMM work at this rate; a
// kernel that did nothing more for the mask would run it at about 0.90-0.94
// of its unmasked speed, just past the 10% the project allows.
// A model, not a hard bound: a kernel's other work may overlap the mask's
// loads better than these GEMMs (dense FMAs, no slack) do.
//
//   g++ -O2 -march=native -pthread benchmarks/mask_read_bound.cpp -o /tmp/mask_bound
//   /tmp/mask_bound [rounds]      (default 15)

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kMicroRows = 12;  // as the kernel's AVX-512 micro-kernels
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kMicroRows = 6;  // as the kernel's AVX2 micro-kernels
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#endif

constexpr long kKeys = 1024;           // S: a mask row is 4 KiB, a page
constexpr long kBlockQ = 128;          // query rows per block
constexpr long kBlockKV = 64;          // keys per block
constexpr long kPanel = 2 * kLanes;    // queries per panel
constexpr long kRowLines = kBlockKV * sizeof(float) / 64;  // a tile row's cache lines
constexpr long kHeadsPerThread = 16;   // 64 MiB of mask per thread
constexpr int kThreads = 2;

enum class Mode { Fmas, Prefetch, Read, ReadInGemm, ReadFromL1 };
constexpr Mode kModes[] = {Mode::Fmas, Mode::Prefetch, Mode::Read, Mode::ReadInGemm,
                           Mode::ReadFromL1};
const char* const kModeNames[] = {"FMAs alone", "prefetch", "+ read", "+ read in GEMM",
                                  "+ read from L1"};

inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// c (kRows rows, ldc apart, of 2 vectors) += Σ_e a[e·kMicroRows + i] · b[e·kPanel ..]:
// the kernel's micro-kernel shape, its operands in L1. With init, the
// accumulators start from init's rows (ld apart) instead of c's.
template <int kRows>
void micro(const float* a, const float* b, long steps, float* c, long ldc, const float* init,
           long ld) {
  Vec acc[2 * kRows];  // (loops unrolled so that these stay in registers, even at -O2)
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) {
    acc[2 * i] = load(init ? init + i * ld : c + i * ldc);
    acc[2 * i + 1] = load(init ? init + i * ld + kLanes : c + i * ldc + kLanes);
  }
  for (long e = 0; e < steps; ++e) {
    const Vec b0 = load(b + e * kPanel), b1 = load(b + e * kPanel + kLanes);
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      const Vec x = splat(a[e * kMicroRows + i]);
      acc[2 * i] = fma(x, b0, acc[2 * i]);
      acc[2 * i + 1] = fma(x, b1, acc[2 * i + 1]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) {
    store(c + i * ldc, acc[2 * i]);
    store(c + i * ldc + kLanes, acc[2 * i + 1]);
  }
}

// micro<rows> for 0 < rows < kRows.
template <int kRows>
void micro_rest(int rows, const float* a, const float* b, long steps, float* c, long ldc,
                const float* init, long ld) {
  if constexpr (kRows > 1) {
    if (rows == kRows - 1) return micro<kRows - 1>(a, b, steps, c, ldc, init, ld);
    micro_rest<kRows - 1>(rows, a, b, steps, c, ldc, init, ld);
  }
}

// The next tile's lines, a burst after each micro-kernel call.
struct Walk {
  const float* next = nullptr;  // the next tile's first row
  long line = 0, lines = 0, burst = 0;
  void issue() {
    for (long n = 0; n < burst && line < lines; ++n, ++line) {
      prefetch_l2(next + (line / kRowLines) * kKeys + (line % kRowLines) * 16);
    }
  }
};

long calls(long rows) { return (rows + kMicroRows - 1) / kMicroRows; }

// A GEMM of `rows` rows (kMicroRows at a time) × kPanel columns over `steps`.
// With init (the score GEMM reading the mask), row r starts from init + r·ld.
void gemm(long rows, long steps, const float* a, const float* b, float* c, long ldc,
          const float* init, long ld, Walk* walk) {
  for (long r = 0; r < rows; r += kMicroRows) {
    const float* from = init ? init + r * ld : nullptr;
    if (rows - r >= kMicroRows) {
      micro<kMicroRows>(a, b, steps, c + r * ldc, ldc, from, ld);
    } else {
      micro_rest<kMicroRows>(int(rows - r), a, b, steps, c + r * ldc, ldc, from, ld);
    }
    if (walk) walk->issue();
  }
}

// One thread's heads: every query block, key block and panel.
float run_heads(const float* mask, long dim, Mode mode) {
  alignas(64) static thread_local float a[128 * kMicroRows], b[128 * kPanel],
      st[kPanel * kBlockKV], o[128 * kPanel];
  static_assert(kPanel * kBlockKV <= 64 * kPanel, "ReadFromL1 reads b's first 64 rows");
  for (long i = 0; i < 128 * kMicroRows; ++i) a[i] = 1e-3f * float(i % 7);
  for (long i = 0; i < 128 * kPanel; ++i) b[i] = 1e-3f * float(i % 5);
  const bool prefetch = mode != Mode::Fmas;
  const long panel_calls = kBlockKV / kPanel * calls(kPanel) + calls(dim);
  for (long h = 0; h < kHeadsPerThread; ++h) {
    const float* head = mask + h * kKeys * kKeys;
    for (long q0 = 0; q0 < kKeys; q0 += kBlockQ) {
      for (long k0 = 0; k0 < kKeys; k0 += kBlockKV) {
        const float* tile = head + q0 * kKeys + k0;
        Walk walk;
        if (prefetch) {
          // The next tile: to the right, else the next query block's first,
          // else the next head's (the last head's last tile: itself again).
          if (k0 + kBlockKV < kKeys) {
            walk.next = tile + kBlockKV;
          } else if (q0 + kBlockQ < kKeys) {
            walk.next = head + (q0 + kBlockQ) * kKeys;
          } else {
            walk.next = h + 1 < kHeadsPerThread ? head + kKeys * kKeys : tile;
          }
          walk.lines = kBlockQ * kRowLines;
          const long total_calls = kBlockQ / kPanel * panel_calls;
          walk.burst = (walk.lines + total_calls - 1) / total_calls;
        }
        Walk* w = prefetch ? &walk : nullptr;
        for (long p = 0; p < kBlockQ; p += kPanel) {
          // The panel's scores with its kPanel queries as rows and the keys in
          // the lanes (kPanel keys a call), so its mask rows are its rows.
          const float* rows = tile + p * kKeys;
          const bool in_gemm = mode == Mode::ReadInGemm;
          for (long j = 0; j < kBlockKV; j += kPanel) {
            gemm(kPanel, dim, a, b, st + j, kBlockKV, in_gemm ? rows + j : nullptr, kKeys, w);
          }
          if (mode == Mode::Read || mode == Mode::ReadFromL1) {
            // (From L1: b's first rows, which both GEMMs read at every step.)
            const float* m = mode == Mode::Read ? rows : b;
            const long ld = mode == Mode::Read ? kKeys : kBlockKV;
            for (long i = 0; i < kPanel; ++i) {
              for (long j = 0; j < kBlockKV; j += kLanes) {
                float* s = st + i * kBlockKV + j;
                store(s, add(load(s), load(m + i * ld + j)));
              }
            }
          }
          // P·V: dim rows of the output (transposed), kPanel query lanes.
          gemm(dim, kBlockKV, a, b, o, kPanel, nullptr, 0, w);
        }
      }
    }
  }
  return st[3] + o[5];
}

double seconds(const std::vector<float*>& masks, long dim, Mode mode) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  std::vector<float> sink(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] { sink[t] = run_heads(masks[t], dim, mode); });
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

constexpr size_t kMaskBytes = sizeof(float) * kHeadsPerThread * kKeys * kKeys;

// One mask per thread, on 4 KiB pages or (asked for) 2 MiB ones.
std::vector<float*> make_masks(bool huge) {
  std::vector<float*> masks;
  for (int t = 0; t < kThreads; ++t) {
    float* m = static_cast<float*>(std::aligned_alloc(2 << 20, kMaskBytes));
    if (m == nullptr) {
      std::fprintf(stderr, "out of memory for the masks\n");
      std::exit(1);
    }
    if (madvise(m, kMaskBytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0) {
      std::fprintf(stderr, "(madvise refused %s)\n", huge ? "MADV_HUGEPAGE" : "MADV_NOHUGEPAGE");
    }
    std::memset(m, 0, kMaskBytes);
    masks.push_back(m);
  }
  return masks;
}

// This process's anonymous memory on huge pages, in MiB (-1 where unknown).
long anon_huge_mib() {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return -1;
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "AnonHugePages: %ld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib / 1024;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 15;
  const long dims[] = {64, 128};
  std::printf("per-head mask, S = %ld (rows 4 KiB apart), %d threads, %d-lane vectors: speed of each\n"
              "variant as a fraction of the FMAs alone (medians of %d alternating rounds)\n",
              kKeys, kThreads, kLanes, rounds);
  char thp[128] = "unknown";
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    if (!std::fgets(thp, sizeof thp, f)) std::strcpy(thp, "unknown");
    thp[std::strcspn(thp, "\n")] = 0;
    std::fclose(f);
  }
  std::printf("(the 2M columns ask for huge pages with madvise; transparent_hugepage: %s)\n", thp);
  std::printf("%16s %12s %12s %12s %12s\n", "", "E=64 4K", "E=128 4K", "E=64 2M", "E=128 2M");
  double table[5][4];
  double gflops[4];
  long huge_mib[2];
  for (int page = 0; page < 2; ++page) {
    std::vector<float*> masks = make_masks(page == 1);
    huge_mib[page] = anon_huge_mib();
    for (int d = 0; d < 2; ++d) {
      const int col = page * 2 + d;
      std::vector<std::vector<double>> ratio(5);
      std::vector<double> fma_only;
      for (int r = 0; r < rounds; ++r) {
        double t[5];
        for (int i = 0; i < 5; ++i) {
          const int m = r % 2 ? 4 - i : i;  // alternate the order
          t[m] = seconds(masks, dims[d], kModes[m]);
        }
        for (int i = 0; i < 5; ++i) ratio[i].push_back(t[0] / t[i]);
        fma_only.push_back(t[0]);
      }
      for (int i = 0; i < 5; ++i) {
        std::sort(ratio[i].begin(), ratio[i].end());
        table[i][col] = ratio[i][rounds / 2];
      }
      std::sort(fma_only.begin(), fma_only.end());
      const double blocks = double(kThreads) * kHeadsPerThread * (kKeys / kBlockQ) * (kKeys / kBlockKV);
      // (scores + P·V; the median round, as the ratios)
      gflops[col] = 4.0 * kBlockKV * kBlockQ * dims[d] * blocks / fma_only[rounds / 2] / 1e9;
    }
    for (float* m : masks) std::free(m);
  }
  for (int i = 0; i < 5; ++i) {
    std::printf("%16s", kModeNames[i]);
    for (int c = 0; c < 4; ++c) std::printf(" %12.3f", table[i][c]);
    std::printf("\n");
  }
  std::printf("%16s", "GFLOP/s, FMAs");
  for (int c = 0; c < 4; ++c) std::printf(" %12.1f", gflops[c]);
  std::printf("\n(the masks on huge pages: %ld MiB in the 4K columns, %ld MiB in the 2M ones, of %zu MiB)\n",
              huge_mib[0], huge_mib[1], kThreads * kMaskBytes >> 20);
}
