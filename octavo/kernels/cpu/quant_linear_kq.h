// The K-quants of "Q4_K_M" / "Q5_K_M" files (Q4_K, Q5_K, Q6_K) held at their file's size (see
// quant_linear_kq.cpp). Same entry points as quant_linear.cpp's, which hands these format codes over.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

namespace octavo_kq {

enum Format : int64_t { kQ4_K = 5, kQ5_K = 6, kQ6_K = 7 };

inline bool handles(int64_t fmt) { return fmt == kQ4_K || fmt == kQ5_K || fmt == kQ6_K; }

at::Tensor pack(at::Tensor qweight, int64_t fmt);
void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt);
void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N);
void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt);

}  // namespace octavo_kq
