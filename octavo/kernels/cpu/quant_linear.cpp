// Weight-only quantized linear layers for the CPU: out = x @ W^T, W in a GGML block format
// (Q4_0, Q4_1, Q8_0: 32 consecutive weights of a row share an fp16 scale d, Q4_1 also an fp16 min
// m; MXFP4: an E8M0 exponent), activations float32. Q5_0, Q5_1 and the K-quants go to
// quant_linear_kq.cpp.
//
// GGUF layout (what `pack` takes): uint8 [N, K / 32 * block_bytes], each row K / 32 blocks of
//   Q4_0 (18 bytes): d, 16 bytes of nibbles          w = d * (q - 8)
//   Q4_1 (20 bytes): d, m, 16 bytes of nibbles       w = d * q + m
//   Q8_0 (34 bytes): d, 32 int8                       w = d * q
//   MXFP4 (17 bytes): e, 16 bytes of nibbles         w = 2^(e - 128) * k[q]
// where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high
// one, and k is MXFP4's table of doubled e2m1 values (gpt-oss's experts; gguf-py's arithmetic).
//
// Packed layout (what the kernels read; the same bytes, reordered once at load): rows go in groups
// of G = the vector width in floats (16 with AVX-512, 8 otherwise), padded with zero rows. For
// group g and block b there is one tile:
//   d[G] fp16 (MXFP4: e[G] bytes) | m[G] fp16 (Q4_1 only) | q[i][G] for i < 16 (4-bit: bytes,
//   weights i and i + 16 of the G rows) or i < 32 (Q8_0: int8)
// so one vector load gives weight i of G output rows: the lanes are output columns, x[k] is a
// broadcast, and a weight costs about three vector instructions, not the eight of rebuilding it in
// row order (measured: 2x on Q4_1 at batch 1; docs/BENCHMARKS.md).
//
// Arithmetic: the scale is factored out of each block,
//   sum_i (d q_i + m) x_i = d * sum_i q_i x_i + m * sum_i x_i       (Q4_0: m = -8 d)
// with up to MAX_R rows sharing each weight's conversion (MXFP4: k[q] looked up as a float, then
// sum_i 2^(e - 128) k[q_i] x_i = 2^(e - 128) * sum_i k[q_i] x_i). For steps of many rows the caller can
// instead rebuild W^T (`dequantize_transposed`: each weight exactly as gguf-py computes it) and
// run a float32 GEMM. Either way the model is the GGUF's dequantized weights; only the order of
// the float sums differs, as between two GEMM libraries.
#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packing.h"
#include "quant_isa.h"
#include "quant_linear_kq.h"

namespace {

using octavo_quant::fp16_to_float;
using octavo_quant::Isa;
using octavo_quant::load_u16;

enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kMXFP4 = 8 };
constexpr int64_t QK = 32;

constexpr int64_t block_bytes(int64_t fmt) { return fmt == kQ4_0 ? 18 : fmt == kQ4_1 ? 20 : fmt == kMXFP4 ? 17 : 34; }
// MXFP4's values, doubled e2m1 (index 8 is +0, as gguf-py's table)
alignas(64) constexpr float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

using V = Isa::V;
constexpr int G = Isa::G;
// Rows per register tile: 3 vectors per row (sum, two partial chains) must fit the register file
// (32 vector registers with AVX-512, 16 with AVX2).
constexpr int MAX_R = G == 16 ? 8 : 4;

// Bytes of one (group, block) tile, and where its parts start.
constexpr int64_t tile_bytes(int64_t fmt) { return G * block_bytes(fmt); }
constexpr int64_t q_offset(int64_t fmt) { return fmt == kQ4_1 ? 4 * G : fmt == kMXFP4 ? G : 2 * G; }

// ---- decode: up to SMALL_M rows, scales factored out of each block ------------------------------

