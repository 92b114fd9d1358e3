#pragma once

// Software prefetching: single lines into L2 or L1, and a queue that spreads
// the lines of the next work into bursts over the current work.
//
// Included only by the per-ISA kernel units (compiled once per level with
// -DCPU_CAPABILITY=<LEVEL>, see cpu/isa_kernels.h): everything here lives in
// an anonymous namespace inside fusedmha::cpu::<LEVEL>, so each level has its
// own private copy.

#include <cstdint>

namespace fusedmha::cpu {
namespace CPU_CAPABILITY {
namespace {

// Asks for the cache line at p to come into L2 (prefetcht1). An asm
// statement on x86: GCC 12 deletes loops of __builtin_prefetch once they are
// inlined into the kernels (a loop with no other effect), so the prefetches
// the kernels asked for were never issued.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for the cache line at p to come into L1 (prefetcht0); an asm
// statement for the reason prefetch_line gives.
inline void prefetch_line_l1(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Cache lines to bring into the caches a few at a time, spread over the work that
// comes before their use. A burst of more prefetches than the core has line
// fill buffers (16 on current x86 cores) stalls it until lines arrive: the
// transfer is then serialised with the compute it was meant to overlap.
// The next block prefetched all at once read slower than no prefetch at
// all, and spread a few lines at a time between the reads of this one,
// fastest (docs/performance.md, "The prefetch queue").
class PrefetchQueue {
 public:
  // rows rows of `bytes` bytes each, `stride` bytes apart, from first, to
  // come into L2: the forward's prefetches come a block ahead, and into L1
  // they would evict the GEMMs' own tiles there; decoding's come a (head,
  // block) ahead (queue_next_head_block says why). docs/performance.md,
  // "The prefetch queue".
  void add(const void* first, int64_t stride, int64_t rows, int64_t bytes) {
    if (rows <= 0 || bytes <= 0) return;
    // Full: issue all that is queued. (Not issue(lines_): lines_ is only
    // an upper bound, and when it is exact a last region whose lines are all
    // issued is still counted, so the queue would stay full and this write
    // overrun it: rows of 31 floats, which straddle lines, did.)
    if (count_ == kMaxRegions) issue(std::numeric_limits<int64_t>::max());
    const uintptr_t start = reinterpret_cast<uintptr_t>(first);
    regions_[count_++] = {start & ~uintptr_t(63), start + bytes, start, stride, rows, bytes};
    lines_ += rows * (bytes / 64 + 2);  // (at most; a row may straddle lines)
  }
  // Spreads what is queued over the next `calls` calls of issue().
  void pace(int64_t calls) { burst_ = std::max<int64_t>(div_up(lines_, std::max<int64_t>(calls, 1)), 1); }
  // Issues the next burst of lines queued, in order.
  void issue() { issue(burst_); }
  void issue(int64_t n) {
    while (n > 0 && next_ < count_) {
      Region& r = regions_[next_];
      if (r.line >= r.end) {
        if (--r.rows == 0) {
          ++next_;
          continue;
        }
        r.row += r.stride;
        r.line = r.row & ~uintptr_t(63);
        r.end = r.row + r.bytes;
      }
      // As many of the row's lines as the burst has left, in a tight loop.
      const int64_t k = std::min<int64_t>(n, static_cast<int64_t>((r.end - r.line + 63) / 64));
      const uintptr_t line = r.line;
      for (int64_t i = 0; i < k; ++i) prefetch_line(reinterpret_cast<const void*>(line + 64 * i));
      r.line = line + 64 * k;
      n -= k;
      lines_ -= k;
    }
    if (next_ == count_) count_ = next_ = 0, lines_ = 0;
  }

 private:
  static constexpr int kMaxRegions = 40;
  struct Region {
    uintptr_t line, end;  // the next line, and the end of the current row
    uintptr_t row;        // the current row's first byte
    int64_t stride, rows, bytes;
  };
  Region regions_[kMaxRegions];
  int count_ = 0, next_ = 0;
  int64_t lines_ = 0, burst_ = 8;
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fusedmha::cpu
