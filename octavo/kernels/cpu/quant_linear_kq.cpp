// Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K) for the CPU at their file's size: out = x @ W^T,
// activations float32.
//
// A K-quant block holds 256 weights of a row: fp16 super-scales and, per sub-block, small integer
// scales, the weights' quants split in bit planes. gguf-py rebuilds a weight as
//   Q4_K / Q5_K: fl(fl(D * q) - fl(dmin * mn)), D = fl(d * sc), q = 4 / 5 bits, sub-blocks of 32
//   Q6_K:        fl(D * (q - 32)),               D = fl(d * sc), q = 6 bits,     sub-blocks of 16
// with d, dmin fp16 and sc, mn the sub-block's 6-bit (Q4_K, Q5_K) or int8 (Q6_K) fields. A Q5_0 /
// Q5_1 block is 32 weights with one fp16 d (and m): fl(d * (q - 16)) / fl(fl(d * q) + m), q 5 bits.
//
// `pack` reorders each block into a tile of G rows (G = the vector width in floats), keeping the
// same fields at the same widths, so that one vector load gives one field of G rows:
//   Q4_K (148 G bytes): d[G] fp16 | dmin[G] fp16 | sc[8][G] | mn[8][G] | per sub-block lo[16][G]
//   Q5_K (180 G bytes): the same, per sub-block lo[16][G] then hi[4][G]
//   Q6_K (210 G bytes): d[G] fp16 | sc[16][G] int8 | per sub-block lo[8][G] then hi[4][G]
//   Q5_0 (22 G bytes):  d[G] fp16 | lo[16][G] | hi[4][G]
//   Q5_1 (24 G bytes):  d[G] fp16 | m[G] fp16 | lo[16][G] | hi[4][G]
// lo byte p holds the low 4 bits of weights 2p (low nibble) and 2p + 1 (high nibble) of the
// sub-block; Q5_K's hi byte h holds the fifth bit of weight 8h + j at bit j; Q5_0 / Q5_1's hi byte
// h the fifth bits of weights 2p, 2p + 1 at bits 2j, 2j + 1 for lo byte p = 4j + h; Q6_K's hi byte p
// (p < 4) the top two bits of weights 2p, 2p + 1, 8 + 2p, 9 + 2p at bits 0, 2, 4, 6. Both are
// aligned with lo bytes, so that four rows of G lanes are assembled by one set of byte operations
// (`for_q5`, `for_q6`: about 1/4 of an integer operation per weight instead of 6). Bytes per weight: Q4_K 0.578 (file 0.5625: the 6-bit
// scales and mins take a byte each), Q5_K 0.703 (0.6875), Q6_K 0.820, Q5_0 0.6875, Q5_1 0.75 (the
// file's). A decode step is bound by these bytes (docs/BENCHMARKS.md); the kernels unpack in
// registers: a few integer operations per G weights, and D, -dmin * mn once per sub-block.
//
// The small-batch kernel factors each sub-block's scale out, as quant_linear.cpp's does:
//   sum_i (D q_i + M) x_i = D * sum_i q_i x_i + M * sum_i x_i,   M = -(dmin * mn), or m (Q5_1)
// (Q6_K and Q5_0 subtract their 32 / 16 in integers: no M). For many rows the caller rebuilds W^T, each weight
// bit for bit gguf-py's value (-ffp-contract=off keeps the two roundings), for a float32 GEMM.
#include "quant_linear_kq.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packing.h"
#include "quant_isa.h"

