// Vector exp for the CPU kernels: Cephes' single-precision algorithm (range reduction by ln 2,
// a degree-5 polynomial), within ~2 ulp of expf over [-88.38, 88.38]; inputs are clamped there.
// One definition per vector width, shared by the softmax (paged_attention.cpp) and SiLU
// (layer_ops.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace octavo {

inline __m256 exp_avx2(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  __m256 v = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(v, log2e, half));
  v = _mm256_fnmadd_ps(fx, c2, _mm256_fnmadd_ps(fx, c1, v));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(v, v), v), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
inline __m512 exp_avx512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), half = _mm512_set1_ps(0.5f);
  const __m512 c1 = _mm512_set1_ps(0.693359375f), c2 = _mm512_set1_ps(-2.12194440e-4f);
  __m512 v = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 fx = _mm512_floor_ps(_mm512_fmadd_ps(v, log2e, half));
  v = _mm512_fnmadd_ps(fx, c2, _mm512_fnmadd_ps(fx, c1, v));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(v, v), v), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

}  // namespace octavo

#endif
