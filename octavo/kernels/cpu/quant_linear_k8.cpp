// Q5_0 and Q5_1 weights for the CPU: out = x @ W^T, activations float32.
//
// Per block of 32 weights, w = D * q + M with D, M from the block's fp16 fields and q its 5-bit
// quants (Q5_0: D = d, q = q5 - 16, no M; Q5_1: D = d, M = m, q = q5). `pack` computes D and M
// once and widens q to int8, reordered into tiles of G output rows (G = the vector width in
// floats), one per (row group, block):
//   D[G] float32 | M[G] float32 | q[i][G] int8 for i < 32
// so one vector load gives weight i of G rows, as quant_linear.cpp's tiles do. Rebuilding a
// weight is fl(fl(D * q) + M) (no M: fl(D * q)), bit for bit gguf-py's value (no fused
// multiply-add: the build passes -ffp-contract=off). The small-batch kernel factors D and M out
// of each block: sum_i (D q_i + M) x_i = D * sum_i q_i x_i + M * sum_i x_i.
// 40 bytes per 32 weights and row, against the file's 22 / 24: Q5_0 / Q5_1 are rare in today's
// files (a fused layer holds Q5_0 as Q8_0); the K-quants are held at their file's size
// (quant_linear_kq.cpp).
#include "quant_linear_k8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_isa.h"

namespace octavo_k8 {
namespace {

using octavo_quant::fp16_to_float;
using octavo_quant::Isa;
using octavo_quant::load_u16;
using V = Isa::V;
constexpr int G = Isa::G;
constexpr int MAX_R = G == 16 ? 8 : 4;

struct Spec {
  int64_t block_weights;  // weights per GGUF block
  int64_t block_bytes;
  int64_t sub;  // S: weights per sub-block (one D and M)
  bool has_m;
};

Spec spec(int64_t fmt) {
  switch (fmt) {
    case kQ5_0: return {32, 22, 32, false};
    case kQ5_1: return {32, 24, 32, true};
    default: TORCH_CHECK(false, "unknown K8 format ", fmt);
  }
}

inline int64_t tile_bytes(int64_t sub) { return G * (8 + sub); }

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One GGUF block of one row -> D, M and q of its sub-blocks (q: block_weights int8 values).
void decode_block(int64_t fmt, const uint8_t* b, float* D, float* M, int8_t* q) {
  {
    const int64_t qh_at = fmt == kQ5_0 ? 2 : 4;
    const uint32_t qh = load_u32(b + qh_at);
    const uint8_t* qs = b + qh_at + 4;
    const int offset = fmt == kQ5_0 ? 16 : 0;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<int8_t>(((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - offset);
      q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset);
    }
    D[0] = fp16_to_float(load_u16(b));
    M[0] = fmt == kQ5_1 ? fp16_to_float(load_u16(b + 2)) : 0.f;
  }
}

// out[r][0..G) for rows r < R of one group over its sub-blocks. xs: per-row sums of x per sub-block.
template <int64_t S, bool HAS_M, int R>
inline void group_small(const float* x, int64_t K, const uint8_t* tiles, const float* xs, int64_t nsub, float* out,
                        int64_t out_stride, int64_t cols) {
  constexpr int64_t TB = G * (8 + S);
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Isa::zero();
  for (int64_t b = 0; b < nsub; ++b) {
    const uint8_t* t = tiles + b * TB;
    const uint8_t* q = t + 8 * G;
    for (int64_t l = 0; l < TB; l += 64) __builtin_prefetch(t + 4 * TB + l, 0, 3);
    V s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero();
    for (int i = 0; i < S; i += 2) {
      const V w0 = Isa::to_float(Isa::bytes_s(q + i * G)), w1 = Isa::to_float(Isa::bytes_s(q + (i + 1) * G));
      for (int r = 0; r < R; ++r) {
        s0[r] = Isa::fma(w0, Isa::set1(x[r * K + b * S + i]), s0[r]);
        s1[r] = Isa::fma(w1, Isa::set1(x[r * K + b * S + i + 1]), s1[r]);
      }
    }
    const V D = Isa::load(reinterpret_cast<const float*>(t));
    for (int r = 0; r < R; ++r) acc[r] = Isa::fma(D, Isa::add(s0[r], s1[r]), acc[r]);
    if constexpr (HAS_M) {
      const V M = Isa::load(reinterpret_cast<const float*>(t + 4 * G));
      for (int r = 0; r < R; ++r) acc[r] = Isa::fma(M, Isa::set1(xs[r * nsub + b]), acc[r]);
    }
  }
  octavo_quant::store_rows(acc, R, cols, out, out_stride);
}

template <int64_t S, bool HAS_M, int R = MAX_R>
inline void group_rows(const float* x, int64_t M, int64_t K, const uint8_t* tiles, const float* xs, int64_t nsub,
                       float* out, int64_t N, int64_t cols) {
  if constexpr (R > 0) {
    if (M == R) return group_small<S, HAS_M, R>(x, K, tiles, xs, nsub, out, N, cols);
    return group_rows<S, HAS_M, R - 1>(x, M, K, tiles, xs, nsub, out, N, cols);
  }
}

template <int64_t S, bool HAS_M>
void run(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, float* out) {
  const int64_t nsub = K / S, num_groups = (N + G - 1) / G, group_bytes = nsub * tile_bytes(S);
  // sums of x per sub-block (the M term)
  const std::vector<float> xs = HAS_M ? octavo_quant::block_sums(x, M, K, S, [](int64_t b, int64_t e, int64_t g, const auto& f) {
    at::parallel_for(b, e, g, f);
  }) : std::vector<float>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tiles = packed + g * group_bytes;
      const int64_t cols = std::min<int64_t>(G, N - g * G);
      for (int64_t m = 0; m < M; m += MAX_R) {
        const int64_t rows = std::min<int64_t>(MAX_R, M - m);
        group_rows<S, HAS_M>(x + m * K, rows, K, tiles, HAS_M ? xs.data() + m * nsub : nullptr, nsub,
                             out + m * N + g * G, N, cols);
      }
    }
  });
}