namespace octavo_kq {
namespace {

using octavo_quant::fp16_to_float;
using octavo_quant::Isa;
using octavo_quant::load_u16;
using V = Isa::V;
using I = Isa::I;
constexpr int G = Isa::G;
constexpr int MAX_R = G == 16 ? 8 : 4;
constexpr bool is_q5(int64_t fmt) { return fmt == kQ5_0 || fmt == kQ5_1; }  // one 32-weight block, no super-block
constexpr int64_t block_weights(int64_t fmt) { return is_q5(fmt) ? 32 : 256; }
constexpr int64_t file_block_bytes(int64_t fmt) {
  return fmt == kQ5_0 ? 22 : fmt == kQ5_1 ? 24 : fmt == kQ4_K ? 144 : fmt == kQ5_K ? 176 : 210;
}
constexpr int64_t tile_bytes(int64_t fmt) {
  return (fmt == kQ5_0 ? 22 : fmt == kQ5_1 ? 24 : fmt == kQ4_K ? 148 : fmt == kQ5_K ? 180 : 210) * G;
}
// bytes of one sub-block's quants in a tile, and where the first starts
constexpr int64_t sub_bytes(int64_t fmt) { return (fmt == kQ4_K ? 16 : fmt == kQ6_K ? 12 : 20) * G; }
constexpr int64_t q_start(int64_t fmt) { return (fmt == kQ5_0 ? 2 : fmt == kQ5_1 ? 4 : fmt == kQ6_K ? 18 : 20) * G; }

}  // namespace

void read_block(int64_t fmt, const uint8_t* b, Fields& f) {
  if (is_q5(fmt)) {  // d, (m), 32 fifth bits, 16 bytes: weight j low nibble, j + 16 high nibble
    const int64_t at = fmt == kQ5_0 ? 2 : 4;
    f.d = load_u16(b);
    f.dmin = fmt == kQ5_1 ? load_u16(b + 2) : 0;
    uint32_t qh;
    std::memcpy(&qh, b + at, 4);
    const uint8_t* qs = b + at + 4;
    for (int j = 0; j < 16; ++j) {
      f.q[j] = static_cast<uint8_t>((qs[j] & 0x0f) | (((qh >> j) & 1) << 4));
      f.q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    return;
  }
  if (fmt == kQ6_K) {  // ql[128], qh[64], int8 scales[16], fp16 d
    const uint8_t *ql = b, *qh = b + 128;
    std::memcpy(f.sc, b + 192, 16);
    f.d = load_u16(b + 208);
    f.dmin = 0;
    for (int h = 0; h < 2; ++h)
      for (int w = 0; w < 128; ++w) {
        const int low = w < 64 ? (ql[64 * h + w] & 0x0f) : (ql[64 * h + w - 64] >> 4);
        const int high = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
        f.q[128 * h + w] = static_cast<uint8_t>(low | (high << 4));
      }
    return;
  }
  f.d = load_u16(b);
  f.dmin = load_u16(b + 2);
  const uint8_t* s = b + 4;  // 12 bytes: 6-bit scales and mins of the 8 sub-blocks
  const uint8_t* qh = b + 16;  // Q5_K: bit i of byte j is sub-block i's weight j's fifth bit
  const uint8_t* qs = b + (fmt == kQ4_K ? 16 : 48);
  for (int i = 0; i < 8; ++i) {
    f.sc[i] = static_cast<uint8_t>(i < 4 ? (s[i] & 63) : ((s[i + 4] & 0x0f) | ((s[i - 4] >> 2) & 0x30)));
    f.mn[i] = static_cast<uint8_t>(i < 4 ? (s[i + 4] & 63) : ((s[i + 4] >> 4) | ((s[i] >> 2) & 0x30)));
    const uint8_t* chunk = qs + 32 * (i / 2);  // sub-blocks 2c and 2c + 1 share 32 bytes
    for (int j = 0; j < 32; ++j) {
      int v = i % 2 == 0 ? (chunk[j] & 0x0f) : (chunk[j] >> 4);
      if (fmt == kQ5_K) v |= ((qh[j] >> i) & 1) << 4;
      f.q[32 * i + j] = static_cast<uint8_t>(v);
    }
  }
}

namespace {

// Lane c of one sub-block's quants q[32] (4 bits, or 5 with FIVE): lo pairs, then hi fifth bits.
void write_sub(const uint8_t* q, uint8_t* lo, int64_t c, bool five) {
  for (int p = 0; p < 16; ++p) lo[p * G + c] = static_cast<uint8_t>((q[2 * p] & 15) | ((q[2 * p + 1] & 15) << 4));
  if (five)
    for (int h = 0; h < 4; ++h) {
      int v = 0;
      for (int j = 0; j < 8; ++j) v |= (q[8 * h + j] >> 4) << j;
      lo[(16 + h) * G + c] = static_cast<uint8_t>(v);
    }
}

// Lane c of a tile <- one row's block.
void write_lane(int64_t fmt, const Fields& f, uint8_t* t, int64_t c) {
  std::memcpy(t + 2 * c, &f.d, 2);
  if (is_q5(fmt)) {
    if (fmt == kQ5_1) std::memcpy(t + 2 * G + 2 * c, &f.dmin, 2);
    uint8_t* lo = t + q_start(fmt);
    write_sub(f.q, lo, c, false);
    for (int h = 0; h < 4; ++h) {
      int v = 0;
      for (int j = 0; j < 4; ++j) v |= ((f.q[2 * (4 * j + h)] >> 4) << (2 * j)) | ((f.q[2 * (4 * j + h) + 1] >> 4) << (2 * j + 1));
      lo[(16 + h) * G + c] = static_cast<uint8_t>(v);
    }
    return;
  }
  if (fmt == kQ6_K) {
    for (int s = 0; s < 16; ++s) {
      t[2 * G + s * G + c] = f.sc[s];
      uint8_t* lo = t + q_start(fmt) + s * sub_bytes(fmt);
      const uint8_t* q = f.q + 16 * s;
      for (int p = 0; p < 8; ++p) lo[p * G + c] = static_cast<uint8_t>((q[2 * p] & 15) | ((q[2 * p + 1] & 15) << 4));
      for (int p = 0; p < 4; ++p) {
        const int v = (q[2 * p] >> 4) | ((q[2 * p + 1] >> 4) << 2) | ((q[8 + 2 * p] >> 4) << 4) | ((q[9 + 2 * p] >> 4) << 6);
        lo[(8 + p) * G + c] = static_cast<uint8_t>(v);
      }
    }
    return;
  }
  std::memcpy(t + 2 * G + 2 * c, &f.dmin, 2);
  for (int s = 0; s < 8; ++s) {
    t[4 * G + s * G + c] = f.sc[s];
    t[12 * G + s * G + c] = f.mn[s];
    write_sub(f.q + 32 * s, t + q_start(fmt) + s * sub_bytes(fmt), c, fmt == kQ5_K);
  }
}

// Weight k (< 256) of lane c of a tile, rebuilt as gguf-py does.
float weight_at(int64_t fmt, const uint8_t* t, int64_t c, int64_t k) {
  const float d = fp16_to_float(load_u16(t + 2 * c));
  if (is_q5(fmt)) {
    const uint8_t* lo = t + q_start(fmt);
    const int64_t p = k / 2, at = 2 * (p / 4) + k % 2;  // lo byte p, its hi byte p % 4
    const int q = ((lo[p * G + c] >> (4 * (k % 2))) & 15) | (((lo[(16 + p % 4) * G + c] >> at) & 1) << 4);
    if (fmt == kQ5_0) return d * static_cast<float>(q - 16);
    const float w = d * static_cast<float>(q);
    return w + fp16_to_float(load_u16(t + 2 * G + 2 * c));
  }
  if (fmt == kQ6_K) {
    const int64_t s = k / 16, i = k % 16;
    const float D = d * static_cast<float>(static_cast<int8_t>(t[2 * G + s * G + c]));
    const uint8_t* lo = t + q_start(fmt) + s * sub_bytes(fmt);
    const int at = (i / 8) * 2 + i % 2;  // the pair of bits in hi byte (i % 8) / 2
    const int low = (lo[(i / 2) * G + c] >> (4 * (i % 2))) & 15, high = (lo[(8 + (i % 8) / 2) * G + c] >> (2 * at)) & 3;
    return D * static_cast<float>((low | (high << 4)) - 32);
  }
  const int64_t s = k / 32, i = k % 32;
  const float D = d * static_cast<float>(t[4 * G + s * G + c]);
  const float M = fp16_to_float(load_u16(t + 2 * G + 2 * c)) * static_cast<float>(t[12 * G + s * G + c]);
  const uint8_t* lo = t + q_start(fmt) + s * sub_bytes(fmt);
  int q = (lo[(i / 2) * G + c] >> (4 * (i % 2))) & 15;
  if (fmt == kQ5_K) q |= ((lo[(16 + i / 8) * G + c] >> (i % 8)) & 1) << 4;
  const float w = D * static_cast<float>(q);
  return w - M;
}

// Bit B of each lane moved to bit 4 (value 16): Q5_K's fifth bit.
template <int B>
inline I bit_to_16(I v) {
  if constexpr (B < 4) return Isa::and_(Isa::shl<4 - B>(v), 16);
  else if constexpr (B == 4) return Isa::and_(v, 16);
  else return Isa::and_(Isa::shr<B - 4>(v), 16);
}

// The 32 quants of Q4_K / Q5_K sub-block `lo` as 16 pairs, handed to f(pair index, w[2p], w[2p+1]).
template <bool FIVE, typename F>
inline void for_pairs(const uint8_t* lo, F&& f) {
  if constexpr (FIVE) {
    for (int h = 0; h < 4; ++h) {
      const I hv = Isa::bytes_u(lo + (16 + h) * G);
      const auto pair = [&](auto jj) {
        constexpr int j = decltype(jj)::value;  // pair 4h + j: weights 8h + 2j, 8h + 2j + 1
        const I v = Isa::bytes_u(lo + (4 * h + j) * G);
        f(4 * h + j, Isa::to_float(Isa::or_(Isa::low_nibble(v), bit_to_16<2 * j>(hv))),
          Isa::to_float(Isa::or_(Isa::high_nibble(v), bit_to_16<2 * j + 1>(hv))));
      };
      pair(std::integral_constant<int, 0>());
      pair(std::integral_constant<int, 1>());
      pair(std::integral_constant<int, 2>());
      pair(std::integral_constant<int, 3>());
    }
  } else {
    for (int p = 0; p < 16; ++p) {
      const I v = Isa::bytes_u(lo + p * G);
      f(p, Isa::to_float(Isa::low_nibble(v)), Isa::to_float(Isa::high_nibble(v)));
    }
  }
}

// The 32 quants of a Q5_0 / Q5_1 tile's `lo` (minus 16 with SUB16), assembled four tile rows at a
// time in bytes as for_q6 does, then widened one row of G lanes at a time: f(p, w[2p], w[2p + 1]).
template <bool SUB16, typename F>
inline void for_q5(const uint8_t* lo, F&& f) {
  using B = Isa::B;
  const B hi = Isa::load4(lo + 16 * G);
  alignas(64) uint8_t w[2][4 * G];  // weights 2p, 2p + 1 of rows p = 4j .. 4j + 3, int8
  const auto fifth = [](B h) { return Isa::and4(h, 0x10); };
  const auto done = [](B v) { return SUB16 ? Isa::sub4(v, 16) : v; };
  const auto rows = [&](auto jj) {
    constexpr int j = decltype(jj)::value;  // fifth bits at 2j, 2j + 1 of hi -> bit 4
    const B l = Isa::load4(lo + 4 * j * G);
    B even, odd;
    if constexpr (j == 0) even = fifth(Isa::shl4<4>(hi)), odd = fifth(Isa::shl4<3>(hi));
    else if constexpr (j == 1) even = fifth(Isa::shl4<2>(hi)), odd = fifth(Isa::shl4<1>(hi));
    else if constexpr (j == 2) even = fifth(hi), odd = fifth(Isa::shr4<1>(hi));
    else even = fifth(Isa::shr4<2>(hi)), odd = fifth(Isa::shr4<3>(hi));
    Isa::store4(w[0], done(Isa::or4(Isa::and4(l, 0x0f), even)));
    Isa::store4(w[1], done(Isa::or4(Isa::and4(Isa::shr4<4>(l), 0x0f), odd)));
    for (int i = 0; i < 4; ++i)
      f(4 * j + i, Isa::to_float(Isa::bytes_s(w[0] + i * G)), Isa::to_float(Isa::bytes_s(w[1] + i * G)));
  };
  rows(std::integral_constant<int, 0>());
  rows(std::integral_constant<int, 1>());
  rows(std::integral_constant<int, 2>());
  rows(std::integral_constant<int, 3>());
}

// The 16 quants (minus 32) of Q6_K sub-block `lo`, assembled four tile rows at a time in bytes
// (Isa::B), then widened one row of G lanes at a time: f(p, w[2p], w[2p + 1], w[8 + 2p], w[9 + 2p]).
template <typename F>
inline void for_q6(const uint8_t* lo, F&& f) {
  using B = Isa::B;
  const B l0 = Isa::load4(lo), l1 = Isa::load4(lo + 4 * G), hi = Isa::load4(lo + 8 * G);
  alignas(64) uint8_t w[4][4 * G];  // weights 2p, 2p + 1, 8 + 2p, 9 + 2p of row p, int8
  const auto top = [](B h) { return Isa::and4(h, 0x30); };
  Isa::store4(w[0], Isa::sub4(Isa::or4(Isa::and4(l0, 0x0f), top(Isa::shl4<4>(hi))), 32));
  Isa::store4(w[1], Isa::sub4(Isa::or4(Isa::and4(Isa::shr4<4>(l0), 0x0f), top(Isa::shl4<2>(hi))), 32));
  Isa::store4(w[2], Isa::sub4(Isa::or4(Isa::and4(l1, 0x0f), top(hi)), 32));
  Isa::store4(w[3], Isa::sub4(Isa::or4(Isa::and4(Isa::shr4<4>(l1), 0x0f), top(Isa::shr4<2>(hi))), 32));
  for (int p = 0; p < 4; ++p)
    f(p, Isa::to_float(Isa::bytes_s(w[0] + p * G)), Isa::to_float(Isa::bytes_s(w[1] + p * G)),
      Isa::to_float(Isa::bytes_s(w[2] + p * G)), Isa::to_float(Isa::bytes_s(w[3] + p * G)));
}

// out[r][0..G) for rows r < R of one group. xs: per-row sums of x per sub-block of 32 (Q4_K, Q5_K).
template <int64_t F, int R>
inline void group_small(const float* x, int64_t K, const uint8_t* tiles, const float* xs, int64_t nb, float* out,
                        int64_t out_stride, int64_t cols) {
  constexpr int64_t TB = tile_bytes(F), SB = sub_bytes(F), Q0 = q_start(F);
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Isa::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = tiles + b * TB;
    octavo_quant::prefetch_ahead<TB>(t);
    const V d = Isa::halves(t);
    if constexpr (is_q5(F)) {  // Q5_0 subtracts its 16 in integers: no M
      const float* xb = x + b * 32;
      V s0[R], s1[R];
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero();
      for_q5<F == kQ5_0>(t + Q0, [&](int p, V w0, V w1) {
        for (int r = 0; r < R; ++r) {
          s0[r] = Isa::fma(w0, Isa::set1(xb[r * K + 2 * p]), s0[r]);
          s1[r] = Isa::fma(w1, Isa::set1(xb[r * K + 2 * p + 1]), s1[r]);
        }
      });
      for (int r = 0; r < R; ++r) acc[r] = Isa::fma(d, Isa::add(s0[r], s1[r]), acc[r]);
      if constexpr (F == kQ5_1) {
        const V m = Isa::halves(t + 2 * G);
        for (int r = 0; r < R; ++r) acc[r] = Isa::fma(m, Isa::set1(xs[r * nb + b]), acc[r]);
      }
    } else if constexpr (F == kQ6_K) {
      for (int s = 0; s < 16; ++s) {
        const V D = Isa::mul(d, Isa::to_float(Isa::bytes_s(t + 2 * G + s * G)));
        const float* xb = x + b * 256 + s * 16;
        V s0[R], s1[R];  // two chains per row: half the latency of one
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero();
        for_q6(t + Q0 + s * SB, [&](int p, V w0, V w1, V w8, V w9) {
          for (int r = 0; r < R; ++r) {  // (two chains, not four: 8 rows' accumulators fill the registers)
            s0[r] = Isa::fma(w0, Isa::set1(xb[r * K + 2 * p]), s0[r]);
            s1[r] = Isa::fma(w1, Isa::set1(xb[r * K + 2 * p + 1]), s1[r]);
            s0[r] = Isa::fma(w8, Isa::set1(xb[r * K + 8 + 2 * p]), s0[r]);
            s1[r] = Isa::fma(w9, Isa::set1(xb[r * K + 9 + 2 * p]), s1[r]);
          }
        });
        for (int r = 0; r < R; ++r) acc[r] = Isa::fma(D, Isa::add(s0[r], s1[r]), acc[r]);
      }
    } else {
      const V dmin = Isa::halves(t + 2 * G);
      for (int s = 0; s < 8; ++s) {
        const V D = Isa::mul(d, Isa::to_float(Isa::bytes_u(t + 4 * G + s * G)));
        const V M = Isa::mul(Isa::mul(dmin, Isa::to_float(Isa::bytes_u(t + 12 * G + s * G))), Isa::set1(-1.f));
        const float* xb = x + b * 256 + s * 32;
        V s0[R], s1[R];
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero();
        for_pairs<F == kQ5_K>(t + Q0 + s * SB, [&](int p, V w0, V w1) {
          for (int r = 0; r < R; ++r) {
            s0[r] = Isa::fma(w0, Isa::set1(xb[r * K + 2 * p]), s0[r]);
            s1[r] = Isa::fma(w1, Isa::set1(xb[r * K + 2 * p + 1]), s1[r]);
          }
        });
        const int64_t nsub = nb * 8;
        for (int r = 0; r < R; ++r) {
          acc[r] = Isa::fma(D, Isa::add(s0[r], s1[r]), acc[r]);
          acc[r] = Isa::fma(M, Isa::set1(xs[r * nsub + b * 8 + s]), acc[r]);
        }
      }
    }
  }
  octavo_quant::store_rows(acc, R, cols, out, out_stride);
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
  const int64_t nb = K / block_weights(F), num_groups = (N + G - 1) / G, group_bytes = nb * tile_bytes(F);
  constexpr bool HAS_M = F != kQ6_K && F != kQ5_0;
  const std::vector<float> xs = HAS_M ? octavo_quant::block_sums(x, M, K, 32, [](int64_t b, int64_t e, int64_t g, const auto& f) {
    at::parallel_for(b, e, g, f);
  }) : std::vector<float>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tiles = packed + g * group_bytes;
      const int64_t cols = std::min<int64_t>(G, N - g * G);
      for (int64_t m = 0; m < M; m += MAX_R) {
        const int64_t rows = std::min<int64_t>(MAX_R, M - m);
        group_rows<F>(x + m * K, rows, K, tiles, HAS_M ? xs.data() + m * (K / 32) : nullptr, nb, out + m * N + g * G,
                      N, cols);
      }
    }
  });
}

