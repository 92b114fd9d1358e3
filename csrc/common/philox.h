#pragma once

// Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11): a counter-based generator, so any element's random number is a
// pure function of (key, counter) and the backward regenerates the forward's
// dropout mask without storing it. Plain C++, compiled for the host and, by
// nvcc, for the device: the CUDA kernels call it as is, so CPU and CUDA drop
// the same elements for the same (seed, offset). The CPU kernels use a
// vectorised copy of the same rounds (cpu/dropout_lanes.h), which tests
// check against this.

#include <cstdint>

#if defined(__CUDACC__)
#define FUSEDMHA_HOST_DEVICE __host__ __device__ __forceinline__
#else
// Always inlined: the CPU kernels are compiled once per ISA level, and an
// out-of-line copy emitted by the AVX-512 objects could be the one the
// linker keeps for baseline callers (cmake/CheckNoSharedSymbols.cmake, a
// test of tests/cpp, checks that none is emitted).
#define FUSEDMHA_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace fusedmha {

struct Philox4x32 {
  uint32_t v[4];
};

FUSEDMHA_HOST_DEVICE Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// The dropout stream of fusedmha: element (outer index o, query row i, key
// column j) of an attention call with rng state (seed, offset) is kept iff
// its 32-bit number is >= threshold(p). One Philox call covers 4 consecutive
// columns: counter (j / 4, i, o, offset), key = the seed's two halves.
// A call on a part of a longer sequence (a ring step of context
// parallelism) counts its rows and columns from where the part starts in
// it, row and 4·col4, and so draws the numbers of the whole sequence.
struct DropoutStream {
  uint64_t seed = 0;
  uint64_t offset = 0;
  int64_t row = 0;
  int64_t col4 = 0;

  FUSEDMHA_HOST_DEVICE Philox4x32 block(int64_t o, int64_t i, int64_t j4) const {
    return philox4x32_10(static_cast<uint32_t>(j4 + col4), static_cast<uint32_t>(i + row),
                         static_cast<uint32_t>(o), counter3(o), static_cast<uint32_t>(seed),
                         static_cast<uint32_t>(seed >> 32));
  }

  // The counter's last word: the call's offset, mixed with the outer index's
  // high bits.
  FUSEDMHA_HOST_DEVICE uint32_t counter3(int64_t o) const {
    return static_cast<uint32_t>(offset) ^ static_cast<uint32_t>(static_cast<uint64_t>(o) >> 32);
  }
};

// Numbers below this are dropped: a fraction p of the 2^32 values.
inline uint32_t dropout_threshold(double p) {
  const double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace fusedmha
