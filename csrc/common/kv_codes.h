#pragma once

// The value of one quantized K/V code (KVStorage: int8, float8_e4m3fn or
// float8_e5m2), for host and device: the CUDA kernels' reads and the CPU
// kernels' scalar tails. Written out rather than through c10's fp8 types:
// their conversions are inline functions that an ISA level's object would
// define, and the linker could keep that copy for the baseline code
// (cmake/CheckNoSharedSymbols.cmake); nor are they device code.

#include "common/attention_types.h"
#include "common/philox.h"  // (FUSEDMHA_HOST_DEVICE)

#include <cstdint>
#include <cstring>

namespace fusedmha {

FUSEDMHA_HOST_DEVICE float float_of_bits(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

FUSEDMHA_HOST_DEVICE float code_value(KVStorage s, uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80) << 24;
  const float nan = float_of_bits(0x7FC00000u);
  switch (s) {
    case KVStorage::Int8: return static_cast<float>(static_cast<int8_t>(c));
    case KVStorage::Float8E4M3: {  // (bias 7, no infinities, 0x7F in magnitude is NaN)
      const uint32_t magnitude = c & 0x7F;
      if (magnitude == 0x7F) return nan;
      if (magnitude < 8) {  // (subnormal: magnitude · 2^-9, exact)
        const float x = static_cast<float>(magnitude) * 0.001953125f;
        return sign ? -x : x;
      }
      return float_of_bits(sign | ((magnitude << 20) + (120u << 23)));
    }
    case KVStorage::Float8E5M2: {  // (bias 15: an fp16's high byte)
      const uint32_t exponent = (c >> 2) & 0x1F, mantissa = c & 3;
      if (exponent == 0x1F) return mantissa ? nan : float_of_bits(sign | 0x7F800000u);
      if (exponent == 0) {  // (subnormal: mantissa · 2^-16, exact)
        const float x = static_cast<float>(mantissa) * 0.0000152587890625f;
        return sign ? -x : x;
      }
      return float_of_bits(sign | ((exponent + 112) << 23) | (mantissa << 21));
    }
    case KVStorage::Dense: break;
  }
  return 0.0f;
}

}  // namespace fusedmha