// One tile's weights as float32, k-major: w[k * stride + c] = weight k of the group's row c.
template <int64_t F>
inline void rebuild_tile(const uint8_t* t, float* w, int64_t stride) {
  constexpr int64_t SB = sub_bytes(F), Q0 = q_start(F);
  const V d = Isa::halves(t);
  if constexpr (is_q5(F)) {
    const V m = F == kQ5_1 ? Isa::halves(t + 2 * G) : Isa::zero();
    for_q5<F == kQ5_0>(t + Q0, [&](int p, V w0, V w1) {
      if constexpr (F == kQ5_0) {  // fl(d * (q - 16))
        Isa::store(w + (2 * p) * stride, Isa::mul(w0, d));
        Isa::store(w + (2 * p + 1) * stride, Isa::mul(w1, d));
      } else {
        Isa::store(w + (2 * p) * stride, Isa::add(Isa::mul(w0, d), m));
        Isa::store(w + (2 * p + 1) * stride, Isa::add(Isa::mul(w1, d), m));
      }
    });
  } else if constexpr (F == kQ6_K) {
    for (int s = 0; s < 16; ++s) {
      const V D = Isa::mul(d, Isa::to_float(Isa::bytes_s(t + 2 * G + s * G)));
      float* ws = w + s * 16 * stride;
      for_q6(t + Q0 + s * SB, [&](int p, V w0, V w1, V w8, V w9) {
        Isa::store(ws + (2 * p) * stride, Isa::mul(w0, D));
        Isa::store(ws + (2 * p + 1) * stride, Isa::mul(w1, D));
        Isa::store(ws + (8 + 2 * p) * stride, Isa::mul(w8, D));
        Isa::store(ws + (9 + 2 * p) * stride, Isa::mul(w9, D));
      });
    }
  } else {
    const V dmin = Isa::halves(t + 2 * G);
    for (int s = 0; s < 8; ++s) {
      const V D = Isa::mul(d, Isa::to_float(Isa::bytes_u(t + 4 * G + s * G)));
      const V M = Isa::mul(Isa::mul(dmin, Isa::to_float(Isa::bytes_u(t + 12 * G + s * G))), Isa::set1(-1.f));
      float* ws = w + s * 32 * stride;
      for_pairs<F == kQ5_K>(t + Q0 + s * SB, [&](int p, V w0, V w1) {
        Isa::store(ws + (2 * p) * stride, Isa::add(Isa::mul(w0, D), M));
        Isa::store(ws + (2 * p + 1) * stride, Isa::add(Isa::mul(w1, D), M));
      });
    }
  }
}

