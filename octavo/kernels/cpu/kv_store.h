// The KV cache's element formats as the CPU kernels read and write them: float32, bfloat16,
// float16, and int8 rows of head_dim values followed by one float16 scale per group of 32 of them
// (value = q * scale, scale = amax / 127 over the group). kernels/kv_format.py defines the layout
// and is the reference: a row written here holds the same bytes as its quantize_rows, and a value
// read here is its dequantize_rows'.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace octavo {

constexpr int64_t kKvGroup = 32;  // int8 values one scale covers

template <typename E>
constexpr bool kv_scaled() {
  return std::is_same_v<E, int8_t>;
}

template <typename E>
inline float kv_value(const E* row, int64_t d) {
  return static_cast<float>(row[d]);
}

// The scale of group g of an int8 row of head_dim values (its float16 after the values).
inline float kv_group_scale(const int8_t* row, int64_t head_dim, int64_t g) {
  c10::Half h;
  std::memcpy(&h, row + head_dim + 2 * g, sizeof h);
  return static_cast<float>(h);
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight values of a row from element d on, as float32 (unscaled for int8: the caller applies the scale).
template <typename E>
inline __m256 kv_load8(const E* p);
template <>
inline __m256 kv_load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 kv_load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // a bfloat16 is a float32's top half
}
template <>
inline __m256 kv_load8<c10::Half>(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}
template <>
inline __m256 kv_load8<int8_t>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Writes x[0, head_dim) as one row of E at dst (int8: quantized, then its scales). The int8 rule is
// kv_format.quantize_rows': per group of 32, scale = float16(min(amax / 127, 65504)), then
// q = nearest-even(x / max(scale, FLT_MIN)) in +-127.
template <typename E>
inline void kv_store_row(const float* __restrict x, E* __restrict dst, int64_t head_dim) {
  if constexpr (std::is_same_v<E, float>) {
    std::copy(x, x + head_dim, dst);
  } else if constexpr (std::is_same_v<E, int8_t>) {
    for (int64_t g = 0; g * kKvGroup < head_dim; ++g) {
      const int64_t lo = g * kKvGroup, hi = std::min(head_dim, lo + kKvGroup);
      float amax = 0.f;
      for (int64_t d = lo; d < hi; ++d) amax = std::max(amax, std::fabs(x[d]));
      const c10::Half scale(std::min(amax / 127.f, 65504.f));
      const float div = std::max(static_cast<float>(scale), FLT_MIN);
      for (int64_t d = lo; d < hi; ++d) {
        const float q = std::nearbyint(x[d] / div);  // the default rounding mode: to nearest, ties to even
        dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
      }
      std::memcpy(dst + head_dim + 2 * g, &scale, sizeof scale);
    }
  } else if constexpr (std::is_same_v<E, c10::Half>) {
    // clamped to float16's range (kv_format.quantize_rows: a value past it is held as the largest, not inf)
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = E(x[d] > 65504.f ? 65504.f : x[d] < -65504.f ? -65504.f : x[d]);
  } else {
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = E(x[d]);  // c10's conversions round to nearest even, as torch's .to()
  }
}

}  // namespace octavo