// Weight k of row c of a group, rebuilt: fl(fl(D * q) + M), or fl(D * q) without M.
inline float rebuild(const uint8_t* tile, int64_t i, int64_t c, bool has_m) {
  const float* D = reinterpret_cast<const float*>(tile);
  const float* M = reinterpret_cast<const float*>(tile + 4 * G);
  const float w = D[c] * static_cast<float>(static_cast<int8_t>(tile[8 * G + i * G + c]));
  return has_m ? w + M[c] : w;
}

void check_packed(const at::Tensor& packed, int64_t fmt, int64_t N, int64_t K) {
  const Spec sp = spec(fmt);
  TORCH_CHECK(K % sp.block_weights == 0, "in_features must be a multiple of ", sp.block_weights, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + G - 1) / G && packed.size(1) == K / sp.sub &&
                  packed.size(2) == tile_bytes(sp.sub),
              "packed weight must be uint8 [ceil(N / ", G, "), K / ", sp.sub, ", ", tile_bytes(sp.sub),
              "] (from `pack`)");
}

}  // namespace

// GGUF blocks uint8 [N, K / block_weights * block_bytes] -> packed uint8 [ceil(N / G), K / S, tile bytes].
at::Tensor pack(at::Tensor qweight, int64_t fmt) {
  const Spec sp = spec(fmt);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "a GGUF-layout weight is a contiguous uint8 tensor [out_features, blocks * block_bytes]");
  TORCH_CHECK(qweight.size(1) % sp.block_bytes == 0, "row of ", qweight.size(1), " bytes is not whole blocks of ",
              sp.block_bytes);
  const int64_t N = qweight.size(0), nb = qweight.size(1) / sp.block_bytes;
  const int64_t subs_per_block = sp.block_weights / sp.sub, nsub = nb * subs_per_block;
  const int64_t num_groups = (N + G - 1) / G, tb = tile_bytes(sp.sub);
  auto packed = at::zeros({num_groups, nsub, tb}, qweight.options());
  const uint8_t* src = qweight.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    float D[1], M[1];
    int8_t q[32];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < G && g * G + c < N; ++c)
        for (int64_t b = 0; b < nb; ++b) {
          decode_block(fmt, src + ((g * G + c) * nb + b) * sp.block_bytes, D, M, q);
          for (int64_t s = 0; s < subs_per_block; ++s) {
            uint8_t* t = dst + (g * nsub + b * subs_per_block + s) * tb;
            std::memcpy(t + 4 * c, &D[s], 4);
            std::memcpy(t + 4 * G + 4 * c, &M[s], 4);
            for (int64_t i = 0; i < sp.sub; ++i) {
              t[8 * G + i * G + c] = static_cast<uint8_t>(q[s * sp.sub + i]);
            }
          }
        }
  });
  return packed;
}

void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  check_packed(packed, fmt, N, K);
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (fmt) {
    case kQ5_0: return run<32, false>(xp, M, K, pp, N, op);
    default: return run<32, true>(xp, M, K, pp, N, op);
  }
}

void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N) {
  const Spec sp = spec(fmt);
  const int64_t K = out.size(1), nsub = K / sp.sub, tb = tile_bytes(sp.sub);
  check_packed(packed, fmt, N, K);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t j = 0; j < rows.size(0); ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < N, "row ", rp[j], " out of range [0, ", N, ")");
  at::parallel_for(0, rows.size(0), 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t g = rp[j] / G, c = rp[j] % G;
      for (int64_t b = 0; b < nsub; ++b)
        for (int64_t i = 0; i < sp.sub; ++i)
          op[j * K + b * sp.sub + i] = rebuild(pp + (g * nsub + b) * tb, i, c, sp.has_m);
    }
  });
}

void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt) {
  const Spec sp = spec(fmt);
  const int64_t K = out.size(0), N = out.size(1), nsub = K / sp.sub, tb = tile_bytes(sp.sub);
  check_packed(packed, fmt, N, K);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nsub; ++b) {
        const uint8_t* t = pp + (g * nsub + b) * tb;
        const V D = Isa::load(reinterpret_cast<const float*>(t)), Mv = Isa::load(reinterpret_cast<const float*>(t + 4 * G));
        for (int64_t i = 0; i < sp.sub; ++i) {
          const auto q = Isa::bytes_s(t + 8 * G + i * G);
          V w = Isa::mul(Isa::to_float(q), D);
          if (sp.has_m) w = Isa::add(w, Mv);
          Isa::store(op + (b * sp.sub + i) * N + g * G, w);
        }
      }
  });
}

}  // namespace octavo_k8