void check_packed(const at::Tensor& packed, int64_t fmt, int64_t N, int64_t K) {
  const int64_t bw = block_weights(fmt);
  TORCH_CHECK(K % bw == 0, "in_features must be a multiple of ", bw, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + G - 1) / G && packed.size(1) == K / bw && packed.size(2) == tile_bytes(fmt),
              "packed weight must be uint8 [ceil(N / ", G, "), K / ", bw, ", ", tile_bytes(fmt), "] (from `pack`)");
}

}  // namespace

// GGUF blocks uint8 [N, K / block weights * block bytes] -> packed uint8 [ceil(N / G), K / block weights, tile bytes].
at::Tensor pack(const std::vector<at::Tensor>& parts, int64_t fmt) {
  const int64_t bb = file_block_bytes(fmt);
  const octavo_quant::SourceRows src = octavo_quant::source_rows(parts, bb);
  const int64_t N = src.size(), nb = src.row_bytes / bb, num_groups = (N + G - 1) / G, tb = tile_bytes(fmt);
  auto packed = octavo_quant::empty_tiles(N, G, nb, tb);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    Fields f;
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < G && g * G + c < N; ++c)
        for (int64_t b = 0; b < nb; ++b) {
          read_block(fmt, src.row[g * G + c] + b * bb, f);
          write_lane(fmt, f, dst + (g * nb + b) * tb, c);
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
    case kQ5_0: return run<kQ5_0>(xp, M, K, pp, N, op);
    case kQ5_1: return run<kQ5_1>(xp, M, K, pp, N, op);
    case kQ4_K: return run<kQ4_K>(xp, M, K, pp, N, op);
    case kQ5_K: return run<kQ5_K>(xp, M, K, pp, N, op);
    default: return run<kQ6_K>(xp, M, K, pp, N, op);
  }
}

