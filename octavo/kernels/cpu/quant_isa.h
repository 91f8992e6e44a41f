// The vector ISA the quantized-linear kernels are written against, as a small traits struct, and
// fp16 helpers: G lanes of float; bytes_u/bytes_s widen G bytes to G ints, halves widens G fp16
// values. AVX-512, AVX2 or plain C++, chosen at compile time (the build is per machine).
#pragma once

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
  static V to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static V halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
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
  static V to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static V halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
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
  static V to_float(I a) { V r; for (int i = 0; i < G; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }
  static V halves(const uint8_t* p) { V r; for (int i = 0; i < G; ++i) r.v[i] = fp16_to_float(load_u16(p + 2 * i)); return r; }
  static constexpr const char* name = "scalar";
};
#endif

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
