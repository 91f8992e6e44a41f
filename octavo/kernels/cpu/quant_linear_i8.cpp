// Quantized linear layers with int8 activations: out = x @ W^T where x is first quantized per run
// of 32 values (a float32 scale dx = max|x| / 127 and int8 xq = round(x / dx), as llama.cpp's Q8_0
// activations) and every 4 weights x 4 activations go through one integer dot product (VNNI's
// vpdpbusd: 64 multiply-adds an instruction with AVX-512, where a float32 FMA does 16). Not exact:
// the activations' rounding is the cost (measured by `octavo eval`); the float32 kernels
// (quant_linear.cpp, _kq) stay the exact path.
//
// Every format (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4) is a run of 32-weight chunks
// of unsigned quants u with scales:
//   offset  w = d * (u - o)               Q4_0 (o = 8), Q5_0 (16), Q8_0 (u = q + 128, o = 128),
//                                         MXFP4 (d = 2^(e - 128), u = k[code] + 12, o = 12: the tile
//                                         keeps the file's 4-bit codes, looked up into u by vpshufb)
//   min     w = d * u + m                 Q4_1, Q5_1
//   K min   w = (d * sc) * u - dmin * mn  Q4_K, Q5_K (sc, mn per chunk; d, dmin per 256)
//   Q6_K    w = (d * sc) * (u - 32)       sc per 16 weights, d per 256
// so that, per chunk and output row, sum_k w_k x_k = D * dx * sum_k u_k xq_k - D * o * dx * sum xq
// + M * dx * sum xq: an integer dot product, an integer correction, and for the min the sum of the
// same rounded x (see `quantize_chunk`: the whole weight meets one x, as llama.cpp's).
//
// `pack` lays each format's blocks out again at the file's size: rows in groups of G (the vector
// width in floats), per group and block (32 weights, or 256 for the K-quants) one tile:
//   header   d[G] fp16 (MXFP4: e[G] bytes) | m or dmin[G] fp16 (min, K min) | sc[8][G], mn[8][G] (K min) | sc[16][G] (Q6_K)
//   chunks   per 32 weights: nib[4][G][4] | hi5[G][4] (5-bit); 8-bit: u[8][G][4]; 6-bit: p[2][3][G][4]
// 32-bit lane c of a vector holds 4 consecutive weights of row c, the unit vpdpbusd multiplies by
// one broadcast of 4 activations: vector v (k = 4v .. 4v + 3) is nib[v / 2]'s low nibbles (v even)
// or high ones (v odd); a 5-bit weight's fifth bit is bit v of its lane byte in hi5. 6-bit (Q6_K):
// per half h of the chunk (v = 4h .. 4h + 3), vector v = 4h + j < 4h + 3 is p[h][j]'s low 6 bits
// (one mask), and vector 4h + 3 is gathered from the three's top 2 bits (bits 2j, 2j + 1 from
// p[h][j]): 9 integer operations a half where nibbles and separate top bits took 14. Bytes per tile:
// 18, 20, 34, 22, 24, 148, 180, 210, 17 x G: the file's bytes (the K-quants' 6-bit scales take a
// byte each).
//
// AMX-INT8 (AVX-512 builds on CPUs that list it): a chunk's 8 unpacked vectors are exactly the
// rows of an AMX B tile (16 columns x 4 bytes a row), so for steps of 16+ rows one tdpbsud gives
// the integer dot products of 16 rows x 16 columns x 32 weights, which then take the same float
// scaling as the VNNI path's: the integers are exact either way, so a row's result is the same bits
// through either path (batch invariance holds across the switch). Used only once `amx_enable`
// succeeded (the process asked the kernel for the tile state, and a child process's self-test ran
// the instructions: kernels/cpu/__init__.py), and only when asked (OCTAVO_AMX=1): one tile product
// per chunk, stored and scaled row by row, measured no faster than VNNI (0.75-1.5x by shape,
// docs/BENCHMARKS.md): the store, reload and float scaling of each 16 x 16 result cost what the
// tile saved (two tile sets alternating between chunks measured no better). Scales folded into
// integers (one float step per many chunks) are what could change it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "packing.h"
#include "quant_isa.h"
#include "quant_linear_kq.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__linux__)
#define OCTAVO_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define OCTAVO_AMX 0
#endif
#if OCTAVO_AMX && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define OCTAVO_AMX_BF16 1
#else
#define OCTAVO_AMX_BF16 0
#endif

namespace {

using octavo_quant::fp16_to_float;
using octavo_quant::Isa;
using octavo_quant::load_u16;
using V = Isa::V;
using I = Isa::I;
constexpr int G = Isa::G;
constexpr int MAX_R = G == 16 ? 8 : 4;

enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7,
                        kMXFP4 = 8 };
enum Kind { kOffset, kMin, kKMin, kK6, kMx };
// MXFP4's doubled e2m1 values k[code] + 12 (0..24: unsigned for vpdpbusd, the 12 taken back as Q4_0's 8)
alignas(16) constexpr uint8_t MX_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

struct Spec {
  int64_t block;       // weights per block (file and tile)
  int64_t file_bytes;  // bytes of a file block
  int bits;            // of a quant
  Kind kind;
  int offset;          // o of the offset kind
  int64_t head;        // header bytes of a tile, in units of G
};

constexpr Spec spec(int64_t fmt) {
  switch (fmt) {
    case kQ4_0: return {32, 18, 4, kOffset, 8, 2};
    case kQ4_1: return {32, 20, 4, kMin, 0, 4};
    case kQ8_0: return {32, 34, 8, kOffset, 128, 2};
    case kQ5_0: return {32, 22, 5, kOffset, 16, 2};
    case kQ5_1: return {32, 24, 5, kMin, 0, 4};
    case kQ4_K: return {256, 144, 4, kKMin, 0, 20};
    case kQ5_K: return {256, 176, 5, kKMin, 0, 20};
    case kMXFP4: return {32, 17, 4, kMx, 12, 1};
    default: return {256, 210, 6, kK6, 32, 18};
  }
}
constexpr int64_t chunk_units(int bits) { return bits == 8 ? 32 : bits == 6 ? 24 : bits == 5 ? 20 : 16; }
constexpr int64_t tile_bytes(int64_t fmt) { return (spec(fmt).head + spec(fmt).block / 32 * chunk_units(spec(fmt).bits)) * G; }

