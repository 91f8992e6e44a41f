// What every `pack` shares: the GGUF-layout rows it reads and the tiles it fills.
//
// A fused projection (q|k|v, gate|up) is packed from its parts as the file holds them, read in
// place one after another: stacking them first copied the 1B shape's 0.5 GB once more at a
// first start. The tiles are not zero-filled (each is written whole by its rows), except the
// last group's when N is not a multiple of G: its padding lanes stay zero.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace octavo_quant {

struct SourceRows {
  std::vector<const uint8_t*> row;  // row r's blocks
  int64_t row_bytes = 0;
  int64_t size() const { return static_cast<int64_t>(row.size()); }
};

// The rows of `parts` (each uint8 [rows, row_bytes], contiguous, the same row_bytes), in order.
inline SourceRows source_rows(const std::vector<at::Tensor>& parts, int64_t block_bytes) {
  TORCH_CHECK(!parts.empty(), "no weight to pack");
  SourceRows s;
  for (const at::Tensor& p : parts) {
    TORCH_CHECK(p.scalar_type() == at::kByte && p.dim() == 2 && p.is_contiguous(),
                "a GGUF-layout weight is a contiguous uint8 tensor [out_features, blocks * block_bytes]");
    if (s.row.empty()) s.row_bytes = p.size(1);
    TORCH_CHECK(p.size(1) == s.row_bytes, "the parts of one layer have rows of the same bytes, got ", p.size(1),
                " and ", s.row_bytes);
    const uint8_t* base = p.data_ptr<uint8_t>();
    for (int64_t r = 0; r < p.size(0); ++r) s.row.push_back(base + r * s.row_bytes);
  }
  TORCH_CHECK(s.row_bytes % block_bytes == 0, "row of ", s.row_bytes, " bytes is not whole blocks of ", block_bytes);
  return s;
}

// uint8 [ceil(N / G), nb, tile_bytes] for the tiles of N rows in groups of G.
inline at::Tensor empty_tiles(int64_t N, int64_t G, int64_t nb, int64_t tile_bytes) {
  const int64_t groups = (N + G - 1) / G;
  at::Tensor t = at::empty({groups, nb, tile_bytes}, at::TensorOptions().dtype(at::kByte));
  if (N % G != 0) std::memset(t.data_ptr<uint8_t>() + (groups - 1) * nb * tile_bytes, 0, nb * tile_bytes);
  return t;
}

}  // namespace octavo_quant
