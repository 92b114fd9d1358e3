// A bound for decoding on this machine: how fast can a CPU core read a
// grouped-query K/V cache the way the decode kernel walks it, with no more
// arithmetic than decoding must do? No fusedmha code: plain loops, so the
// figures measure the memory system, not our kernel.
//
// The cache is (H_kv, S, E) float32 K and V (H_kv = 8, S = 32768, E = 128:
// 256 MiB, far past the caches). Each thread takes a contiguous share of the
// keys and walks it as the kernel does: key blocks of 64, and within each
// block every head's K rows, then its V rows (32 KiB each). Rows:
//  - "plain read": the buffers summed front to back (the hardware
//    prefetchers' best case);
//  - "blocks": the kernel's order, loads only;
//  - "blocks + FMAs": the same, plus the fewest FMAs decoding needs for a
//    group of 4 query heads per K/V head (4·E per key for the scores and
//    4·E per key for P·V: 4096 8-wide FMAs per head's block), as independent
//    chains, with the next (head, block)'s K/V prefetched a line at a time
//    over those FMAs: not at all, with prefetcht0, or with prefetcht1.
// The last rows model what a decode kernel of this shape reaches here; a
// model, not a hard bound: on a Zen 4 EPYC (2 threads) they read 18-20 GB/s
// while the kernel, prefetching into L2 only, read 21-22 at S=32768.
//
// A second table walks as today's kernel does, loads only: blocks of 32
// keys, each (head, block)'s K read in 16-row by 64-byte tiles (the key
// transposes' order) and its V a 32-float panel at a time (P·V's), while the
// next (head, block)'s lines go to L2 (prefetcht1) in 68 small bursts, as
// the kernel's go out (per key transpose, every 4 dims of the scores, every
// 2 keys of the softmax, per P·V call: here every 4 rows of a key tile and
// per V panel), for the (H_kv, S, E) layout and FlashAttention's
// (S, H_kv, E), whose rows of one head are 4 KiB apart. What this walk
// reads is what the kernel could read with no arithmetic at all.
//
// A third table asks which walks the hardware prefetchers carry while a
// thread computes: each 64-byte line read is followed by 16 8-wide FMAs
// (independent of the loaded data; about what the decode kernel spends per
// line of K/V on Zen 4), heads one at a time, each 32-key block's K rows,
// then its V rows:
//  - "ascending": every line in address order, no software prefetch;
//  - "2 rows": two rows at a time, line by line (row j line 0, row j+1
//    line 0, row j line 1, ...: the order of a kernel that works on two keys
//    at once), no prefetch;
//  - "bursts of 8": ascending, but 8 lines read back to back, then their
//    FMAs, no prefetch;
//  - "tiles + L2 pf": the kernel's order (16-row by 64-byte key tiles, V in
//    32-float panels) with the next block prefetched into L2 in small bursts.
// On a Zen 4 EPYC (2 threads; plain read 38-55 GB/s) the ascending walk, in
// bursts of 8 or not, read as fast as the plain read or faster; two rows at
// a time about 30% of it, the kernel's order with L2 prefetches 71-79%.
//
//   g++ -O2 -mavx2 -mfma -pthread benchmarks/decode_memory_bound.cpp -o /tmp/decode_bound
//   /tmp/decode_bound [threads...]      (default: 1 2)

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr long kHeads = 8, kKeys = 32768, kDim = 128, kBlock = 64;
constexpr long kLinesPerSide = kBlock * kDim * 4 / 64;  // one head's K (or V) block
constexpr int kFmaSteps = 4096 / 12;  // 12 independent chains: 4096 FMAs per (head, block)

enum class Prefetch { None, T0, T1 };

struct Walk {
  const float* k;
  const float* v;
};

float sink_value;

// Sums a head's block of rows (kBlock rows of kDim floats).
__m256 read_block(const float* p, __m256 acc) {
  for (long i = 0; i < kBlock * kDim; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i));
  return acc;
}