bool valid_format(int64_t fmt) { return fmt >= kQ4_0 && fmt <= kMXFP4; }

// ---- packing -------------------------------------------------------------------------------------

// One file block as fields: fp16 bits d and m (min, K min: dmin), per-chunk sc / mn (Q6_K: 16 int8
// scales' bytes), the block's unsigned quants.
struct Block {
  uint16_t d = 0, m = 0;
  uint8_t sc[16] = {}, mn[8] = {};
  uint8_t u[256] = {};
};

void read_block(int64_t fmt, const uint8_t* b, Block& f) {
  if (fmt == kMXFP4) {  // e, then the 4-bit codes (weight j: byte j's low nibble, j + 16: its high one)
    f.d = b[0];
    for (int j = 0; j < 16; ++j) {
      f.u[j] = b[1 + j] & 0x0f;
      f.u[j + 16] = b[1 + j] >> 4;
    }
    return;
  }
  if (fmt >= kQ4_K && fmt <= kQ6_K) {
    octavo_kq::Fields k;
    octavo_kq::read_block(fmt, b, k);
    f.d = k.d;
    f.m = k.dmin;
    std::memcpy(f.sc, k.sc, 16);
    std::memcpy(f.mn, k.mn, 8);
    std::memcpy(f.u, k.q, 256);
    return;
  }
  f.d = load_u16(b);
  const bool has_min = fmt == kQ4_1 || fmt == kQ5_1;
  if (has_min) f.m = load_u16(b + 2);
  const uint8_t* p = b + (has_min ? 4 : 2);
  if (fmt == kQ8_0) {
    for (int j = 0; j < 32; ++j) f.u[j] = static_cast<uint8_t>(p[j] ^ 0x80);  // q + 128
    return;
  }
  uint32_t qh = 0;
  if (fmt == kQ5_0 || fmt == kQ5_1) {
    std::memcpy(&qh, p, 4);  // bit j: weight j's fifth bit
    p += 4;
  }
  for (int j = 0; j < 16; ++j) {
    f.u[j] = static_cast<uint8_t>((p[j] & 0x0f) | (((qh >> j) & 1) << 4));
    f.u[j + 16] = static_cast<uint8_t>((p[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}

// Lane c of a tile <- one row's block.
void write_lane(int64_t fmt, const Block& f, uint8_t* t, int64_t c) {
  const Spec s = spec(fmt);
  if (s.kind == kMx) t[c] = static_cast<uint8_t>(f.d);  // e
  else std::memcpy(t + 2 * c, &f.d, 2);
  if (s.kind == kMin || s.kind == kKMin) std::memcpy(t + 2 * G + 2 * c, &f.m, 2);
  if (s.kind == kKMin)
    for (int i = 0; i < 8; ++i) {
      t[(4 + i) * G + c] = f.sc[i];
      t[(12 + i) * G + c] = f.mn[i];
    }
  if (s.kind == kK6)
    for (int i = 0; i < 16; ++i) t[(2 + i) * G + c] = f.sc[i];
  for (int64_t ch = 0; ch < s.block / 32; ++ch) {
    uint8_t* q = t + (s.head + ch * chunk_units(s.bits)) * G;
    const uint8_t* u = f.u + 32 * ch;
    if (s.bits == 8) {
      for (int v = 0; v < 8; ++v)
        for (int b = 0; b < 4; ++b) q[v * 4 * G + 4 * c + b] = u[4 * v + b];
      continue;
    }
    if (s.bits == 6) {  // (each byte assigned whole: the tiles are not zero-filled)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 3; ++j)
          for (int b = 0; b < 4; ++b)
            q[(3 * h + j) * 4 * G + 4 * c + b] =
                static_cast<uint8_t>((u[4 * (4 * h + j) + b] & 63) | (((u[4 * (4 * h + 3) + b] >> (2 * j)) & 3) << 6));
      continue;
    }
    for (int j = 0; j < 4; ++j)
      for (int b = 0; b < 4; ++b)
        q[j * 4 * G + 4 * c + b] = static_cast<uint8_t>((u[8 * j + b] & 15) | ((u[8 * j + 4 + b] & 15) << 4));
    if (s.bits == 5)
      for (int b = 0; b < 4; ++b) {
        int h = 0;
        for (int v = 0; v < 8; ++v) h |= ((u[4 * v + b] >> 4) & 1) << v;
        q[16 * G + 4 * c + b] = static_cast<uint8_t>(h);
      }
  }
}

// Weight k (< block) of lane c of a tile, rebuilt with gguf-py's arithmetic.
float weight_at(int64_t fmt, const uint8_t* t, int64_t c, int64_t k) {
  const Spec s = spec(fmt);
  const int64_t ch = k / 32, i = k % 32, v = i / 4, b = i % 4;
  const uint8_t* q = t + (s.head + ch * chunk_units(s.bits)) * G;
  int u;
  if (s.bits == 8) {
    u = q[v * 4 * G + 4 * c + b];
  } else if (s.bits == 6) {
    const uint8_t* p = q + (v / 4) * 3 * 4 * G + 4 * c + b;  // p[v / 4][j] at p + j * 4 * G
    if (v % 4 < 3) {
      u = p[(v % 4) * 4 * G] & 63;
    } else {
      u = 0;
      for (int j = 0; j < 3; ++j) u |= (p[j * 4 * G] >> 6) << (2 * j);
    }
  } else {
    const uint8_t byte = q[(v / 2) * 4 * G + 4 * c + b];
    u = v % 2 ? byte >> 4 : byte & 15;
    if (s.bits == 5) u |= ((q[16 * G + 4 * c + b] >> v) & 1) << 4;
  }
  if (s.kind == kMx) return octavo_quant::e8m0_to_float_half(t[c]) * static_cast<float>(MX_U[u] - s.offset);
  const float d = fp16_to_float(load_u16(t + 2 * c));
  switch (s.kind) {
    case kOffset: return d * static_cast<float>(u - s.offset);
    case kMin: return d * static_cast<float>(u) + fp16_to_float(load_u16(t + 2 * G + 2 * c));
    case kKMin: {
      const float D = d * static_cast<float>(t[(4 + ch) * G + c]);
      const float M = fp16_to_float(load_u16(t + 2 * G + 2 * c)) * static_cast<float>(t[(12 + ch) * G + c]);
      const float w = D * static_cast<float>(u);
      return w - M;
    }
    default: {
      const float D = d * static_cast<float>(static_cast<int8_t>(t[(2 + 2 * ch + i / 16) * G + c]));
      return D * static_cast<float>(u - 32);
    }
  }
}

// ---- activations ---------------------------------------------------------------------------------

// x [M, K] quantized per chunk of 32: xq int8 [M, K], dx [M, K / 32] (0 for a chunk of zeros),
// s16 the int sums of xq per 16 [M, K / 16], sx the sums of the quantized x per 32, dx * sum(xq)
// [M, K / 32]: a format's min meets the same x as its scaled quants, so the rounding errors of x meet
// the whole (centred) weight, not the scaled quants alone (d * q, 0..15 d for Q4_1: a large common
// offset that multiplies the errors' sum). Meeting the exact sum of x instead measured 2.4x the
// relative error per layer (docs/BENCHMARKS.md); llama.cpp's Q8_1 / Q8_K sums do the same.
struct Act {
  int64_t M, K;
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  std::vector<int32_t> s16;
};

// The chunk's max |x| (a NaN lane is passed over, as std::max(amax, NaN) keeps amax).
inline float chunk_amax(const float* x) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
  return _mm512_reduce_max_ps(_mm512_max_ps(b, _mm512_max_ps(a, _mm512_setzero_ps())));  // NaN operand first: the other kept
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
#endif
}

// xq = round(x / dx) per chunk of 32, dx = max|x| / 127: ties to even, clamped to +-127 (a NaN x
// gives -127). The vector paths round by the default MXCSR mode (to nearest even), as
// std::nearbyint does, and clamp in integers (a NaN converts to INT_MIN, clamped to -127): the
// same bits as the plain loop. Vectorised because the plain loop's nearbyint calls took 19 us for
// one 8192-wide row, serial before every one-row matmul (the 1B shape's down projection: ~2.5% of
// a decode step on an AMD Zen 5).
void quantize_chunk(const float* x, int8_t* q, float& dx, float& sx, int32_t* s16) {
  const float amax = chunk_amax(x);
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  int32_t s[2] = {0, 0};
#if defined(__AVX512F__)
  const __m512 vi = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), vi))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(v));
    s[h] = _mm512_reduce_add_epi32(v);
  }
