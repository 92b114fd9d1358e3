#pragma once

// A dense (B, H, rows, cols) array as the Matrix the CUDA kernels read:
// shared by the emulated tests (test_cuda_emulated.cpp, test_cuda_mask_tiles.cpp).

#include "common/attention_params.h"

#include <vector>

namespace fusedmha::cuda {

template <typename A>
Matrix dense(std::vector<A>& values, int H, int rows, int cols) {
  Matrix m;
  m.data = values.data();
  m.outer_stride[0] = int64_t(H) * rows * cols;
  m.outer_stride[1] = int64_t(rows) * cols;
  m.row_stride = cols;
  return m;
}

}  // namespace fusedmha::cuda
