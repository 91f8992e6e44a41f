// Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights for the CPU: out = x @ W^T, activations float32.
//
// Every one of these formats is, per sub-block of S weights (S = 16 for Q6_K, 32 for the rest),
// w = D * q + M with small integer q, where D and M are what gguf-py computes in float32 from the
// block's fp16 and 6/8-bit fields:
//   Q5_0: D = d, q = q5 - 16, no M          Q5_1: D = d, M = m, q = q5
//   Q4_K / Q5_K: D = d * sc, M = -(dmin * mn), q = q4 / q5 (sc, mn: the sub-block's 6-bit fields)
//   Q6_K: D = d * sc (sc: int8), q = q6 - 32, no M
// `pack` computes D and M once and widens q to int8, reordered into tiles of G output rows (G =
// the vector width in floats), one per (row group, sub-block):
//   D[G] float32 | M[G] float32 | q[i][G] int8 for i < S
// so one vector load gives weight i of G rows, as quant_linear.cpp's tiles do. Q4_K's q (0..15)
// are kept as nibbles instead: byte c of pair p holds q[2p][c] | q[2p + 1][c] << 4, 24 bytes per
// 32 weights and row against 40 (its layers are a tenth of a Gemma 3 decode step's bytes). Rebuilding a
// weight is fl(fl(D * q) + M) (no M: fl(D * q)), bit for bit gguf-py's value (no fused
// multiply-add: the build passes -ffp-contract=off). The small-batch kernel factors D and M out
// of each sub-block: sum_i (D q_i + M) x_i = D * sum_i q_i x_i + M * sum_i x_i.
// The other formats' q are kept as int8 (8 bits a weight plus 64 bits of D and M per sub-block)
// rather than in the file's 5.5 to 6.6 bits: exact, one code path; their fifth and sixth bit
// planes are a further step (docs/BENCHMARKS.md has the measured cost).
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
  bool nib;  // q in 0..15, two per byte in the tiles
};

Spec spec(int64_t fmt) {
  switch (fmt) {
    case kQ5_0: return {32, 22, 32, false, false};
    case kQ5_1: return {32, 24, 32, true, false};
    case kQ4_K: return {256, 144, 32, true, true};
    case kQ5_K: return {256, 176, 32, true, false};
    case kQ6_K: return {256, 210, 16, false, false};
    default: TORCH_CHECK(false, "unknown K8 format ", fmt);
  }
}

inline int64_t tile_bytes(int64_t sub, bool nib) { return G * (8 + (nib ? sub / 2 : sub)); }

// The quant of weight i of column c in a tile's q area (int8, or nibbles of pairs).
inline int q_at(const uint8_t* q, int64_t i, int64_t c, bool nib) {
  if (!nib) return static_cast<int8_t>(q[i * G + c]);
  return (q[(i / 2) * G + c] >> (4 * (i % 2))) & 0x0f;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One GGUF block of one row -> D, M and q of its sub-blocks (q: block_weights int8 values).
void decode_block(int64_t fmt, const uint8_t* b, float* D, float* M, int8_t* q) {
  if (fmt == kQ5_0 || fmt == kQ5_1) {
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
  } else if (fmt == kQ4_K || fmt == kQ5_K) {
    const float d = fp16_to_float(load_u16(b)), dmin = fp16_to_float(load_u16(b + 2));
    const uint8_t* s = b + 4;  // 12 bytes: 6-bit scales and mins of 8 sub-blocks
    const uint8_t* qh = b + 16;  // Q5_K: bit i of byte j is sub-block i's weight j's fifth bit
    const uint8_t* qs = b + (fmt == kQ4_K ? 16 : 48);
    for (int i = 0; i < 8; ++i) {
      const int sc = i < 4 ? (s[i] & 63) : ((s[i + 4] & 0x0f) | ((s[i - 4] >> 2) & 0x30));
      const int mn = i < 4 ? (s[i + 4] & 63) : ((s[i + 4] >> 4) | ((s[i] >> 2) & 0x30));
      D[i] = d * static_cast<float>(sc);
      M[i] = -(dmin * static_cast<float>(mn));
      const uint8_t* chunk = qs + 32 * (i / 2);  // sub-blocks 2c and 2c + 1 share 32 bytes
      for (int j = 0; j < 32; ++j) {
        int v = i % 2 == 0 ? (chunk[j] & 0x0f) : (chunk[j] >> 4);
        if (fmt == kQ5_K) v |= ((qh[j] >> i) & 1) << 4;
        q[32 * i + j] = static_cast<int8_t>(v);
      }
    }
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16_to_float(load_u16(b + 208));
    for (int i = 0; i < 16; ++i) {
      D[i] = d * static_cast<float>(sc[i]);
      M[i] = 0.f;
    }
    for (int h = 0; h < 2; ++h)
      for (int w = 0; w < 128; ++w) {
        const int low = w < 64 ? (ql[64 * h + w] & 0x0f) : (ql[64 * h + w - 64] >> 4);
        const int high = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
        q[128 * h + w] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
  }
}

// out[r][0..G) for rows r < R of one group over its sub-blocks. xs: per-row sums of x per sub-block.
template <int64_t S, bool HAS_M, bool NIB, int R>
inline void group_small(const float* x, int64_t K, const uint8_t* tiles, const float* xs, int64_t nsub, float* out,
                        int64_t out_stride, int64_t cols) {
  constexpr int64_t TB = G * (8 + (NIB ? S / 2 : S));
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Isa::zero();
  for (int64_t b = 0; b < nsub; ++b) {
    const uint8_t* t = tiles + b * TB;
    const uint8_t* q = t + 8 * G;
    for (int64_t l = 0; l < TB; l += 64) __builtin_prefetch(t + 4 * TB + l, 0, 3);
    V s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero();
    for (int i = 0; i < S; i += 2) {
      V w0, w1;
      if constexpr (NIB) {
        const auto pair = Isa::bytes_u(q + (i / 2) * G);
        w0 = Isa::to_float(Isa::low_nibble(pair));
        w1 = Isa::to_float(Isa::high_nibble(pair));
      } else {
        w0 = Isa::to_float(Isa::bytes_s(q + i * G));
        w1 = Isa::to_float(Isa::bytes_s(q + (i + 1) * G));
      }
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
  for (int r = 0; r < R; ++r) {
    if (cols == G) {
      Isa::store(out + r * out_stride, acc[r]);
    } else {
      float tmp[G];
      Isa::store(tmp, acc[r]);
      std::copy(tmp, tmp + cols, out + r * out_stride);
    }
  }
}

template <int64_t S, bool HAS_M, bool NIB, int R = MAX_R>
inline void group_rows(const float* x, int64_t M, int64_t K, const uint8_t* tiles, const float* xs, int64_t nsub,
                       float* out, int64_t N, int64_t cols) {
  if constexpr (R > 0) {
    if (M == R) return group_small<S, HAS_M, NIB, R>(x, K, tiles, xs, nsub, out, N, cols);
    return group_rows<S, HAS_M, NIB, R - 1>(x, M, K, tiles, xs, nsub, out, N, cols);
  }
}

template <int64_t S, bool HAS_M, bool NIB = false>
void run(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, float* out) {
  const int64_t nsub = K / S, num_groups = (N + G - 1) / G, group_bytes = nsub * tile_bytes(S, NIB);
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
        group_rows<S, HAS_M, NIB>(x + m * K, rows, K, tiles, HAS_M ? xs.data() + m * nsub : nullptr, nsub,
                             out + m * N + g * G, N, cols);
      }
    }
  });
}