#elif defined(__AVX2__)
  const __m256 vi = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i v[4];
  for (int j = 0; j < 4; ++j)
    v[j] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), vi))));
  for (int h = 0; h < 2; ++h) {
    const __m256i t = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
    s[h] = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1)));
  }
  // int32 -> int8 (no saturation reached: |v| <= 127); the packs interleave 128-bit lanes, undone by one permute
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  for (int i = 0; i < 32; ++i) {
    const float r = std::nearbyint(x[i] * inv);  // ties to even (the default rounding mode), as torch.round
    const int v = static_cast<int>(std::min(127.f, std::max(-127.f, r)));
    q[i] = static_cast<int8_t>(v);
    s[i / 16] += v;
  }
#endif
  dx = d;
  sx = d * static_cast<float>(s[0] + s[1]);
  s16[0] = s[0];
  s16[1] = s[1];
}

// `pad_to`: rows allocated as a multiple of it, the extra ones zero (an AMX tile reads 16 rows).
Act quantize(const float* x, int64_t M, int64_t K, int64_t pad_to = 1) {
  const int64_t P = (M + pad_to - 1) / pad_to * pad_to;
  Act a{M, K, std::vector<int8_t>(P * K), std::vector<float>(P * K / 32), std::vector<float>(P * K / 32),
        std::vector<int32_t>(P * K / 16)};
  const int64_t nc = K / 32;
  at::parallel_for(0, M * nc, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_chunk(x + i * 32, a.xq.data() + i * 32, a.dx[i], a.sx[i], a.s16.data() + 2 * i);
  });
  return a;
}

// ---- the kernel ----------------------------------------------------------------------------------

// Vector v (k = 4v .. 4v + 3 of the chunk at q) of G lanes' unsigned quants (MX: MXFP4's codes
// looked up into k[code] + 12).
template <int BITS, int VV, bool MX = false>
inline I quants(const uint8_t* q) {
  if constexpr (BITS == 8) {
    return Isa::load_i(q + VV * 4 * G);
  } else if constexpr (BITS == 6) {  // p[VV / 4][j] (see the layout at the top)
    const uint8_t* p = q + (VV / 4) * 3 * 4 * G;
    if constexpr (VV % 4 < 3) {
      return Isa::and_(Isa::load_i(p + (VV % 4) * 4 * G), 0x3f3f3f3f);
    } else {
      const I a = Isa::and_(Isa::shr<6>(Isa::load_i(p)), 0x03030303);
      const I b = Isa::and_(Isa::shr<4>(Isa::load_i(p + 4 * G)), 0x0c0c0c0c);
      const I c = Isa::and_(Isa::shr<2>(Isa::load_i(p + 8 * G)), 0x30303030);
      return Isa::or_(Isa::or_(a, b), c);
    }
  } else {
    const I n = Isa::load_i(q + (VV / 2) * 4 * G);
    I u = VV % 2 == 0 ? Isa::and_(n, 0x0f0f0f0f) : Isa::and_(Isa::shr<4>(n), 0x0f0f0f0f);
    if constexpr (MX) return Isa::lut_bytes(u, MX_U);
    if constexpr (BITS == 5) {  // bit VV of each byte -> bit 4
      const I h = Isa::load_i(q + 16 * G);
      if constexpr (VV < 4) u = Isa::or_(u, Isa::and_(Isa::shl<4 - VV>(h), 0x10101010));
      else if constexpr (VV == 4) u = Isa::or_(u, Isa::and_(h, 0x10101010));
      else u = Isa::or_(u, Isa::and_(Isa::shr<VV - 4>(h), 0x10101010));
    }
    return u;
  }
}

