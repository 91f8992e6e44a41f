// The small per-layer ops of a decoder step, fused: RMSNorm (with the residual add before it),
// rotary embedding with the KV-cache write, and SiLU(gate) x up. At batch 1 each of these is a few microseconds of
// arithmetic behind tens of microseconds of op dispatch and temporaries when written as torch
// ops (measured: norm + rotary + KV write were 2.7 of a 13 ms step at batch 1; docs/BENCHMARKS.md).
// Same arithmetic as octavo/kernels/reference.py, float32 only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_store.h"
#include "vec_math.h"

namespace {

// y = w * (x / sqrt(mean(x^2) + eps)) for one row of `dim`.
inline void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t dim, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < dim; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) y[i] = w[i] * (x[i] * inv);
}

// silu(g) * u = g * u / (1 + exp(-g)) over n floats (exp: vec_math.h).
inline void silu_mul_row(const float* __restrict g, const float* __restrict u, float* __restrict y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one16 = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 ex = octavo::exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));  // exp(-g)
    _mm512_storeu_ps(y + i, _mm512_div_ps(_mm512_mul_ps(gv, _mm512_loadu_ps(u + i)), _mm512_add_ps(one16, ex)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one8 = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 ex = octavo::exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), _mm256_add_ps(one8, ex)));
  }
#endif
  for (; i < n; ++i) y[i] = g[i] * u[i] / (1.f + std::exp(-g[i]));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), name, " must be contiguous float32 2-D");
}

}  // namespace

// out = rms_norm(x) * weight. x, out [n, dim].
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1), "weight [dim]");
  const int64_t n = x.size(0), dim = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * dim, wp, op + r * dim, dim, static_cast<float>(eps));
  });
}

// residual += x; x = rms_norm(residual) * weight. Both [n, dim], in place.
void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1), "weight [dim]");
  const int64_t n = x.size(0), dim = x.size(1);
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = xp + r * dim;
      float* rr = rp + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) rr[i] += xr[i];
      norm_row(rr, wp, xr, dim, static_cast<float>(eps));
    }
  });
}

// In place on qkv [n, (num_heads + 2 * num_kv_heads) * head_dim]: with q_weight / k_weight
// (Qwen3's and Gemma 3's per-head q/k RMSNorm; empty tensors: none) each q and k head first
// becomes w * (x / sqrt(mean(x^2) + eps)); then rotate-half RoPE on the q and k heads with cos,
// sin [n, head_dim]; then k and v of token t go to slot slots[t] of the caches
// [num_blocks, block_size, num_kv_heads, row], in the caches' format (kv_store.h: float32, bfloat16,
// float16, or int8 rows quantized with a float16 scale per 32 values). One op where the model ran seven torch ops
// per layer (two norms, two RoPEs, the split and the two cache writes).
void rotary_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                     at::Tensor q_weight, at::Tensor k_weight, double eps) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  // RoPE on the first `rot` values of each q and k head (all of them, or a partial-rotary model's part)
  TORCH_CHECK(k_cache.dim() == 4, "caches: [blocks, block_size, num_kv_heads, row]");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  // an int8 row: head_dim values, then a float16 scale per 32 of them
  const int64_t n = qkv.size(0), row_elems = k_cache.size(3), num_heads_total = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(qkv.size(1) % num_heads_total == 0, "qkv width does not match the heads");
  const int64_t head_dim = qkv.size(1) / num_heads_total;
  TORCH_CHECK(row_elems == head_dim + (int8 ? 2 * ((head_dim + octavo::kKvGroup - 1) / octavo::kKvGroup) : 0),
              "caches' rows do not match qkv's head_dim");
  const int64_t rot = cos.size(1), half = rot / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width does not match the heads");
  TORCH_CHECK(cos.size(0) == n && sin.sizes() == cos.sizes() && rot % 2 == 0 && rot <= head_dim,
              "cos, sin: [n, an even rotary width <= head_dim]");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf || int8) &&
                  v_cache.scalar_type() == kv_type && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "caches: contiguous float32, bfloat16, float16 or int8 [blocks, block_size, num_kv_heads, row]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == n && slots.is_contiguous(),
              "slots: int64 [n]");
  const bool norm = q_weight.numel() > 0;
  if (norm)
    for (const auto* w : {&q_weight, &k_weight})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == head_dim,
                  "q/k norm weights: float32 [head_dim]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), kv_width = num_kv_heads * head_dim;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " outside the cache");
  float* qp = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const float* qw = norm ? q_weight.data_ptr<float>() : nullptr;
  const float* kw = norm ? k_weight.data_ptr<float>() : nullptr;
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t row_bytes = row_elems * k_cache.element_size();
  const int64_t width = qkv.size(1);
  // k, v head h of token t: float32 values at `x` -> its row of slot `slot` in the cache at `base`
  const auto store = [&](const float* x, char* base, int64_t slot, int64_t h) {
    char* dst = base + (slot * num_kv_heads + h) * row_bytes;
    switch (kv_type) {
      case at::kFloat: return octavo::kv_store_row(x, reinterpret_cast<float*>(dst), head_dim);
      case at::kBFloat16: return octavo::kv_store_row(x, reinterpret_cast<c10::BFloat16*>(dst), head_dim);
      case at::kHalf: return octavo::kv_store_row(x, reinterpret_cast<c10::Half*>(dst), head_dim);
      default: return octavo::kv_store_row(x, reinterpret_cast<int8_t*>(dst), head_dim);
    }
  };
  at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(norm ? head_dim : 0);
    for (int64_t t = t0; t < t1; ++t) {
      float* row = qp + t * width;
      const float* c = cp + t * rot;
      const float* s = snp + t * rot;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {  // q heads, then k heads
        float* x = row + h * head_dim;
        if (norm) {
          norm_row(x, h < num_heads ? qw : kw, normed.data(), head_dim, static_cast<float>(eps));
          std::copy(normed.begin(), normed.end(), x);
        }
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          // reference: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
          x[i] = a * c[i] + (-b) * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        store(row + (num_heads + h) * head_dim, kc, sp[t], h);
        store(row + num_heads * head_dim + kv_width + h * head_dim, vc, sp[t], h);
      }
    }
  });
}

// out [n, inter] = silu(gate_up[:, :inter]) * gate_up[:, inter:].
void silu_and_mul(at::Tensor out, at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * inter && out.size(0) == n && out.size(1) == inter, "gate_up [n, 2 * inter], out [n, inter]");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * 2 * inter, gp + r * 2 * inter + inter, op + r * inter, inter);
  });
}