void dequantize_rows(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N) {
  const int64_t K = out.size(1), bw = block_weights(fmt), nb = K / bw, tb = tile_bytes(fmt);
  check_packed(packed, fmt, N, K);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t j = 0; j < rows.size(0); ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < N, "row ", rp[j], " out of range [0, ", N, ")");
  at::parallel_for(0, rows.size(0), 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t g = rp[j] / G, c = rp[j] % G;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t k = 0; k < bw; ++k) op[j * K + b * bw + k] = weight_at(fmt, pp + (g * nb + b) * tb, c, k);
    }
  });
}

void dequantize_transposed(at::Tensor out, at::Tensor packed, int64_t fmt) {
  const int64_t K = out.size(0), N = out.size(1), bw = block_weights(fmt), nb = K / bw, tb = tile_bytes(fmt);
  check_packed(packed, fmt, N, K);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* t = pp + (g * nb + b) * tb;
        float* w = op + b * bw * N + g * G;
        if (fmt == kQ5_0) rebuild_tile<kQ5_0>(t, w, N);
        else if (fmt == kQ5_1) rebuild_tile<kQ5_1>(t, w, N);
        else if (fmt == kQ4_K) rebuild_tile<kQ4_K>(t, w, N);
        else if (fmt == kQ5_K) rebuild_tile<kQ5_K>(t, w, N);
        else rebuild_tile<kQ6_K>(t, w, N);
      }
  });
}

}  // namespace octavo_kq