// One row (a decode step), 4-bit quants (not MXFP4's looked-up codes): a chunk's high nibbles meet x
// in place, as 16 u (0xf0 masked, no shift: a byte 16 u <= 240 is still vpdpbusd's unsigned
// operand), in their own sum, exactly 16 times the sum of u x, taken back by one arithmetic shift a
// chunk. 8 integer operations a chunk where the shifted nibbles took 12.
inline void chunk_dots_4bit_one_row(const uint8_t* q, const int8_t* xq, I* s0) {
  I lo = Isa::zero_i(), hi = Isa::zero_i();
  for (int p = 0; p < 4; ++p) {
    const I n = Isa::load_i(q + p * 4 * G);
    lo = Isa::dot4(lo, Isa::and_(n, 0x0f0f0f0f), Isa::bcast4(xq + 8 * p));
    hi = Isa::dot4(hi, Isa::and_(n, static_cast<int>(0xf0f0f0f0u)), Isa::bcast4(xq + 8 * p + 4));
  }
  s0[0] = Isa::add_i(lo, Isa::sra_i<4>(hi));
}

// For rows r < R: s0[r] (and s1[r]: the chunk's second 16 weights, Q6_K) += the chunk's integer
// dot products, xq pointing at row 0's chunk.
template <int BITS, bool SPLIT, int R, int VV = 0, bool MX = false>
inline void chunk_dots(const uint8_t* q, const int8_t* xq, int64_t K, I* s0, I* s1) {
  if constexpr (VV < 8) {
    const I u = quants<BITS, VV, MX>(q);
    for (int r = 0; r < R; ++r) {
      const I xb = Isa::bcast4(xq + r * K + 4 * VV);
      I& s = SPLIT && VV >= 4 ? s1[r] : s0[r];
      s = BITS == 8 ? octavo_quant::dot4_wide(s, u, xb) : Isa::dot4(s, u, xb);
    }
    chunk_dots<BITS, SPLIT, R, VV + 1, MX>(q, xq, K, s0, s1);
  }
}

// Without VNNI: a chunk's vectors' vpmaddubsw results summed in int16 over a run, widened to int32
// (vpmaddwd) once a run instead of once a vector: 9 multiply-port instructions a chunk and row where
// dot4 took 16 (4-bit). A run is as long as keeps every int16 sum exact: a vpmaddubsw lane is at
// most 2 x 127 x u_max, so 8 vectors of 4-bit quants (3,810 each), 4 of 5-bit (7,874) or of MXFP4's
// 0..24 (6,096), 2 of 6-bit (16,002); 8-bit quants go in as nibbles (8 vectors each). The integers
// are those of dot4, so every result keeps its bits.
template <int BITS, bool MX>
constexpr int i16_run() { return BITS == 6 ? 2 : (BITS == 5 || MX) ? 4 : 8; }

// The R running sums held in registers at this point: without it GCC computed all 8 x R products of
// a chunk first and summed them after (reassociating the int16 adds), spilling ~45 vectors a chunk
// to the stack with 16 ymm registers (seen in the disassembly of the Q4_K kernel at 4 rows).
template <int R>
inline void pin_sums(I* t) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // I is a vector register (the plain C++ I is not)
  for (int r = 0; r < R; ++r) asm volatile("" : "+v"(t[r]));
#else
  (void)t;
#endif
}

template <int BITS, bool SPLIT, int R, int VV = 0, bool MX = false>
inline void chunk_dots_i16(const uint8_t* q, const int8_t* xq, int64_t K, I* s0, I* s1, I* t, I* h) {
  if constexpr (VV < 8) {
    const I u = quants<BITS, VV, MX>(q);
    if constexpr (BITS == 8) {  // u = lo + 16 hi, each run of 8 in int16
      const I lo = Isa::and_(u, 0x0f0f0f0f), hi = Isa::and_(Isa::shr<4>(u), 0x0f0f0f0f);
      for (int r = 0; r < R; ++r) {
        const I xb = Isa::bcast4(xq + r * K + 4 * VV);
        const I pl = Isa::madd_u8s8(lo, xb), ph = Isa::madd_u8s8(hi, xb);
        t[r] = VV == 0 ? pl : Isa::add_i16(t[r], pl);
        h[r] = VV == 0 ? ph : Isa::add_i16(h[r], ph);
      }
      pin_sums<R>(t);
      pin_sums<R>(h);
      if constexpr (VV == 7)
        for (int r = 0; r < R; ++r)
          s0[r] = Isa::add_i(s0[r], Isa::add_i(Isa::widen_i16(t[r]), Isa::shl<4>(Isa::widen_i16(h[r]))));
    } else {
      constexpr int RUN = i16_run<BITS, MX>();
      for (int r = 0; r < R; ++r) {
        const I p = Isa::madd_u8s8(u, Isa::bcast4(xq + r * K + 4 * VV));
        t[r] = VV % RUN == 0 ? p : Isa::add_i16(t[r], p);
      }
      pin_sums<R>(t);
      if constexpr (VV % RUN == RUN - 1)
        for (int r = 0; r < R; ++r) {
          I& s = SPLIT && VV >= 4 ? s1[r] : s0[r];
          s = Isa::add_i(s, Isa::widen_i16(t[r]));
        }
    }
    chunk_dots_i16<BITS, SPLIT, R, VV + 1, MX>(q, xq, K, s0, s1, t, h);
  }
}

std::atomic<bool> amx_on{false};
constexpr int64_t AMX_MIN_ROWS = 16;

