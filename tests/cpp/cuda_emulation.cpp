// The CPU emulation of csrc/cuda/emulation.h: a block's threads are fibers
// run round-robin on the calling thread; a barrier parks a fiber until every
// thread of its block (or warp) has arrived. Warp collectives exchange
// operands through per-warp slots between two warp barriers.
//
// A fiber starts on its own stack through makecontext/swapcontext; after
// that, switches use _setjmp/_longjmp, which (unlike swapcontext) make no
// system call to save the signal mask: tens of millions of switches a run.
// (_FORTIFY_SOURCE's longjmp check refuses jumps between stacks, so it is off
// for this file; see tests/cpp/CMakeLists.txt.)

#include "cuda/emulation.h"

#include <setjmp.h>
#include <ucontext.h>

#include <cstring>
#include <stdexcept>
#include <vector>

namespace fusedmha::cuda::emulation {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Barrier {
  unsigned arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  ucontext_t start;  // to enter body() on the fiber's stack the first time
  jmp_buf resume;    // where it yielded
  std::vector<char> stack;
  bool started = false;
  bool done = false;
};

struct Block {
  unsigned threads = 0;
  Index3 index;
  std::vector<Fiber> fibers;
  unsigned current = 0;
  ucontext_t scheduler_context;  // (only for the first entry of a fiber)
  jmp_buf scheduler;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<unsigned char> smem;
  const std::function<void()>* body = nullptr;
  // Per lane operand slots of the warp collectives.
  std::vector<uint64_t> slots;       // [thread][8]
  std::vector<const void*> pointers;  // [thread]
};

Block* g_block = nullptr;

void yield() {
  Block& b = *g_block;
  if (_setjmp(b.fibers[b.current].resume) == 0) _longjmp(b.scheduler, 1);
}

void wait(Barrier& barrier, unsigned count) {
  const unsigned generation = barrier.generation;
  if (++barrier.arrived == count) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  while (barrier.generation == generation) yield();
}

void fiber_entry() {
  Block& b = *g_block;
  (*b.body)();
  b.fibers[b.current].done = true;
  _longjmp(b.scheduler, 1);
}

unsigned lane() { return g_block->current % 32; }
unsigned warp_base() { return g_block->current / 32 * 32; }

float half_bits_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

uint16_t half_of(uint32_t reg, int which) { return static_cast<uint16_t>(reg >> (16 * which)); }

// mma.m16n8k16 with fp32 accumulators: every lane delivers a[4], b0, b1;
// lane (g = lane/4, t = lane%4) holds A(g, 2t..2t+1), A(g+8, ..), A(g, 2t+8..),
// A(g+8, 2t+8..); B(2t..2t+1, g), B(2t+8.., g); and gets D(g, 2t..), D(g+8, 2t..).
template <float (*ToFloat)(uint16_t)>
void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Block& b = *g_block;
  const unsigned me = b.current, base = warp_base();
  uint64_t* slot = &b.slots[me * 8];
  slot[0] = a[0];
  slot[1] = a[1];
  slot[2] = a[2];
  slot[3] = a[3];
  slot[4] = b0;
  slot[5] = b1;
  syncwarp();
  auto A = [&](int row, int col) {
    const unsigned owner = base + 4 * (row % 8) + (col % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
    return ToFloat(half_of(static_cast<uint32_t>(b.slots[owner * 8 + reg]), col % 2));
  };
  auto B = [&](int k, int n) {
    const unsigned owner = base + 4 * n + (k % 8) / 2;
    const int reg = k >= 8 ? 5 : 4;
    return ToFloat(half_of(static_cast<uint32_t>(b.slots[owner * 8 + reg]), k % 2));
  };
  const int g = static_cast<int>(lane() / 4), t = static_cast<int>(lane() % 4);
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + (e % 2);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[e] = acc;
  }
  syncwarp();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

template <bool kTrans>
void ldmatrix(uint32_t (&r)[4], const void* p) {
  Block& b = *g_block;
  const unsigned base = warp_base();
  b.pointers[b.current] = p;
  syncwarp();
  const unsigned l = lane();
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    if (!kTrans) {
      // Row l/4 of matrix m, elements 2(l%4), +1.
      const auto* row = static_cast<const uint16_t*>(b.pointers[base + 8 * m + l / 4]);
      lo = row[2 * (l % 4)];
      hi = row[2 * (l % 4) + 1];
    } else {
      // Transposed: rows 2(l%4) and +1 of matrix m, element l/4 of each.
      lo = static_cast<const uint16_t*>(b.pointers[base + 8 * m + 2 * (l % 4)])[l / 4];
      hi = static_cast<const uint16_t*>(b.pointers[base + 8 * m + 2 * (l % 4) + 1])[l / 4];
    }
    r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  syncwarp();
}

}  // namespace

