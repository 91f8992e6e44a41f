// Quantized linear layers for Q5_0 and Q5_1 blocks, widened to int8 quants (see quant_linear_k8.cpp). Same entry points as quant_linear.cpp's,
// which hands these format codes over.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

namespace octavo_k8 {

enum Format : int64_t { kQ5_0 = 3, kQ5_1 = 4 };

inline bool handles(int64_t fmt) { return fmt == kQ5_0 || fmt == kQ5_1; }

at::Tensor pack(at::Tensor qweight, int64_t fmt);
void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt);
void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N);
void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt);

}  // namespace octavo_k8