#if OCTAVO_AMX
constexpr int AMX_ROWS = 16;

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0 = C (16 rows x 16 int32), 1 = A (16 rows x KT activation bytes), 2 = B (KT / 4 rows x
// 16 columns x 4 weight bytes). KT: 32 (a chunk), 16 for Q6_K (a scale per 16 weights).
inline void load_tile_config(int kt) {
  alignas(64) TileConfig cfg{};
  cfg.palette = 1;
  cfg.rows[0] = 16;
  cfg.colsb[0] = 64;
  cfg.rows[1] = 16;
  cfg.colsb[1] = static_cast<uint16_t>(kt);
  cfg.rows[2] = static_cast<uint8_t>(kt / 4);
  cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
}

template <int BITS, bool MX, int VV = 0>
inline void unpack_chunk(const uint8_t* q, uint8_t* b) {
  if constexpr (VV < 8) {
    _mm512_store_si512(b + 64 * VV, quants<BITS, VV, MX>(q));
    unpack_chunk<BITS, MX, VV + 1>(q, b);
  }
}

// The chunk's dot products for 16 rows through one (two for Q6_K) tile multiply.
template <int BITS, bool SPLIT, bool MX>
inline void amx_dots(const uint8_t* q, const int8_t* xq, int64_t K, I* s0, I* s1) {
  alignas(64) uint8_t b[8 * 64];
  alignas(64) int32_t c[16 * 16];
  unpack_chunk<BITS, MX>(q, b);
  for (int half = 0; half < (SPLIT ? 2 : 1); ++half) {
    _tile_loadd(1, xq + 16 * half, K);
    _tile_loadd(2, b + 256 * half, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, c, 64);
    I* s = half == 0 ? s0 : s1;
    for (int r = 0; r < AMX_ROWS; ++r) s[r] = _mm512_load_si512(c + 16 * r);
  }
}
#endif

// ---- AMX-BF16: prompt rows ----------------------------------------------------------------------
//
// Many rows at once (a prompt's chunk) through bfloat16 tiles: a group's G = 16 output rows are
// rebuilt from the same tiles as above (w = D * u + B per chunk, in float32), rounded to bfloat16
// into the B-tile layout (a tile row holds k = 2p, 2p + 1 of the 16 columns, as pairs), and every
// 16 rows of x (rounded to bfloat16) meet them through tdpbf16ps, K = 32 a tile product, in order
// of k from zero: a row's sums never depend on which other rows share the call (the same bits alone
// or in a batch; tested). Products of bfloat16 values are exact in float32; the cost is the
// rounding of x and of w to 8 significant bits (measured by `octavo eval`).
std::atomic<bool> amx_bf16_on{false};

#if OCTAVO_AMX_BF16
// The chunk's scale D and offset B per column: w = D * u + B (Q6_K: half 1 is the second 16 weights).
template <int64_t F>
inline void chunk_scale(const uint8_t* t, int64_t ch, int half, V& D, V& B) {
  constexpr Spec S = spec(F);
  const V d = S.kind == kMx ? Isa::e8m0_half(t) : Isa::halves(t);
  if constexpr (S.kind == kOffset || S.kind == kMx) {
    D = d;
    B = Isa::mul(d, Isa::set1(-static_cast<float>(S.offset)));
  } else if constexpr (S.kind == kMin) {
    D = d;
    B = Isa::halves(t + 2 * G);
  } else if constexpr (S.kind == kKMin) {
    D = Isa::mul(d, Isa::to_float(Isa::bytes_u(t + (4 + ch) * G)));
    B = Isa::mul(Isa::mul(Isa::halves(t + 2 * G), Isa::set1(-1.f)), Isa::to_float(Isa::bytes_u(t + (12 + ch) * G)));
  } else {
    D = Isa::mul(d, Isa::to_float(Isa::bytes_s(t + (2 + 2 * ch + half) * G)));
    B = Isa::mul(D, Isa::set1(-32.f));
  }
}

// Pairs (a[c], b[c]) of bfloat16 for c = 0..15: one B-tile row.
inline __m512i bf16_pairs(V a, V b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                       20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
}

// Vector VV of a chunk (k = 4 VV .. 4 VV + 3 of 16 columns) -> B-tile rows 2 VV, 2 VV + 1.
template <int64_t F, int VV = 0>
inline void chunk_bf16(const uint8_t* q, const V* D, const V* B, uint8_t* rows) {
  if constexpr (VV < 8) {
    const int h = spec(F).kind == kK6 && VV >= 4 ? 1 : 0;
    const I u = quants<spec(F).bits, VV, spec(F).kind == kMx>(q);
    V w[4];
    for (int j = 0; j < 4; ++j) w[j] = Isa::fma(D[h], Isa::to_float(Isa::and_(_mm512_srli_epi32(u, 8 * j), 0xff)), B[h]);
    _mm512_store_si512(rows + 64 * (2 * VV), bf16_pairs(w[0], w[1]));
    _mm512_store_si512(rows + 64 * (2 * VV + 1), bf16_pairs(w[2], w[3]));
    chunk_bf16<F, VV + 1>(q, D, B, rows);
  }
}

// A group's weights [K] x 16 columns as B tiles: K / 2 rows of 64 bytes.
template <int64_t F>
void group_bf16(const uint8_t* tiles, int64_t K, uint8_t* wb) {
  constexpr Spec S = spec(F);
  constexpr int64_t TB = tile_bytes(F), NCH = S.block / 32, CU = chunk_units(S.bits) * G;
  for (int64_t blk = 0; blk < K / S.block; ++blk) {
    const uint8_t* t = tiles + blk * TB;
    for (int64_t ch = 0; ch < NCH; ++ch) {
      V D[2], B[2];
      chunk_scale<F>(t, ch, 0, D[0], B[0]);
      if constexpr (S.kind == kK6) chunk_scale<F>(t, ch, 1, D[1], B[1]);
      chunk_bf16<F>(t + S.head * G + ch * CU, D, B, wb + (blk * NCH + ch) * 1024);
    }
  }
}

inline void load_bf16_tile_config() {
  alignas(64) TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 5; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Tiles 0, 1: C of row tiles r, r + 16; 2, 3: their A (16 rows x 32 bfloat16); 4: B.
template <int64_t F>
void run_bf16(const uint16_t* xb, int64_t M, int64_t rows, int64_t K, const uint8_t* packed, int64_t N, float* out) {
  const int64_t num_groups = (N + G - 1) / G, group_bytes = K / spec(F).block * tile_bytes(F);
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    load_bf16_tile_config();
    std::vector<uint8_t> buf(K / 2 * 64 + 64);
    uint8_t* wb = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    alignas(64) float c[2][16 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      group_bf16<F>(packed + g * group_bytes, K, wb);
      const int64_t cols = std::min<int64_t>(G, N - g * G);
      for (int64_t r = 0; r < M; r += 32) {  // M padded to 32
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += 32) {
          // the next chunk's three tiles into L1: a tile load that misses it waits on each line
          // (measured 1.4-2.7x faster with this, tools/bench_quant_kernels.py)
          const auto* a0 = reinterpret_cast<const char*>(xb + r * K + (k + 32) * 16);
          const auto* a1 = reinterpret_cast<const char*>(xb + (r + 16) * K + (k + 32) * 16);
          const auto* b1 = reinterpret_cast<const char*>(wb + (k + 32) * 32);
          if (k + 32 < K)
            for (int l = 0; l < 1024; l += 64) {
              __builtin_prefetch(a0 + l, 0, 3);
              __builtin_prefetch(a1 + l, 0, 3);
              __builtin_prefetch(b1 + l, 0, 3);
            }
          _tile_loadd(4, wb + k * 32, 64);  // a chunk of 32 k: 16 tile rows of 64 bytes
          _tile_loadd(2, xb + r * K + k * 16, 64);  // x in tiles: [M / 16][K / 32][16][32]
          _tile_loadd(3, xb + (r + 16) * K + k * 16, 64);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        for (int64_t i = 0; i < 32 && r + i < rows; ++i) std::memcpy(out + (r + i) * N + g * G, c[i / 16] + (i % 16) * 16, cols * 4);
      }
    }
    _tile_release();
  });
}
#endif

