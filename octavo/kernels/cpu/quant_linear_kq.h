// The K-quants of "Q4_K_M" / "Q5_K_M" files (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1, held at their
// file's size (see quant_linear_kq.cpp). Same entry points as quant_linear.cpp's, which hands these format codes over.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace octavo_kq {

enum Format : int64_t { kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7 };

inline bool handles(int64_t fmt) { return fmt >= kQ5_0 && fmt <= kQ6_K; }

// One file block -> its fields: d, dmin (fp16 bits), the sub-blocks' sc, mn, and the 256 quants
// as unsigned integers (Q6_K: 0..63, before the - 32; sc its int8 scales' bytes; Q5_0 / Q5_1: 32
// quants 0..31, dmin Q5_1's m). Also read by quant_linear_i8.cpp's packing.
struct Fields {
  uint16_t d, dmin;
  uint8_t sc[16], mn[8];
  uint8_t q[256];
};
void read_block(int64_t fmt, const uint8_t* b, Fields& f);

at::Tensor pack(const std::vector<at::Tensor>& parts, int64_t fmt);
void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt);
void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N);
void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt);

}  // namespace octavo_kq