Index3 thread_index() { return {g_block->current, 0, 0}; }
Index3 block_index() { return g_block->index; }
unsigned char* dynamic_smem() { return g_block->smem.data(); }

void launch(unsigned blocks, unsigned threads, size_t smem_bytes,
            const std::function<void()>& body) {
  if (threads % 32 != 0 || threads == 0) throw std::invalid_argument("threads: a multiple of 32");
  Block block;
  block.threads = threads;
  block.fibers.resize(threads);
  for (Fiber& f : block.fibers) f.stack.resize(kStackBytes);
  block.warp_barriers.resize(threads / 32);
  block.slots.resize(threads * 8);
  block.pointers.resize(threads);
  block.body = &body;
  g_block = &block;
  for (unsigned bi = 0; bi < blocks; ++bi) {
    block.index = {bi, 0, 0};
    // Garbage, not zeros: kernels must not rely on shared memory being clear.
    block.smem.assign(smem_bytes + 16, 0xA5);
    block.block_barrier = {};
    for (Barrier& w : block.warp_barriers) w = {};
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = block.fibers[t];
      f.done = f.started = false;
      getcontext(&f.start);
      f.start.uc_stack.ss_sp = f.stack.data();
      f.start.uc_stack.ss_size = f.stack.size();
      f.start.uc_link = nullptr;
      makecontext(&f.start, fiber_entry, 0);
    }
    for (bool running = true; running;) {
      running = false;
      for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = block.fibers[t];
        if (f.done) continue;
        running = true;
        block.current = t;
        if (_setjmp(block.scheduler) == 0) {
          if (f.started) _longjmp(f.resume, 1);
          f.started = true;
          swapcontext(&block.scheduler_context, &f.start);
        }
      }
    }
  }
  g_block = nullptr;
}

void syncthreads() { wait(g_block->block_barrier, g_block->threads); }
void syncwarp() { wait(g_block->warp_barriers[g_block->current / 32], 32); }

uint32_t shfl_xor_u32(uint32_t value, int lane_mask) {
  return static_cast<uint32_t>(shfl_xor_u64(value, lane_mask));
}

uint64_t shfl_xor_u64(uint64_t value, int lane_mask) {
  Block& b = *g_block;
  b.slots[b.current * 8] = value;
  syncwarp();
  const uint64_t other = b.slots[(warp_base() + (lane() ^ lane_mask)) * 8];
  syncwarp();
  return other;
}

uint64_t shfl_idx_u64(uint64_t value, int src_lane) {
  Block& b = *g_block;
  b.slots[b.current * 8] = value;
  syncwarp();
  const uint64_t other = b.slots[(warp_base() + (src_lane & 31)) * 8];
  syncwarp();
  return other;
}

void cp_async_16(void* dst, const void* src, int src_bytes) {
  std::memset(dst, 0, 16);
  if (src_bytes > 0) std::memcpy(dst, src, src_bytes);
}

void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix<false>(r, p); }
void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { ldmatrix<true>(r, p); }
void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma<half_bits_to_float>(d, a, b0, b1);
}
void mma_16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma<bf16_bits_to_float>(d, a, b0, b1);
}

}  // namespace fusedmha::cuda::emulation