// out[r][0..cols) for rows r < R (from row0 of the activations; only r < valid stored) of one
// group of G output rows. AMX: the dot products through tiles (R = 16, rows padded to 16).
template <int64_t F, int R, bool AMX = false>
void group_i8(const Act& a, int64_t row0, const uint8_t* tiles, float* out, int64_t out_stride, int64_t cols,
              int64_t valid = R) {
  constexpr Spec S = spec(F);
  constexpr int64_t TB = tile_bytes(F), NCH = S.block / 32, CU = chunk_units(S.bits) * G;
  const int64_t K = a.K, nb = K / S.block, nc = K / 32;
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Isa::zero();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* t = tiles + blk * TB;
    octavo_quant::prefetch_ahead<TB>(t);
    const V d = S.kind == kMx ? Isa::e8m0_half(t) : Isa::halves(t);
    [[maybe_unused]] const V m = S.kind == kMin || S.kind == kKMin ? Isa::halves(t + 2 * G) : Isa::zero();
    for (int64_t ch = 0; ch < NCH; ++ch) {
      const int64_t kc = blk * NCH + ch;  // the chunk's index in the row
      I s0[R], s1[R];
      const uint8_t* q = t + S.head * G + ch * CU;
      const int8_t* xq = a.xq.data() + row0 * K + kc * 32;
#if OCTAVO_AMX
      if constexpr (AMX) {
        amx_dots<S.bits, S.kind == kK6, S.kind == kMx>(q, xq, K, s0, s1);
      } else
#endif
      {
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = Isa::zero_i();
        if constexpr (Isa::vnni && R == 1 && S.bits == 4 && S.kind != kMx) {
          chunk_dots_4bit_one_row(q, xq, s0);
        } else if constexpr (Isa::vnni) {
          chunk_dots<S.bits, S.kind == kK6, R, 0, S.kind == kMx>(q, xq, K, s0, s1);
        } else {
          I t[R], h[R];
          chunk_dots_i16<S.bits, S.kind == kK6, R, 0, S.kind == kMx>(q, xq, K, s0, s1, t, h);
        }
      }
      const int64_t at = row0 * nc + kc;
      if constexpr (S.kind == kOffset || S.kind == kMx) {
        for (int r = 0; r < R; ++r) {
          const int32_t sum = a.s16[2 * (at + r * nc)] + a.s16[2 * (at + r * nc) + 1];
          const V isum = Isa::to_float(Isa::sub_i(s0[r], Isa::set1_i(S.offset * sum)));
          acc[r] = Isa::fma(Isa::mul(d, Isa::set1(a.dx[at + r * nc])), isum, acc[r]);
        }
      } else if constexpr (S.kind == kMin) {
        for (int r = 0; r < R; ++r) {
          acc[r] = Isa::fma(Isa::mul(d, Isa::set1(a.dx[at + r * nc])), Isa::to_float(s0[r]), acc[r]);
          acc[r] = Isa::fma(m, Isa::set1(a.sx[at + r * nc]), acc[r]);
        }
      } else if constexpr (S.kind == kKMin) {
        const V D = Isa::mul(d, Isa::to_float(Isa::bytes_u(t + (4 + ch) * G)));
        const V Mn = Isa::mul(m, Isa::to_float(Isa::bytes_u(t + (12 + ch) * G)));
        for (int r = 0; r < R; ++r) {
          acc[r] = Isa::fma(Isa::mul(D, Isa::set1(a.dx[at + r * nc])), Isa::to_float(s0[r]), acc[r]);
          acc[r] = Isa::fma(Mn, Isa::set1(-a.sx[at + r * nc]), acc[r]);
        }
      } else {
        const V D0 = Isa::mul(d, Isa::to_float(Isa::bytes_s(t + (2 + 2 * ch) * G)));
        const V D1 = Isa::mul(d, Isa::to_float(Isa::bytes_s(t + (3 + 2 * ch) * G)));
        for (int r = 0; r < R; ++r) {
          const int32_t* s16 = a.s16.data() + 2 * (at + r * nc);
          const V dx = Isa::set1(a.dx[at + r * nc]);
          acc[r] = Isa::fma(Isa::mul(D0, dx), Isa::to_float(Isa::sub_i(s0[r], Isa::set1_i(32 * s16[0]))), acc[r]);
          acc[r] = Isa::fma(Isa::mul(D1, dx), Isa::to_float(Isa::sub_i(s1[r], Isa::set1_i(32 * s16[1]))), acc[r]);
        }
      }
    }
  }
  octavo_quant::store_rows(acc, valid, cols, out, out_stride);
}