template <Prefetch kPrefetch>
void prefetch_line(const float* p) {
  if constexpr (kPrefetch == Prefetch::T0) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  if constexpr (kPrefetch == Prefetch::T1) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// Keys [k0, k1) in the kernel's order; with_fmas adds the decode FMAs and
// the prefetches of the next (head, block).
template <Prefetch kPrefetch>
void walk(const float* k, const float* v, long k0, long k1, bool with_fmas) {
  std::vector<Walk> order;
  for (long b = k0; b < k1; b += kBlock) {
    for (long h = 0; h < kHeads; ++h) order.push_back({k + (h * kKeys + b) * kDim, v + (h * kKeys + b) * kDim});
  }
  __m256 acc = _mm256_setzero_ps(), chains[12];
  for (auto& c : chains) c = _mm256_set1_ps(1e-7f);
  const __m256 factor = _mm256_set1_ps(0.999f);
  for (size_t i = 0; i < order.size(); ++i) {
    acc = read_block(order[i].k, acc);
    acc = read_block(order[i].v, acc);
    if (!with_fmas) continue;
    const bool ahead = kPrefetch != Prefetch::None && i + 1 < order.size();
    long issued = 0;
    for (int s = 0; s < kFmaSteps; ++s) {
      for (auto& c : chains) c = _mm256_fmadd_ps(c, factor, c);
      // (the next block's 2 × kLinesPerSide lines, spread evenly)
      for (const long due = (s + 1) * 2 * kLinesPerSide / kFmaSteps; ahead && issued < due; ++issued) {
        const float* side = issued < kLinesPerSide ? order[i + 1].k : order[i + 1].v;
        prefetch_line<kPrefetch>(side + (issued % kLinesPerSide) * 16);
      }
    }
  }
  for (auto& c : chains) acc = _mm256_add_ps(acc, c);
  float out[8];
  _mm256_storeu_ps(out, acc);
  sink_value += out[0];
}

constexpr long kTileBlock = 32, kBursts = 68;

// Today's kernel's walk over keys [k0, k1), loads only; heads_inner: a
// (S, H_kv, E) layout (a key's heads side by side) instead of (H_kv, S, E).
void tile_walk(const float* k, const float* v, long k0, long k1, bool heads_inner, bool prefetch) {
  const long ld = heads_inner ? kHeads * kDim : kDim;
  auto row0 = [&](const float* base, long h, long key) {
    return heads_inner ? base + (key * kHeads + h) * kDim : base + (h * kKeys + key) * kDim;
  };
  __m256 a = _mm256_setzero_ps(), b = a;
  const long lines = 2 * kTileBlock * kDim / 16;  // K and V lines of one (head, block)
  for (long key = k0; key < k1; key += kTileBlock) {
    for (long h = 0; h < kHeads; ++h) {
      const bool last = h + 1 == kHeads;
      const long next_h = last ? 0 : h + 1, next_key = last ? key + kTileBlock : key;
      const bool ahead = prefetch && next_key < k1;
      long issued = 0;
      auto burst = [&](long n) {  // the next (head, block)'s lines in order, K rows then V rows
        for (long due = std::min(lines, issued + n); ahead && issued < due; ++issued) {
          const long side = issued / (lines / 2), line = issued % (lines / 2);
          const float* row = row0(side ? v : k, next_h, next_key + line / (kDim / 16)) ;
          _mm_prefetch(reinterpret_cast<const char*>(row + line % (kDim / 16) * 16), _MM_HINT_T1);
        }
      };
      const long per_burst = (lines + kBursts - 1) / kBursts;
      const float* kb = row0(k, h, key);
      for (long j0 = 0; j0 < kTileBlock; j0 += 16) {
        for (long e0 = 0; e0 < kDim; e0 += 16) {
          for (long j = j0; j < j0 + 16; ++j) {
            if (j % 4 == 0) burst(per_burst);
            a = _mm256_add_ps(a, _mm256_loadu_ps(kb + j * ld + e0));
            b = _mm256_add_ps(b, _mm256_loadu_ps(kb + j * ld + e0 + 8));
          }
        }
      }
      const float* vb = row0(v, h, key);
      for (long e0 = 0; e0 < kDim; e0 += 32) {
        burst(per_burst);
        for (long t = 0; t < kTileBlock; ++t) {
          for (long e = e0; e < e0 + 32; e += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(vb + t * ld + e));
        }
      }
      burst(lines);
    }
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(a, b));
  sink_value += out[0];
}

// 16 8-wide FMAs on 8 chains: a line's worth of the third table's arithmetic.
struct Arithmetic {
  __m256 chains[8];
  const __m256 factor = _mm256_set1_ps(0.999f);
  Arithmetic() {
    for (auto& c : chains) c = _mm256_set1_ps(1e-7f);
  }
  void line() {  // (unrolled, so the chains stay in registers)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) chains[i % 8] = _mm256_fmadd_ps(chains[i % 8], factor, chains[i % 8]);
  }
  float sum() const {
    __m256 a = chains[0];
    for (int i = 1; i < 8; ++i) a = _mm256_add_ps(a, chains[i]);
    float out[8];
    _mm256_storeu_ps(out, a);
    return out[0];
  }
};

enum class Order { Ascending, TwoRows, Bursts8, TilesPrefetched };

// Keys [k0, k1) of the (H_kv, S, E) cache, heads one at a time, in 32-key
// blocks (K rows, then V rows) read in `order` with Arithmetic::line() after
// each line.
void arithmetic_walk(const float* k, const float* v, long k0, long k1, Order order) {
  constexpr long kRowLines = kDim / 16, kSideLines = kTileBlock * kRowLines;
  Arithmetic work;
  __m256 a = _mm256_setzero_ps(), b = a;
  auto read = [&](const float* line) {  // (one 64-byte line)
    a = _mm256_add_ps(a, _mm256_loadu_ps(line));
    b = _mm256_add_ps(b, _mm256_loadu_ps(line + 8));
  };
  for (long h = 0; h < kHeads; ++h) {
    for (long key = k0; key < k1; key += kTileBlock) {
      const float* sides[2] = {k + (h * kKeys + key) * kDim, v + (h * kKeys + key) * kDim};
      if (order == Order::Ascending) {
        for (const float* p : sides) {
          for (long l = 0; l < kSideLines; ++l) read(p + l * 16), work.line();
        }
      } else if (order == Order::TwoRows) {
        for (const float* p : sides) {
          for (long j = 0; j < kTileBlock; j += 2) {
            for (long l = 0; l < kRowLines; ++l) {
              read(p + j * kDim + l * 16), work.line();
              read(p + (j + 1) * kDim + l * 16), work.line();
            }
          }
        }
      } else if (order == Order::Bursts8) {
        for (const float* p : sides) {
          for (long l = 0; l < kSideLines; l += 8) {
            for (long i = l; i < l + 8; ++i) read(p + i * 16);
            for (int i = 0; i < 8; ++i) work.line();
          }
        }
      } else {
        // The next block (this head's next keys, or the next head's first),
        // its K then V lines into L2, 6 at a time: every 4 key-tile reads
        // and every 8 V-panel reads (96 bursts of the block's 512 lines).
        const bool last = key + kTileBlock >= k1;
        const long next_h = last ? h + 1 : h, next_key = last ? k0 : key + kTileBlock;
        const bool ahead = next_h < kHeads;
        long issued = 0;
        auto burst = [&] {
          for (const long due = std::min(2 * kSideLines, issued + 6); ahead && issued < due; ++issued) {
            const float* base = issued < kSideLines ? k : v;
            const float* line = base + (next_h * kKeys + next_key) * kDim + issued % kSideLines * 16;
            _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
          }
        };
        long reads = 0;
        for (long j0 = 0; j0 < kTileBlock; j0 += 16) {
          for (long e0 = 0; e0 < kDim; e0 += 16) {
            for (long j = j0; j < j0 + 16; ++j) {
              if (reads++ % 4 == 0) burst();
              read(sides[0] + j * kDim + e0), work.line();
            }
          }
        }
        for (long e0 = 0; e0 < kDim; e0 += 32) {
          for (long t = 0; t < kTileBlock; ++t) {
            for (long e = e0; e < e0 + 32; e += 16) {
              if (reads++ % 8 == 0) burst();
              read(sides[1] + t * kDim + e), work.line();
            }
          }
        }
      }
    }
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(a, b));
  sink_value += out[0] + work.sum();
}

void plain_read(const float* k, const float* v, long k0, long k1) {
  __m256 a = _mm256_setzero_ps(), b = a;
  for (long h = 0; h < kHeads; ++h) {
    for (const float* base : {k, v}) {
      const float* p = base + (h * kKeys + k0) * kDim;
      for (long i = 0; i < (k1 - k0) * kDim; i += 16) {
        a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
        b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
      }
    }
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(a, b));
  sink_value += out[0];
}

// GB/s of K/V read when `threads` threads each run body over their share
// of the keys (the slowest thread's time; best of 3).
template <typename Body>
double gbps(int threads, const Body& body) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> pool;
    std::vector<double> seconds(threads);
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const long share = kKeys / threads / kBlock * kBlock;
        const auto start = std::chrono::steady_clock::now();
        body(t * share, (t + 1) * share);
        seconds[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      });
    }
    for (auto& th : pool) th.join();
    best = std::min(best, *std::max_element(seconds.begin(), seconds.end()));
  }
  const long share = kKeys / threads / kBlock * kBlock;
  return 2.0 * kHeads * share * threads * kDim * 4 / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> thread_counts;
  for (int i = 1; i < argc; ++i) thread_counts.push_back(std::atoi(argv[i]));
  if (thread_counts.empty()) thread_counts = {1, 2};
  const size_t n = kHeads * kKeys * kDim;
  auto* k = static_cast<float*>(std::aligned_alloc(64, n * 4));
  auto* v = static_cast<float*>(std::aligned_alloc(64, n * 4));
  for (size_t i = 0; i < n; ++i) k[i] = v[i] = 1e-6f * static_cast<float>(i % 7);
  std::printf("K/V cache (H_kv=%ld, S=%ld, E=%ld) float32, %ld MiB; GB/s of K/V read\n", kHeads, kKeys,
              kDim, 2 * n * 4 >> 20);
  std::printf("%8s %11s %8s %22s %22s %22s\n", "threads", "plain read", "blocks", "blocks + FMAs, no pf",
              "+ FMAs, prefetcht0", "+ FMAs, prefetcht1");
  for (int threads : thread_counts) {
    const double plain = gbps(threads, [&](long a, long b) { plain_read(k, v, a, b); });
    const double blocks = gbps(threads, [&](long a, long b) { walk<Prefetch::None>(k, v, a, b, false); });
    const double none = gbps(threads, [&](long a, long b) { walk<Prefetch::None>(k, v, a, b, true); });
    const double t0 = gbps(threads, [&](long a, long b) { walk<Prefetch::T0>(k, v, a, b, true); });
    const double t1 = gbps(threads, [&](long a, long b) { walk<Prefetch::T1>(k, v, a, b, true); });
    std::printf("%8d %11.1f %8.1f %22.1f %22.1f %22.1f\n", threads, plain, blocks, none, t0, t1);
  }
  std::printf("\nToday's walk (32-key blocks, key-transpose and P.V order), loads only; GB/s\n");
  std::printf("%8s %11s %16s %16s %16s %16s\n", "threads", "plain read", "(H,S,E)", "(H,S,E) + L2 pf",
              "(S,H,E)", "(S,H,E) + L2 pf");
  for (int threads : thread_counts) {
    const double plain = gbps(threads, [&](long a, long b) { plain_read(k, v, a, b); });
    double walks[4];
    for (int i = 0; i < 4; ++i) {
      walks[i] = gbps(threads, [&](long a, long b) { tile_walk(k, v, a, b, i >= 2, i % 2 == 1); });
    }
    std::printf("%8d %11.1f %16.1f %16.1f %16.1f %16.1f\n", threads, plain, walks[0], walks[1],
                walks[2], walks[3]);
  }
  std::printf("\nWith 16 FMAs per line read (heads one at a time, 32-key blocks); GB/s\n");
  std::printf("%8s %11s %10s %7s %12s %14s\n", "threads", "plain read", "ascending", "2 rows",
              "bursts of 8", "tiles + L2 pf");
  for (int threads : thread_counts) {
    const double plain = gbps(threads, [&](long a, long b) { plain_read(k, v, a, b); });
    double walks[4];
    const Order orders[4] = {Order::Ascending, Order::TwoRows, Order::Bursts8, Order::TilesPrefetched};
    for (int i = 0; i < 4; ++i) {
      walks[i] = gbps(threads, [&](long a, long b) { arithmetic_walk(k, v, a, b, orders[i]); });
    }
    std::printf("%8d %11.1f %10.1f %7.1f %12.1f %14.1f\n", threads, plain, walks[0], walks[1],
                walks[2], walks[3]);
  }
  std::free(k);
  std::free(v);
  return sink_value == 12345.0f;  // (keeps the sums alive)
}