// out[r][0..G) for rows r < R of one group. xs: per-row block sums of x [R][nb].
template <int64_t F, int R>
inline void group_small(const float* x, int64_t K, const uint8_t* tiles, const float* xs, int64_t nb, float* out,
                        int64_t out_stride, int64_t cols) {
  constexpr int64_t TB = tile_bytes(F), QO = q_offset(F);
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Isa::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * TB;
    const uint8_t* q = t + QO;
    octavo_quant::prefetch_ahead<TB>(t);
    V s0[R], s1[R];  // two chains per row: half the latency of one
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero();
    if constexpr (F == kQ8_0) {
      for (int i = 0; i < QK; i += 2) {
        const V w0 = Isa::to_float(Isa::bytes_s(q + i * G)), w1 = Isa::to_float(Isa::bytes_s(q + (i + 1) * G));
        for (int r = 0; r < R; ++r) {
          s0[r] = Isa::fma(w0, Isa::set1(x[r * K + b * QK + i]), s0[r]);
          s1[r] = Isa::fma(w1, Isa::set1(x[r * K + b * QK + i + 1]), s1[r]);
        }
      }
    } else if constexpr (F == kMXFP4) {
      const auto table = Isa::lut_load(MXFP4_VALUES);
      for (int i = 0; i < 16; ++i) {
        const auto v = Isa::bytes_u(q + i * G);
        const V lo = Isa::lut16(Isa::low_nibble(v), table), hi = Isa::lut16(Isa::high_nibble(v), table);
        for (int r = 0; r < R; ++r) {
          s0[r] = Isa::fma(lo, Isa::set1(x[r * K + b * QK + i]), s0[r]);
          s1[r] = Isa::fma(hi, Isa::set1(x[r * K + b * QK + 16 + i]), s1[r]);
        }
      }
    } else {
      for (int i = 0; i < 16; ++i) {
        const auto v = Isa::bytes_u(q + i * G);
        const V lo = Isa::to_float(Isa::low_nibble(v)), hi = Isa::to_float(Isa::high_nibble(v));
        for (int r = 0; r < R; ++r) {
          s0[r] = Isa::fma(lo, Isa::set1(x[r * K + b * QK + i]), s0[r]);
          s1[r] = Isa::fma(hi, Isa::set1(x[r * K + b * QK + 16 + i]), s1[r]);
        }
      }
    }
    if constexpr (F == kQ8_0 || F == kMXFP4) {
      const V d = F == kQ8_0 ? Isa::halves(t) : Isa::e8m0_half(t);
      for (int r = 0; r < R; ++r) acc[r] = Isa::fma(d, Isa::add(s0[r], s1[r]), acc[r]);
    } else {
      // Q4_1: + m * sum(x); Q4_0: the "- 8" of every weight is m = -8 d (exact: a power of two).
      const V d = Isa::halves(t);
      const V m = F == kQ4_1 ? Isa::halves(t + 2 * G) : Isa::mul(d, Isa::set1(-8.f));
      for (int r = 0; r < R; ++r) {
        acc[r] = Isa::fma(d, Isa::add(s0[r], s1[r]), acc[r]);
        acc[r] = Isa::fma(m, Isa::set1(xs[r * nb + b]), acc[r]);
      }
    }
  }
  octavo_quant::store_rows(acc, R, cols, out, out_stride);
}

// ---- many rows: rebuild W^T once, for a float32 GEMM ------------------------------------------

// Weights of one group as float32, k-major: w[k * stride + c] = weight k of the group's row c,
// with gguf-py's arithmetic: d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1), 2^(e - 128) * k[q]
// (MXFP4: k[q] and the power of two are exact, so is their product).
template <int64_t F>
inline void rebuild_group(const uint8_t* tiles, int64_t nb, float* w, int64_t stride) {
  constexpr int64_t TB = tile_bytes(F), QO = q_offset(F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * TB;
    const uint8_t* q = t + QO;
    float* wb = w + b * QK * stride;
    if constexpr (F == kMXFP4) {
      const V d = Isa::e8m0_half(t);
      const auto table = Isa::lut_load(MXFP4_VALUES);
      for (int i = 0; i < 16; ++i) {
        const auto v = Isa::bytes_u(q + i * G);
        Isa::store(wb + i * stride, Isa::mul(Isa::lut16(Isa::low_nibble(v), table), d));
        Isa::store(wb + (16 + i) * stride, Isa::mul(Isa::lut16(Isa::high_nibble(v), table), d));
      }
      continue;
    }
    const V d = Isa::halves(t);
    if constexpr (F == kQ8_0) {
      for (int i = 0; i < QK; ++i) Isa::store(wb + i * stride, Isa::mul(Isa::to_float(Isa::bytes_s(q + i * G)), d));
    } else {
      const V m = F == kQ4_1 ? Isa::halves(t + 2 * G) : Isa::zero();
      for (int i = 0; i < 16; ++i) {
        const auto v = Isa::bytes_u(q + i * G);
        auto lo = Isa::low_nibble(v), hi = Isa::high_nibble(v);
        if constexpr (F == kQ4_0) {
          Isa::store(wb + i * stride, Isa::mul(d, Isa::to_float(Isa::sub8(lo))));
          Isa::store(wb + (16 + i) * stride, Isa::mul(d, Isa::to_float(Isa::sub8(hi))));
        } else {
          Isa::store(wb + i * stride, Isa::add(Isa::mul(d, Isa::to_float(lo)), m));
          Isa::store(wb + (16 + i) * stride, Isa::add(Isa::mul(d, Isa::to_float(hi)), m));
        }
      }
    }
  }
}