template <int64_t F, int R = MAX_R>
void group_rows(const Act& a, int64_t row0, int64_t rows, const uint8_t* tiles, float* out, int64_t N, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) return group_i8<F, R>(a, row0, tiles, out, N, cols);
    return group_rows<F, R - 1>(a, row0, rows, tiles, out, N, cols);
  }
}

template <int64_t F>
void run(const Act& a, const uint8_t* packed, int64_t N, float* out, bool amx) {
  const int64_t M = a.M, nb = a.K / spec(F).block, num_groups = (N + G - 1) / G, group_bytes = nb * tile_bytes(F);
  // Each group's tiles (a few KB to a few tens of KB) stay in L1 / L2 while every row chunk uses them.
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
#if OCTAVO_AMX
    if (amx) {  // tile configuration is per thread
      load_tile_config(spec(F).kind == kK6 ? 16 : 32);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t cols = std::min<int64_t>(G, N - g * G);
        for (int64_t m = 0; m < M; m += AMX_ROWS)
          group_i8<F, AMX_ROWS, true>(a, m, packed + g * group_bytes, out + m * N + g * G, N, cols,
                                      std::min<int64_t>(AMX_ROWS, M - m));
      }
      _tile_release();
      return;
    }
#endif
    (void)amx;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cols = std::min<int64_t>(G, N - g * G);
      for (int64_t m = 0; m < M; m += MAX_R)
        group_rows<F>(a, m, std::min<int64_t>(MAX_R, M - m), packed + g * group_bytes, out + m * N + g * G, N, cols);
    }
  });
}

void check_packed(const at::Tensor& packed, int64_t fmt, int64_t N, int64_t K) {
  TORCH_CHECK(valid_format(fmt), "unknown quantization format ", fmt);
  const int64_t block = spec(fmt).block;
  TORCH_CHECK(K % block == 0, "in_features must be a multiple of ", block, ", got ", K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + G - 1) / G && packed.size(1) == K / block && packed.size(2) == tile_bytes(fmt),
              "packed weight must be uint8 [ceil(N / ", G, "), K / ", block, ", ", tile_bytes(fmt), "] (from `pack_i8`)");
}

}  // namespace

// GGUF blocks uint8 [N, K / block * file_bytes] (or the parts of a fused layer, stacked by rows)
// -> the int8-activation layout uint8 [ceil(N / G), K / block, tile_bytes].
at::Tensor pack_i8(const std::vector<at::Tensor>& parts, int64_t fmt) {
  TORCH_CHECK(valid_format(fmt), "unknown quantization format ", fmt);
  const int64_t bb = spec(fmt).file_bytes;
  const octavo_quant::SourceRows src = octavo_quant::source_rows(parts, bb);
  const int64_t N = src.size(), nb = src.row_bytes / bb, num_groups = (N + G - 1) / G, tb = tile_bytes(fmt);
  auto packed = octavo_quant::empty_tiles(N, G, nb, tb);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t g0, int64_t g1) {
    Block f;
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t c = 0; c < G && g * G + c < N; ++c) {
          read_block(fmt, src.row[g * G + c] + b * bb, f);
          write_lane(fmt, f, dst + (g * nb + b) * tb, c);
        }
  });
  return packed;
}

// out [M, N] float32 = x [M, K] float32 (quantized to int8 here) @ W^T, W from `pack_i8`.
void quant_linear_i8(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear_i8 takes float32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(), "x, out: contiguous 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "out must have as many rows as x");
  check_packed(packed, fmt, N, K);
  const bool amx = OCTAVO_AMX && amx_on.load(std::memory_order_relaxed) && M >= AMX_MIN_ROWS;
  const Act a = quantize(x.data_ptr<float>(), M, K, amx ? 16 : 1);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (fmt) {
    case kQ4_0: return run<kQ4_0>(a, pp, N, op, amx);
    case kQ4_1: return run<kQ4_1>(a, pp, N, op, amx);
    case kQ8_0: return run<kQ8_0>(a, pp, N, op, amx);
    case kQ5_0: return run<kQ5_0>(a, pp, N, op, amx);
    case kQ5_1: return run<kQ5_1>(a, pp, N, op, amx);
    case kQ4_K: return run<kQ4_K>(a, pp, N, op, amx);
    case kQ5_K: return run<kQ5_K>(a, pp, N, op, amx);
    case kMXFP4: return run<kMXFP4>(a, pp, N, op, amx);
    default: return run<kQ6_K>(a, pp, N, op, amx);
  }
}

// x [M, K] float32 -> (xq int8 [M, K], dx float32 [M, K / 32]): the activations as the kernel
// quantizes them (for tests against the plain reference).
void quantize_activations_i8(at::Tensor xq, at::Tensor dx, at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x: contiguous float32 [M, K], K a multiple of 32");
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.sizes() == x.sizes() && xq.is_contiguous(), "xq: int8 like x");
  TORCH_CHECK(dx.scalar_type() == at::kFloat && dx.dim() == 2 && dx.size(0) == x.size(0) && dx.size(1) == x.size(1) / 32 &&
                  dx.is_contiguous(), "dx: float32 [M, K / 32]");
  const Act a = quantize(x.data_ptr<float>(), x.size(0), x.size(1));
  std::memcpy(xq.data_ptr<int8_t>(), a.xq.data(), a.xq.size());
  std::memcpy(dx.data_ptr<float>(), a.dx.data(), a.dx.size() * sizeof(float));
}

// out [len(rows), K] float32 = rows `rows` of a `pack_i8` weight, exactly as gguf-py rebuilds them.
void dequantize_rows_i8(at::Tensor out, at::Tensor packed, int64_t fmt, at::Tensor rows, int64_t N) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(), "out: contiguous float32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && rows.size(0) == out.size(0),
              "rows: int64 [len(out)]");
  const int64_t K = out.size(1);
  check_packed(packed, fmt, N, K);
  const int64_t block = spec(fmt).block, nb = K / block, tb = tile_bytes(fmt);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j) TORCH_CHECK(rp[j] >= 0 && rp[j] < N, "row ", rp[j], " out of range [0, ", N, ")");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows.size(0), 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t g = rp[j] / G, c = rp[j] % G;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t k = 0; k < block; ++k) op[j * K + b * block + k] = weight_at(fmt, pp + (g * nb + b) * tb, c, k);
    }
  });
}

