// The vector ISA the quantized-linear kernels are written against, as a small traits struct, and
// fp16 helpers: G lanes of float; bytes_u/bytes_s widen G bytes to G ints, halves widens G fp16
// values. AVX-512, AVX2 or plain C++, chosen at compile time (the build is per machine).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace octavo_quant {

inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// An E8M0 exponent byte as ggml's e8m0_to_fp32_half reads it: 2^(e - 128), exactly.
inline float e8m0_to_float_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Isa {
  using V = __m512;
  using I = __m512i;
  static constexpr int G = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static I bytes_u(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I bytes_s(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I low_nibble(I v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0f)); }
  static I high_nibble(I v) { return _mm512_srli_epi32(v, 4); }
  static I sub8(I v) { return _mm512_sub_epi32(v, _mm512_set1_epi32(8)); }
  static I and_(I v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I sub(I v, int c) { return _mm512_sub_epi32(v, _mm512_set1_epi32(c)); }
  template <int N> static I shl(I v) { return _mm512_slli_epi32(v, N); }
  template <int N> static I shr(I v) { return _mm512_srli_epi32(v, N); }
  template <int N> static I sra_i(I v) { return _mm512_srai_epi32(v, N); }
  static V to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static V halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // MXFP4: a table of 16 floats, looked up per lane by a 4-bit code; G E8M0 bytes as the scale
  // 2^(e - 128) (ggml's e8m0_to_fp32_half: e < 2 gives the subnormals 2^-128, 2^-127).
  using L = __m512;
  static L lut_load(const float* t) { return _mm512_loadu_ps(t); }
  static V lut16(I code, L t) { return _mm512_permutexvar_ps(code, t); }
  static V e8m0_half(const uint8_t* p) {
    const I e = bytes_u(p), one = _mm512_set1_epi32(1);
    const I normal = _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23);
    const I subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(e, one), subnormal, normal));
  }
  // 4 G bytes at once (4 tile rows of G lanes): shifts move bits within 16-bit lanes (mask after)
  using B = __m512i;
  static B load4(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store4(uint8_t* p, B v) { _mm512_storeu_si512(p, v); }
  static B and4(B v, uint8_t m) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(m))); }
  static B or4(B a, B b) { return _mm512_or_si512(a, b); }
  static B sub4(B v, uint8_t c) { return _mm512_sub_epi8(v, _mm512_set1_epi8(static_cast<char>(c))); }
  template <int N> static B shl4(B v) { return _mm512_slli_epi16(v, N); }
  template <int N> static B shr4(B v) { return _mm512_srli_epi16(v, N); }
  // int8 activations (quant_linear_i8.cpp): 32-bit lanes of 4 bytes; dot4 adds to each lane the
  // sum of its 4 products u (unsigned) x s (signed). With VNNI one vpdpbusd; without, vpmaddubsw
  // (pairs to int16, saturating: fine for u < 64, see dot4_wide) then vpmaddwd.
  static I load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
  static I zero_i() { return _mm512_setzero_si512(); }
  static I set1_i(int32_t v) { return _mm512_set1_epi32(v); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  // each byte (0..15) replaced by table[byte]: vpshufb with the 16-byte table in every 128-bit lane
  static I lut_bytes(I idx, const uint8_t* table) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), idx);
  }
  // without VNNI (quant_linear_i8.cpp's chunk_dots_i16): vpmaddubsw's int16 pair sums, added in
  // int16 over a run of vectors, widened to int32 pairs once a run
  static I madd_u8s8(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I add_i16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I widen_i16(I v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
#if defined(__AVX512VNNI__)
  static constexpr bool vnni = true;
  static I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
  static constexpr bool vnni = false;
  static I dot4(I acc, I u, I s) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
  }
#endif
  static constexpr const char* name = "avx512";
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Isa {
  using V = __m256;
  using I = __m256i;
  static constexpr int G = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static I bytes_u(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I bytes_s(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I low_nibble(I v) { return _mm256_and_si256(v, _mm256_set1_epi32(0x0f)); }
  static I high_nibble(I v) { return _mm256_srli_epi32(v, 4); }
  static I sub8(I v) { return _mm256_sub_epi32(v, _mm256_set1_epi32(8)); }
  static I and_(I v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I sub(I v, int c) { return _mm256_sub_epi32(v, _mm256_set1_epi32(c)); }
  template <int N> static I shl(I v) { return _mm256_slli_epi32(v, N); }
  template <int N> static I shr(I v) { return _mm256_srli_epi32(v, N); }
  template <int N> static I sra_i(I v) { return _mm256_srai_epi32(v, N); }
  static V to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static V halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  struct L { __m256 lo, hi; };  // a table's entries 0-7 and 8-15 (one permute reaches 8)
  static L lut_load(const float* t) { return {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)}; }
  static V lut16(I code, L t) {
    const V lo = _mm256_permutevar8x32_ps(t.lo, code), hi = _mm256_permutevar8x32_ps(t.hi, code);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));  // bit 3 picks
  }
  static V e8m0_half(const uint8_t* p) {
    const I e = bytes_u(p), one = _mm256_set1_epi32(1);
    const I normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
    const I subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(e, one)));
  }
  using B = __m256i;
  static B load4(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store4(uint8_t* p, B v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static B and4(B v, uint8_t m) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(m))); }
  static B or4(B a, B b) { return _mm256_or_si256(a, b); }
  static B sub4(B v, uint8_t c) { return _mm256_sub_epi8(v, _mm256_set1_epi8(static_cast<char>(c))); }
  template <int N> static B shl4(B v) { return _mm256_slli_epi16(v, N); }
  template <int N> static B shr4(B v) { return _mm256_srli_epi16(v, N); }
  static I load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
  static I zero_i() { return _mm256_setzero_si256(); }
  static I set1_i(int32_t v) { return _mm256_set1_epi32(v); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I lut_bytes(I idx, const uint8_t* table) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), idx);
  }
  static I madd_u8s8(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I add_i16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen_i16(I v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
#if defined(__AVXVNNI__)
  static constexpr bool vnni = true;
  static I dot4(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
  static constexpr bool vnni = false;
  static I dot4(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
#endif
  static constexpr const char* name = "avx2";
};
#else
struct Isa {  // plain C++ over G-float arrays (the compiler vectorises what it can)
  static constexpr int G = 8;
  struct V { float v[G]; };
  struct I { int32_t v[G]; };
  static V zero() { V z{}; return z; }
  static V load(const float* p) { V r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void store(float* p, V v) { std::memcpy(p, v.v, sizeof v.v); }
  static V set1(float x) { V r; for (float& e : r.v) e = x; return r; }
  static V fma(V a, V b, V c) { for (int i = 0; i < G; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
  static V mul(V a, V b) { for (int i = 0; i < G; ++i) a.v[i] *= b.v[i]; return a; }
  static V add(V a, V b) { for (int i = 0; i < G; ++i) a.v[i] += b.v[i]; return a; }
  static I bytes_u(const uint8_t* p) { I r; for (int i = 0; i < G; ++i) r.v[i] = p[i]; return r; }
  static I bytes_s(const uint8_t* p) { I r; for (int i = 0; i < G; ++i) r.v[i] = static_cast<int8_t>(p[i]); return r; }
  static I low_nibble(I a) { for (auto& e : a.v) e &= 0x0f; return a; }
  static I high_nibble(I a) { for (auto& e : a.v) e >>= 4; return a; }
  static I sub8(I a) { for (auto& e : a.v) e -= 8; return a; }
  static I and_(I a, int m) { for (auto& e : a.v) e &= m; return a; }
  static I or_(I a, I b) { for (int i = 0; i < G; ++i) a.v[i] |= b.v[i]; return a; }
  static I sub(I a, int c) { for (auto& e : a.v) e -= c; return a; }
  template <int N> static I shl(I a) { for (auto& e : a.v) e = static_cast<int32_t>(static_cast<uint32_t>(e) << N); return a; }
  template <int N> static I shr(I a) { for (auto& e : a.v) e = static_cast<int32_t>(static_cast<uint32_t>(e) >> N); return a; }
  template <int N> static I sra_i(I a) { for (auto& e : a.v) e >>= N; return a; }
  static V to_float(I a) { V r; for (int i = 0; i < G; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }
  static V halves(const uint8_t* p) { V r; for (int i = 0; i < G; ++i) r.v[i] = fp16_to_float(load_u16(p + 2 * i)); return r; }
  struct L { float v[16]; };
  static L lut_load(const float* t) { L r; std::memcpy(r.v, t, sizeof r.v); return r; }
  static V lut16(I code, const L& t) { V r; for (int i = 0; i < G; ++i) r.v[i] = t.v[code.v[i] & 15]; return r; }
  static V e8m0_half(const uint8_t* p) { V r; for (int i = 0; i < G; ++i) r.v[i] = e8m0_to_float_half(p[i]); return r; }
  struct B { uint8_t v[4 * G]; };  // byte-wise here: the vector paths' 16-bit shifts then masks agree
  static B load4(const uint8_t* p) { B r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static void store4(uint8_t* p, B v) { std::memcpy(p, v.v, sizeof v.v); }
  static B and4(B a, uint8_t m) { for (auto& e : a.v) e &= m; return a; }
  static B or4(B a, B b) { for (int i = 0; i < 4 * G; ++i) a.v[i] |= b.v[i]; return a; }
  static B sub4(B a, uint8_t c) { for (auto& e : a.v) e = static_cast<uint8_t>(e - c); return a; }
  template <int N> static B shl4(B a) { for (auto& e : a.v) e = static_cast<uint8_t>(e << N); return a; }
  template <int N> static B shr4(B a) { for (auto& e : a.v) e = static_cast<uint8_t>(e >> N); return a; }
  static I load_i(const uint8_t* p) { I r; std::memcpy(r.v, p, sizeof r.v); return r; }
  static I bcast4(const int8_t* p) { I r; int32_t v; std::memcpy(&v, p, 4); for (auto& e : r.v) e = v; return r; }
  static I zero_i() { I z{}; return z; }
  static I set1_i(int32_t x) { I r; for (auto& e : r.v) e = x; return r; }
  static I add_i(I a, I b) { for (int i = 0; i < G; ++i) a.v[i] += b.v[i]; return a; }
  static I sub_i(I a, I b) { for (int i = 0; i < G; ++i) a.v[i] -= b.v[i]; return a; }
  static I lut_bytes(I idx, const uint8_t* table) {
    uint8_t b[4 * G];
    std::memcpy(b, idx.v, sizeof b);
    for (auto& e : b) e = table[e & 15];
    std::memcpy(idx.v, b, sizeof b);
    return idx;
  }
  static constexpr bool vnni = false;
  // (no int16 lanes here: each 32-bit lane's 4 products summed exactly, widening a no-op)
  static I madd_u8s8(I u, I s) { return dot4(zero_i(), u, s); }
  static I add_i16(I a, I b) { return add_i(a, b); }
  static I widen_i16(I v) { return v; }
  static I dot4(I acc, I u, I s) {  // exact, no int16 step: the vector fallbacks' saturation cannot happen here
    for (int i = 0; i < G; ++i) {
      uint8_t ub[4];
      int8_t sb[4];
      std::memcpy(ub, &u.v[i], 4);
      std::memcpy(sb, &s.v[i], 4);
      for (int j = 0; j < 4; ++j) acc.v[i] += static_cast<int32_t>(ub[j]) * sb[j];
    }
    return acc;
  }
  static constexpr const char* name = "scalar";
};
#endif

// Ask for the TB bytes PREFETCH_BYTES past a tile the kernel is about to read (the tile there may
// be in the next group), into L2. A decode step streams each layer once from DRAM, and the
// hardware prefetcher alone left the kernels short of a plain read's bandwidth: on a 2-core Xeon
// (a plain 2-thread sum: 24 GB/s), int8 Q8_0 layers at one row streamed 22.6 -> 26.0 GB/s with
// 8 KB ahead into L2 against one or two tiles ahead into L1 (docs/BENCHMARKS.md). On an AMD Zen 5
// (53-97 GB/s) the prefetches were the cost, not the help: one instruction per 64 bytes, 12% of
// the Q4_K kernel's samples, 20% of its in-cache rate, and the 1B shape's decode forward 6% faster
// without them side by side; so `weight_prefetch` (set at load: octavo.cpu_features.weight_prefetch)
// turns them off where that was measured.
constexpr int64_t PREFETCH_BYTES = 8192;
inline bool weight_prefetch = true;
template <int64_t TB>
inline void prefetch_ahead(const uint8_t* tile) {
  if (!weight_prefetch) return;
  for (int64_t l = 0; l < TB; l += 64) __builtin_prefetch(tile + PREFETCH_BYTES + l, 0, 2);
}

// A kernel's accumulators acc[r] (r < rows: one vector of G output columns each) into rows of out,
// `stride` floats apart; only the first `cols` lanes where a group's last columns pass N.
inline void store_rows(const Isa::V* acc, int64_t rows, int64_t cols, float* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    if (cols == Isa::G) {
      Isa::store(out + r * stride, acc[r]);
    } else {
      float tmp[Isa::G];
      Isa::store(tmp, acc[r]);
      std::copy(tmp, tmp + cols, out + r * stride);
    }
  }
}

// dot4 for u of a full byte (Q8_0's q + 128): vpmaddubsw's int16 pairs could saturate (255 x 127
// x 2 > 32767), so without VNNI the nibbles go in separately, the high one's sum times 16.
inline Isa::I dot4_wide(Isa::I acc, Isa::I u, Isa::I s) {
  if constexpr (Isa::vnni) {
    return Isa::dot4(acc, u, s);
  } else {
    const Isa::I lo = Isa::and_(u, 0x0f0f0f0f), hi = Isa::and_(Isa::shr<4>(u), 0x0f0f0f0f);
    return Isa::add_i(Isa::dot4(acc, lo, s), Isa::shl<4>(Isa::dot4(Isa::zero_i(), hi, s)));
  }
}

// Per row of x [M, K], the sum of each run of S values: the kernels' min / offset term
// (sum_i (d q_i + m) x_i = d sum_i q_i x_i + m sum_i x_i). Summed in order, so every kernel that
// calls it rounds the same way.
// `parallel_for`: at::parallel_for's signature (this header does not include ATen).
template <typename ParallelFor>
inline std::vector<float> block_sums(const float* x, int64_t M, int64_t K, int64_t S, ParallelFor parallel_for) {
  const int64_t nb = K / S;
  std::vector<float> xs(M * nb);
  parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < S; ++i) s += x[r * K + b * S + i];
        xs[r * nb + b] = s;
      }
  });
  return xs;
}

}  // namespace octavo_quant