template <int64_t F, int R = MAX_R>
inline void group_rows(const float* x, int64_t M, int64_t K, const uint8_t* tiles, const float* xs, int64_t nb,
                       float* out, int64_t N, int64_t cols) {
  if constexpr (R > 0) {
    if (M == R) return group_small<F, R>(x, K, tiles, xs, nb, out, N, cols);
    return group_rows<F, R - 1>(x, M, K, tiles, xs, nb, out, N, cols);
  }
}

template <int64_t F>
void run(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, float* out) {
  const int64_t nb = K / QK, num_groups = (N + G - 1) / G, group_bytes = nb * tile_bytes(F);
  // block sums of x (the m term: Q4_0, Q4_1; Q8_0 and MXFP4 have none, their values are the weights')
  constexpr bool has_m = F == kQ4_0 || F == kQ4_1;
  const std::vector<float> xs = has_m ? octavo_quant::block_sums(x, M, K, QK, [](int64_t b, int64_t e, int64_t g, const auto& f) {
    at::parallel_for(b, e, g, f);
  }) : std::vector<float>();
  // Each group's tiles (K / 32 x tile_bytes: a few KB) stay in L1 while every row chunk uses them.
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tiles = packed + g * group_bytes;
      const int64_t cols = std::min<int64_t>(G, N - g * G);
      for (int64_t m = 0; m < M; m += MAX_R) {
        const int64_t rows = std::min<int64_t>(MAX_R, M - m);
        group_rows<F>(x + m * K, rows, K, tiles, has_m ? xs.data() + m * nb : nullptr, nb, out + m * N + g * G, N, cols);
      }
    }
  });
}

void check_format(int64_t fmt) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0 || fmt == kMXFP4, "unknown quantization format ", fmt);
}

void check_packed(const at::Tensor& packed, int64_t fmt, int64_t N, int64_t K) {
  check_format(fmt);
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + G - 1) / G && packed.size(1) == K / QK && packed.size(2) == tile_bytes(fmt),
              "packed weight must be uint8 [ceil(N / ", G, "), K / 32, ", tile_bytes(fmt), "] (from `pack`)");
}

}  // namespace

// GGUF blocks uint8 [N, K / 32 * block_bytes] (or the parts of a fused layer, stacked by rows)
// -> packed uint8 [ceil(N / G), K / 32, tile_bytes].
at::Tensor pack(const std::vector<at::Tensor>& parts, int64_t fmt) {
  if (octavo_kq::handles(fmt)) return octavo_kq::pack(parts, fmt);
  check_format(fmt);
  const int64_t bb = block_bytes(fmt);
  const octavo_quant::SourceRows src = octavo_quant::source_rows(parts, bb);
  const int64_t N = src.size(), nb = src.row_bytes / bb, num_groups = (N + G - 1) / G;
  auto packed = octavo_quant::empty_tiles(N, G, nb, tile_bytes(fmt));
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t qo = q_offset(fmt), num_q = fmt == kQ8_0 ? QK : 16;
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* t = dst + (g * nb + b) * tile_bytes(fmt);
        for (int64_t c = 0; c < G && g * G + c < N; ++c) {
          const uint8_t* blk = src.row[g * G + c] + b * bb;
          if (fmt == kMXFP4) {
            t[c] = blk[0];  // e
          } else {
            std::memcpy(t + 2 * c, blk, 2);                                 // d
            if (fmt == kQ4_1) std::memcpy(t + 2 * G + 2 * c, blk + 2, 2);  // m
          }
          const uint8_t* q = blk + (fmt == kQ4_1 ? 4 : fmt == kMXFP4 ? 1 : 2);
          for (int64_t i = 0; i < num_q; ++i) t[qo + i * G + c] = q[i];
        }
      }
  });
  return packed;
}