// Weight k of row c of a group, rebuilt: fl(fl(D * q) + M), or fl(D * q) without M.
inline float rebuild(const uint8_t* tile, int64_t i, int64_t c, bool has_m, bool nib) {
  const float* D = reinterpret_cast<const float*>(tile);
  const float* M = reinterpret_cast<const float*>(tile + 4 * G);
  const float w = D[c] * static_cast<float>(q_at(tile + 8 * G, i, c, nib));
  return has_m ? w + M[c] : w;
}

void check_packed(const at::Tensor& packed, int64_t fmt, int64_t N, int64_t K) {
  const Spec sp = spec(fmt);
  TORCH_CHECK(K % sp.block_weights == 0, "in_features must be a multiple of ", sp.block_weights, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + G - 1) / G && packed.size(1) == K / sp.sub &&
                  packed.size(2) == tile_bytes(sp.sub, sp.nib),
              "packed weight must be uint8 [ceil(N / ", G, "), K / ", sp.sub, ", ", tile_bytes(sp.sub, sp.nib),
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
  const int64_t num_groups = (N + G - 1) / G, tb = tile_bytes(sp.sub, sp.nib);
  auto packed = at::zeros({num_groups, nsub, tb}, qweight.options());
  const uint8_t* src = qweight.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    float D[16], M[16];
    int8_t q[256];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < G && g * G + c < N; ++c)
        for (int64_t b = 0; b < nb; ++b) {
          decode_block(fmt, src + ((g * G + c) * nb + b) * sp.block_bytes, D, M, q);
          for (int64_t s = 0; s < subs_per_block; ++s) {
            uint8_t* t = dst + (g * nsub + b * subs_per_block + s) * tb;
            std::memcpy(t + 4 * c, &D[s], 4);
            std::memcpy(t + 4 * G + 4 * c, &M[s], 4);
            for (int64_t i = 0; i < sp.sub; ++i) {
              const auto v = static_cast<uint8_t>(q[s * sp.sub + i]);
              if (sp.nib)
                t[8 * G + (i / 2) * G + c] |= static_cast<uint8_t>(v << (4 * (i % 2)));
              else
                t[8 * G + i * G + c] = v;
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
    case kQ6_K: return run<16, false>(xp, M, K, pp, N, op);
    case kQ4_K: return run<32, true, true>(xp, M, K, pp, N, op);
    default: return run<32, true>(xp, M, K, pp, N, op);
  }
}

void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N) {
  const Spec sp = spec(fmt);
  const int64_t K = out.size(1), nsub = K / sp.sub, tb = tile_bytes(sp.sub, sp.nib);
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
          op[j * K + b * sp.sub + i] = rebuild(pp + (g * nsub + b) * tb, i, c, sp.has_m, sp.nib);
    }
  });
}

void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt) {
  const Spec sp = spec(fmt);
  const int64_t K = out.size(0), N = out.size(1), nsub = K / sp.sub, tb = tile_bytes(sp.sub, sp.nib);
  check_packed(packed, fmt, N, K);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nsub; ++b) {
        const uint8_t* t = pp + (g * nsub + b) * tb;
        const V D = Isa::load(reinterpret_cast<const float*>(t)), Mv = Isa::load(reinterpret_cast<const float*>(t + 4 * G));
        for (int64_t i = 0; i < sp.sub; ++i) {
          const auto q = sp.nib ? (i % 2 == 0 ? Isa::low_nibble(Isa::bytes_u(t + 8 * G + (i / 2) * G))
                                              : Isa::high_nibble(Isa::bytes_u(t + 8 * G + (i / 2) * G)))
                                : Isa::bytes_s(t + 8 * G + i * G);
          V w = Isa::mul(Isa::to_float(q), D);
          if (sp.has_m) w = Isa::add(w, Mv);
          Isa::store(op + (b * sp.sub + i) * N + g * G, w);
        }
      }
  });
}

}  // namespace octavo_k8