bool quant_vnni() { return Isa::vnni; }

void set_weight_prefetch(bool on) { octavo_quant::weight_prefetch = on; }
bool weight_prefetch() { return octavo_quant::weight_prefetch; }

// ---- AMX-INT8: built in, the tile state granted, the instructions really running ----------------

bool amx_built() { return OCTAVO_AMX; }

// Ask Linux for the AMX tile state for this process (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA):
// without it the first tile instruction faults.
bool amx_request() {
#if OCTAVO_AMX
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

// One tile product against plain integer arithmetic (run it in a child process first: on a CPU
// that lists AMX without running it, this dies of SIGILL).
bool amx_selftest() {
#if OCTAVO_AMX
  if (!amx_request()) return false;
  alignas(64) int8_t A[16][32];
  alignas(64) uint8_t B[8][64];
  alignas(64) int32_t C[16][16];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 32; ++j) A[i][j] = static_cast<int8_t>((i * 7 + j * 13) % 255 - 127);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 64; ++j) B[i][j] = static_cast<uint8_t>((i * 31 + j * 17) % 256);
  load_tile_config(32);
  _tile_loadd(1, A, 32);
  _tile_loadd(2, B, 64);
  _tile_zero(0);
  _tile_dpbsud(0, 1, 2);
  _tile_stored(0, C, 64);
  _tile_release();
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      int32_t s = 0;
      for (int k = 0; k < 32; ++k) s += static_cast<int32_t>(A[m][k]) * static_cast<int32_t>(B[k / 4][4 * n + k % 4]);
      if (s != C[m][n]) return false;
    }
  return true;
#else
  return false;
#endif
}

// Use the tiles for steps of 16+ rows from now on (on: after a child's self-test passed); returns
// whether they are in use.
bool amx_enable(bool on) {
  if (!on || !amx_request()) {
    amx_on = false;
    return false;
  }
  amx_on = true;
  return true;
}

// ---- AMX-BF16: entry points --------------------------------------------------------------------

bool amx_bf16_built() { return OCTAVO_AMX_BF16; }

// One bfloat16 tile product of small integers (exact in float32) against plain arithmetic (run it
// in a child process first, as amx_selftest).
bool amx_bf16_selftest() {
#if OCTAVO_AMX_BF16
  if (!amx_request()) return false;
  alignas(64) uint16_t A[16][32];
  alignas(64) uint16_t B[16][32];
  alignas(64) float C[16][16];
  auto bf = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return static_cast<uint16_t>(u >> 16); };
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 32; ++j) {
      A[i][j] = bf(static_cast<float>((i * 7 + j * 13) % 17 - 8));
      B[i][j] = bf(static_cast<float>((i * 5 + j * 11) % 15 - 7));
    }
  load_bf16_tile_config();
  _tile_loadd(2, A, 64);
  _tile_loadd(4, B, 64);
  _tile_zero(0);
  _tile_dpbf16ps(0, 2, 4);
  _tile_stored(0, C, 64);
  _tile_release();
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float s = 0.f;
      for (int k = 0; k < 32; ++k) {
        const float a = static_cast<float>((m * 7 + k * 13) % 17 - 8);
        const float b = static_cast<float>(((k / 2) * 5 + (2 * n + k % 2) * 11) % 15 - 7);
        s += a * b;
      }
      if (s != C[m][n]) return false;
    }
  return true;
#else
  return false;
#endif
}

bool amx_bf16_enable(bool on) {
  amx_bf16_on = on && OCTAVO_AMX_BF16 && amx_request();
  return amx_bf16_on.load();
}

// out [M, N] float32 = x [M, K] @ W^T with x and W rounded to bfloat16 and float32 sums, W from
// `pack_i8` (AVX-512 builds: G = 16): the prompt rows' path of the int8 mode (amx_bf16_enable first).
void quant_linear_bf16_i8(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear_bf16_i8 takes float32 x and out");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(), "x, out: contiguous 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "out must have as many rows as x");
  check_packed(packed, fmt, N, K);
#if OCTAVO_AMX_BF16
  TORCH_CHECK(amx_bf16_on.load(), "AMX-BF16 tiles are not enabled in this process (amx_bf16_enable)");
  const int64_t Mp = (M + 31) / 32 * 32;
  std::vector<uint16_t> xb(static_cast<size_t>(Mp * K), 0);
  const float* xp = x.data_ptr<float>();
  // x rounded to bfloat16 in A tiles [Mp / 16][K / 32][16][32]: a tile's rows 64 bytes apart (rows
  // of K values 2K bytes apart would fall in one L1 set for K = 2048).
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; k += 32)
        _mm512_storeu_si512(xb.data() + (r / 16 * 16) * K + k * 16 + (r % 16) * 32,
                            reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + r * K + k + 16), _mm512_loadu_ps(xp + r * K + k))));
  });
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (fmt) {
    case kQ4_0: return run_bf16<kQ4_0>(xb.data(), Mp, M, K, pp, N, op);
    case kQ4_1: return run_bf16<kQ4_1>(xb.data(), Mp, M, K, pp, N, op);
    case kQ8_0: return run_bf16<kQ8_0>(xb.data(), Mp, M, K, pp, N, op);
    case kQ5_0: return run_bf16<kQ5_0>(xb.data(), Mp, M, K, pp, N, op);
    case kQ5_1: return run_bf16<kQ5_1>(xb.data(), Mp, M, K, pp, N, op);
    case kQ4_K: return run_bf16<kQ4_K>(xb.data(), Mp, M, K, pp, N, op);
    case kQ5_K: return run_bf16<kQ5_K>(xb.data(), Mp, M, K, pp, N, op);
    case kMXFP4: return run_bf16<kMXFP4>(xb.data(), Mp, M, K, pp, N, op);
    default: return run_bf16<kQ6_K>(xb.data(), Mp, M, K, pp, N, op);
  }
#else
  TORCH_CHECK(false, "built without AMX-BF16");
#endif
}