// out [M, N] = x [M, K] @ W^T; x and out float32, contiguous; W packed.
void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear takes float32 activations");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(), "x, out: contiguous 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "out must have as many rows as x");
  if (octavo_kq::handles(fmt)) return octavo_kq::quant_linear(out, x, packed, fmt);
  check_packed(packed, fmt, N, K);
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (fmt) {
    case kQ4_0: return run<kQ4_0>(xp, M, K, pp, N, op);
    case kQ4_1: return run<kQ4_1>(xp, M, K, pp, N, op);
    case kMXFP4: return run<kMXFP4>(xp, M, K, pp, N, op);
    default: return run<kQ8_0>(xp, M, K, pp, N, op);
  }
}

// out [len(rows), K] float32 = rows `rows` of W, exactly as gguf-py rebuilds them (the embedding
// lookup; all rows: the whole weight).
void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(), "out: contiguous float32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && rows.size(0) == out.size(0),
              "rows: int64 [len(out)]");
  if (octavo_kq::handles(fmt)) return octavo_kq::dequantize_rows(out, packed, fmt, rows, N);
  const int64_t K = out.size(1), nb = K / QK;
  check_packed(packed, fmt, N, K);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t tb = tile_bytes(fmt), qo = q_offset(fmt);
  for (int64_t j = 0; j < rows.size(0); ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < N, "row ", rp[j], " out of range [0, ", N, ")");
  at::parallel_for(0, rows.size(0), 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t g = rp[j] / G, c = rp[j] % G;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* t = pp + (g * nb + b) * tb;
        const uint8_t* q = t + qo;
        float* w = op + j * K + b * QK;
        if (fmt == kMXFP4) {
          const float d = octavo_quant::e8m0_to_float_half(t[c]);
          for (int i = 0; i < 16; ++i) {
            w[i] = MXFP4_VALUES[q[i * G + c] & 0x0f] * d;
            w[i + 16] = MXFP4_VALUES[q[i * G + c] >> 4] * d;
          }
          continue;
        }
        const float d = fp16_to_float(load_u16(t + 2 * c));
        if (fmt == kQ8_0) {
          for (int i = 0; i < QK; ++i) w[i] = static_cast<float>(static_cast<int8_t>(q[i * G + c])) * d;
        } else if (fmt == kQ4_0) {
          for (int i = 0; i < 16; ++i) {
            w[i] = d * static_cast<float>(static_cast<int>(q[i * G + c] & 0x0f) - 8);
            w[i + 16] = d * static_cast<float>(static_cast<int>(q[i * G + c] >> 4) - 8);
          }
        } else {
          const float m = fp16_to_float(load_u16(t + 2 * G + 2 * c));
          for (int i = 0; i < 16; ++i) {
            w[i] = d * static_cast<float>(q[i * G + c] & 0x0f) + m;
            w[i + 16] = d * static_cast<float>(q[i * G + c] >> 4) + m;
          }
        }
      }
    }
  });
}

// out [K, ceil(N / G) * G] float32 = W^T (padding columns zero), each weight exactly as gguf-py
// rebuilds it: for a step of many rows a float32 GEMM on the rebuilt weight beats the factored
// kernel (which reaches about 2/3 of the FMA peak; docs/BENCHMARKS.md).
void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() && out.size(1) % G == 0,
              "out: contiguous float32 [K, groups * ", G, "]");
  if (octavo_kq::handles(fmt)) return octavo_kq::dequantize_transposed(out, packed, fmt);
  const int64_t K = out.size(0), N = out.size(1), nb = K / QK;
  check_packed(packed, fmt, N, K);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t group_bytes = nb * tile_bytes(fmt);
  at::parallel_for(0, N / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (fmt == kQ4_0) rebuild_group<kQ4_0>(pp + g * group_bytes, nb, op + g * G, N);
      else if (fmt == kQ4_1) rebuild_group<kQ4_1>(pp + g * group_bytes, nb, op + g * G, N);
      else if (fmt == kMXFP4) rebuild_group<kMXFP4>(pp + g * group_bytes, nb, op + g * G, N);
      else rebuild_group<kQ8_0>(pp + g * group_bytes, nb, op + g * G, N);
    }
  });
}

const char* quant_isa() { return Isa::name; }
int64_t pack_width() { return G; }
