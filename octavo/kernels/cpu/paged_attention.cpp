// Paged attention for the CPU: every query row reads its request's keys and values straight from
// the block pool, once, with no gathered copy of the context.
//
// Work item = (request, tile of up to `q_tile` of its query tokens). Its rows are the tile's
// tokens x all query heads; each row reads the KV head its head shares (grouped-query attention),
// and a block's keys for all KV heads are contiguous, so a block streams in whole. Three passes, the
// same arithmetic as the torch reference (scores * scale, exact softmax, probabilities x values):
//   1. scores[r][j] = (q_r . k_j) * scale for every key j the row may see (causal, and within the
//      layer's window when it has one: keys p - window + 1 .. p for the query at position p);
//   2. a row-wise softmax over those scores;
//   3. out_r = sum_j p[r][j] * v_j.
// Keys and values of one block stay in L1 while all rows of the tile use them. Items are handed
// out dynamically, because their cost grows with the context length.
// A step with fewer tiles than twice the threads is split by KV head (`split_kv_heads` -1; 1 and 0
// force either way): an item per (tile, KV head) holds only the query heads that share it and reads
// only that head's keys and values. One user's decode step is then 8 items (Llama's 8 KV heads)
// where it was one, so both threads of a 2-core machine work (1.4-1.8x faster at 128-4,000 keys);
// with enough tiles to go round, splitting was 4-10% slower (each item walks every block for an
// eighth of it; docs/BENCHMARKS.md). Each score, softmax and sum is computed by the same
// instructions in the same order whichever item a row falls in, so a split changes no bit.
// The cache is read in its own format (kv_store.h: float32, bfloat16, float16, or int8 rows with
// a float16 scale per 32 values), converted to float32 in registers as each key and value is used:
// no float32 copy of a block is made. An int8 key's values are scaled as they load; an int8
// value's scale folds into its probability.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kv_store.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define OCTAVO_AVX2 1
#endif

namespace {

struct Item {
  int32_t seq;
  int32_t tile_start;  // first query token of the tile, relative to the request's span
  int32_t tile_len;
  int32_t kv_lo, kv_hi;  // the KV heads whose query heads are the item's rows
};

template <typename E>
inline float dot(const float* __restrict q, const E* __restrict k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += q[d] * octavo::kv_value(k, d);
  return acc;
}

// An int8 row's dot product: per group of 32 values, the group's sum times its scale.
inline float dot(const float* __restrict q, const int8_t* __restrict k, int64_t n) {
  float acc = 0.f;
  for (int64_t g = 0; g * octavo::kKvGroup < n; ++g) {
    const int64_t lo = g * octavo::kKvGroup, hi = std::min(n, lo + octavo::kKvGroup);
    float part = 0.f;
    for (int64_t d = lo; d < hi; ++d) part += q[d] * static_cast<float>(k[d]);
    acc += part * octavo::kv_group_scale(k, n, g);
  }
  return acc;
}

// scores[j] = (q . k_j) * scale for j in [0, n), keys `stride` elements apart (an int8 key's
// values times their group's scale as they are loaded).
template <typename E>
inline void dot_keys(const float* __restrict q, const E* __restrict k, int64_t stride, int64_t n,
                     int64_t head_dim, float scale, float* __restrict scores) {
  int64_t j = 0;
#ifdef OCTAVO_AVX2
  if (head_dim % 8 == 0) {
    // Eight keys at a time: eight independent FMA chains, then one transposing reduction that
    // yields their eight sums in one register.
    const __m256 vscale = _mm256_set1_ps(scale);
    float ks[8][16];  // int8: the eight keys' group scales, as float32 (head_dim <= 512)
    for (; j + 8 <= n; j += 8) {
      const E* kj = k + j * stride;
      // key i's 8 values from d on, as float32 (scaled, for int8)
      auto key8 = [&](int i, int64_t d) {
        if constexpr (octavo::kv_scaled<E>())
          return _mm256_mul_ps(octavo::kv_load8(kj + i * stride + d), _mm256_broadcast_ss(&ks[i][d / octavo::kKvGroup]));
        else
          return octavo::kv_load8(kj + i * stride + d);
      };
      if constexpr (octavo::kv_scaled<E>())
        for (int i = 0; i < 8; ++i)
          for (int64_t g = 0; g * octavo::kKvGroup < head_dim; ++g) ks[i][g] = octavo::kv_group_scale(kj + i * stride, head_dim, g);
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qd, key8(0, d), a0);
        a1 = _mm256_fmadd_ps(qd, key8(1, d), a1);
        a2 = _mm256_fmadd_ps(qd, key8(2, d), a2);
        a3 = _mm256_fmadd_ps(qd, key8(3, d), a3);
        a4 = _mm256_fmadd_ps(qd, key8(4, d), a4);
        a5 = _mm256_fmadd_ps(qd, key8(5, d), a5);
        a6 = _mm256_fmadd_ps(qd, key8(6, d), a6);
        a7 = _mm256_fmadd_ps(qd, key8(7, d), a7);
      }
      const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
      _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, vscale));
    }
  }
#endif
  for (; j < n; ++j) scores[j] = dot(q, k + j * stride, head_dim) * scale;
}

#ifdef OCTAVO_AVX2
// The eight sums of eight accumulators in one register, each as ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)):
// the same order for every slot, so a sum's bits do not depend on the slot it is computed in.
inline __m256 sum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// dot_keys for R query rows (q_stride apart) that share one KV head and one key range: each key is
// loaded and converted once for all R of them (grouped-query attention's 2-8 heads a KV head), where
// R calls of dot_keys would convert it R times. K = 8 / R keys go through the eight accumulators
// at a time; each (row, key) pair keeps dot_keys' own FMA chain and sum8's reduction, and the keys
// past the last full eight take dot(), as there: every score has dot_keys' bits.
template <int R, typename E>
inline void dot_keys_rows(const float* __restrict q, int64_t q_stride, const E* __restrict k, int64_t stride,
                          int64_t n, int64_t head_dim, float scale, float* __restrict scores, int64_t score_stride) {
  constexpr int K = 8 / R;  // keys a pass computes (8 / R divides 8 for every R in 1..8)
  int64_t j = 0;
  float ks[8][16];  // int8: the pass's keys' group scales, as float32 (head_dim <= 512)
  alignas(32) float sums[8];
  for (; j + 8 <= n; j += 8) {
    for (int j1 = 0; j1 < 8; j1 += K) {
      const E* kj = k + (j + j1) * stride;
      if constexpr (octavo::kv_scaled<E>())
        for (int i = 0; i < K; ++i)
          for (int64_t g = 0; g * octavo::kKvGroup < head_dim; ++g) ks[i][g] = octavo::kv_group_scale(kj + i * stride, head_dim, g);
      __m256 a[8];
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) a[s] = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qd[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) qd[r] = _mm256_loadu_ps(q + r * q_stride + d);
#pragma GCC unroll 8
        for (int i = 0; i < K; ++i) {
          __m256 kv = octavo::kv_load8(kj + i * stride + d);
          if constexpr (octavo::kv_scaled<E>()) kv = _mm256_mul_ps(kv, _mm256_broadcast_ss(&ks[i][d / octavo::kKvGroup]));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) a[i * R + r] = _mm256_fmadd_ps(qd[r], kv, a[i * R + r]);
        }
      }
      _mm256_store_ps(sums, sum8(a));
      for (int i = 0; i < K; ++i)
        for (int r = 0; r < R; ++r) scores[r * score_stride + j + j1 + i] = sums[i * R + r] * scale;
    }
  }
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) scores[r * score_stride + j] = dot(q + r * q_stride, k + j * stride, head_dim) * scale;
}

// accumulate_values for R rows that share one KV head and one key range (probabilities p_stride
// apart, accumulator rows head_dim apart): each 8-value chunk of a value is loaded and converted
// once for all R rows. CW chunks at a time, all in one int8 scale group (CW divides its 4 chunks);
// each (row, value) keeps the order and the FMA of accumulate_values_avx2.
template <int R, int CW, typename E>
inline void accumulate_chunks(const float* __restrict pg, int64_t n, const E* __restrict v, int64_t stride,
                              int64_t c0, int64_t head_dim, float* __restrict acc) {
  __m256 a[R][CW];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CW; ++c) a[r][c] = _mm256_loadu_ps(acc + r * head_dim + 8 * (c0 + c));
  for (int64_t j = 0; j < n; ++j) {
    __m256 vc[CW];
#pragma GCC unroll 4
    for (int c = 0; c < CW; ++c) vc[c] = octavo::kv_load8(v + j * stride + 8 * (c0 + c));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_broadcast_ss(pg + r * n + j);
#pragma GCC unroll 4
      for (int c = 0; c < CW; ++c) a[r][c] = _mm256_fmadd_ps(pr, vc[c], a[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + r * head_dim + 8 * (c0 + c), a[r][c]);
}

template <int R, typename E>
inline void accumulate_values_rows(const float* __restrict p, int64_t p_stride, const E* __restrict v, int64_t stride,
                                   int64_t n, int64_t head_dim, float* __restrict acc) {
  constexpr int CW = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // 2R..8 accumulators
  constexpr int64_t kJ = 16;                         // keys whose probabilities are staged at a time
  constexpr int kGroupChunks = octavo::kKvGroup / 8;
  const int64_t chunks = head_dim / 8;
  float pg[R * kJ];  // the staged probabilities (int8: times the value's scale for the chunk's group)
  for (int64_t j0 = 0; j0 < n; j0 += kJ) {
    const int64_t nj = std::min(kJ, n - j0);
    const E* vj = v + j0 * stride;
    int64_t staged_group = -1;
    for (int64_t c = 0; c < chunks;) {
      const int64_t g = c / kGroupChunks;
      if (octavo::kv_scaled<E>() ? g != staged_group : staged_group < 0) {
        for (int r = 0; r < R; ++r)
          for (int64_t i = 0; i < nj; ++i) {
            const float pr = p[r * p_stride + j0 + i];
            if constexpr (octavo::kv_scaled<E>())
              pg[r * nj + i] = pr * octavo::kv_group_scale(vj + i * stride, head_dim, g);
            else
              pg[r * nj + i] = pr;
          }
        staged_group = g;
      }
      if (c % CW == 0 && c + CW <= chunks) {
        accumulate_chunks<R, CW>(pg, nj, vj, stride, c, head_dim, acc);
        c += CW;
      } else {
        accumulate_chunks<R, 1>(pg, nj, vj, stride, c, head_dim, acc);
        c += 1;
      }
    }
  }
}
#endif

// Scores of `count` rows (q_stride apart) that share one KV head and one key range, their scores
// score_stride apart: up to eight at a time through dot_keys_rows, each with dot_keys' bits.
template <typename E>
inline void dot_keys_group(const float* q, int64_t q_stride, const E* k, int64_t stride, int64_t n, int64_t head_dim,
                           float scale, float* scores, int64_t score_stride, int64_t count) {
  for (int64_t r = 0; r < count;) {
    const int64_t R = std::min<int64_t>(8, count - r);
    const float* qr = q + r * q_stride;
    float* sr = scores + r * score_stride;
#ifdef OCTAVO_AVX2
    if (head_dim % 8 == 0 && R > 1) {
      switch (R) {
        case 2: dot_keys_rows<2>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
        case 3: dot_keys_rows<3>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
        case 4: dot_keys_rows<4>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
        case 5: dot_keys_rows<5>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
        case 6: dot_keys_rows<6>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
        case 7: dot_keys_rows<7>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
        default: dot_keys_rows<8>(qr, q_stride, k, stride, n, head_dim, scale, sr, score_stride); break;
      }
      r += R;
      continue;
    }
#endif
    dot_keys(qr, k, stride, n, head_dim, scale, sr);
    r += 1;
  }
}

#ifdef OCTAVO_AVX2
// The accumulator row lives in CHUNKS registers for the whole loop (a compile-time count, so the
// compiler keeps it out of memory). An int8 value's group scale folds into its probability.
template <int CHUNKS, typename E>
inline void accumulate_values_avx2(const float* __restrict p, const E* __restrict v, int64_t stride, int64_t n,
                                   float* __restrict acc) {
  constexpr int kGroupChunks = octavo::kKvGroup / 8;  // 8-value chunks a scale group holds
  __m256 a[CHUNKS];
#pragma GCC unroll 16
  for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const E* vj = v + j * stride;
    if constexpr (octavo::kv_scaled<E>()) {
#pragma GCC unroll 4
      for (int g = 0; g * kGroupChunks < CHUNKS; ++g) {
        const __m256 pg = _mm256_set1_ps(p[j] * octavo::kv_group_scale(vj, 8 * CHUNKS, g));
#pragma GCC unroll 4
        for (int c = g * kGroupChunks; c < std::min(CHUNKS, (g + 1) * kGroupChunks); ++c)
          a[c] = _mm256_fmadd_ps(pg, octavo::kv_load8(vj + 8 * c), a[c]);
      }
    } else {
      const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
      for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_fmadd_ps(pj, octavo::kv_load8(vj + 8 * c), a[c]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

// acc += sum_j p[j] * v_j for j in [0, n), values `stride` elements apart (an int8 value's group
// scale folded into its probability).
template <typename E>
inline void accumulate_values(const float* __restrict p, const E* __restrict v, int64_t stride, int64_t n,
                              int64_t head_dim, float* __restrict acc) {
#ifdef OCTAVO_AVX2
  switch (head_dim) {
    case 64: return accumulate_values_avx2<8>(p, v, stride, n, acc);
    case 128: return accumulate_values_avx2<16>(p, v, stride, n, acc);
    case 32: return accumulate_values_avx2<4>(p, v, stride, n, acc);
    default: break;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const E* __restrict vj = v + j * stride;
    if constexpr (octavo::kv_scaled<E>()) {
      for (int64_t g = 0; g * octavo::kKvGroup < head_dim; ++g) {
        const int64_t lo = g * octavo::kKvGroup, hi = std::min(head_dim, lo + octavo::kKvGroup);
        const float pg = p[j] * octavo::kv_group_scale(vj, head_dim, g);
        for (int64_t d = lo; d < hi; ++d) acc[d] += pg * static_cast<float>(vj[d]);
      }
    } else {
      const float pj = p[j];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * octavo::kv_value(vj, d);
    }
  }
}

// accumulate_values for `count` rows that share one KV head and one key range (probabilities
// p_stride apart, accumulator rows head_dim apart): up to eight at a time through
// accumulate_values_rows where head_dim is a multiple of 8; one at a time otherwise.
template <typename E>
inline void accumulate_values_group(const float* p, int64_t p_stride, const E* v, int64_t stride, int64_t n,
                                    int64_t head_dim, float* acc, int64_t count) {
  for (int64_t r = 0; r < count;) {
    const int64_t R = std::min<int64_t>(8, count - r);
    const float* pr = p + r * p_stride;
    float* ar = acc + r * head_dim;
#ifdef OCTAVO_AVX2
    if (head_dim % 8 == 0 && R > 1) {
      switch (R) {
        case 2: accumulate_values_rows<2>(pr, p_stride, v, stride, n, head_dim, ar); break;
        case 3: accumulate_values_rows<3>(pr, p_stride, v, stride, n, head_dim, ar); break;
        case 4: accumulate_values_rows<4>(pr, p_stride, v, stride, n, head_dim, ar); break;
        case 5: accumulate_values_rows<5>(pr, p_stride, v, stride, n, head_dim, ar); break;
        case 6: accumulate_values_rows<6>(pr, p_stride, v, stride, n, head_dim, ar); break;
        case 7: accumulate_values_rows<7>(pr, p_stride, v, stride, n, head_dim, ar); break;
        default: accumulate_values_rows<8>(pr, p_stride, v, stride, n, head_dim, ar); break;
      }
      r += R;
      continue;
    }
#endif
    accumulate_values(pr, v, stride, n, head_dim, ar);
    r += 1;
  }
}

// The largest of x[0, n) (-inf for none); exact, so the order it is found in changes no bit.
inline float max_of(const float* __restrict x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef OCTAVO_AVX2
  __m256 vm = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = l > m ? l : m;
#endif
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// x[j] = exp(x[j] - m) for j in [0, n); returns their sum.
inline float exp_shifted_sum(float* __restrict x, int64_t n, float m) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef OCTAVO_AVX2
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 y = octavo::exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
    _mm256_storeu_ps(x + j, y);
    vsum = _mm256_add_ps(vsum, y);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vsum);
  for (float l : lanes) sum += l;
#endif
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

// Ask for a later block while this one is used: blocks sit at random places in the pool, which
// the hardware prefetcher cannot guess. kPrefetchBlocks ahead: one block's work (~70 ns for a
// KV head's 16 keys) is shorter than a miss to memory; 3 was 7-9% faster than 1 for float16 and
// int8 caches at 8k keys (Zen 5, 2 threads), and the same for float32. Each of its `tokens` keys: `num_elems` from `offset` on.
constexpr int64_t kPrefetchBlocks = 3;

template <typename E>
inline void prefetch_block(const E* block, int64_t tokens, int64_t token_stride, int64_t offset,
                           int64_t num_elems) {
  constexpr int64_t line = 64 / sizeof(E);  // elements a cache line holds
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t f = 0; f < num_elems; f += line) __builtin_prefetch(block + t * token_stride + offset + f, 0, 3);
}

}  // namespace

// out, q: [num_tokens, num_heads, head_dim] float32, contiguous.
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, row], contiguous, in one of kv_store.h's
// formats (row = head_dim; int8: head_dim + 4, the row's float32 scale last).
// block_tables: [num_seqs, max_blocks] int32; q_starts, q_lens, context_lens: [num_seqs] int32.
// Request s owns query rows [q_starts[s], q_starts[s] + q_lens[s]) at absolute positions
// [context_lens[s] - q_lens[s], context_lens[s]); its keys 0 .. context_lens[s]-1 live in the
// blocks block_tables[s][0 ..]. window > 0: the query at position p sees keys p - window + 1 .. p
// only; blocks wholly before the first query's window are never read (they may be gone).
// softcap > 0 (Gemma 2): each score s becomes softcap * tanh(s / softcap) before the softmax.
// sinks: [num_heads] float32 (gpt-oss), or empty: a logit per head that joins the softmax's
// denominator and has no value.
template <typename E>
static void paged_attention_impl(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                 at::Tensor block_tables, at::Tensor q_starts, at::Tensor q_lens,
                                 at::Tensor context_lens, double scale, int64_t q_tile, int64_t window,
                                 double softcap, at::Tensor sinks, int64_t split_kv_heads) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the CPU paged-attention kernel takes contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && q_starts.scalar_type() == at::kInt &&
                  q_lens.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block tables and lengths must be int32");
  TORCH_CHECK(q_tile >= 1, "q_tile must be positive");
  TORCH_CHECK(!octavo::kv_scaled<E>() || q.size(2) <= 16 * octavo::kKvGroup, "int8 caches: head_dim <= 512");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == q.size(1)),
              "sinks: one float32 per query head, or empty");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && out.sizes() == q.sizes() &&
                  (octavo::kv_scaled<E>() ? q.size(2) + 2 * ((q.size(2) + octavo::kKvGroup - 1) / octavo::kKvGroup)
                                          : q.size(2)) == k_cache.size(3),
              "shapes: q, out [tokens, heads, head_dim]; caches [blocks, block_size, kv_heads, row]");

  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);

  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const E* kp = static_cast<const E*>(k_cache.data_ptr());
  const E* vp = static_cast<const E*>(v_cache.data_ptr());
  const int64_t row = k_cache.size(3);  // elements of one token's K (or V) of one head
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* lens = q_lens.data_ptr<int32_t>();
  const int32_t* ctxs = context_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);
  const float* sinkp = sinks.numel() ? sinks.data_ptr<float>() : nullptr;

  int64_t tiles = 0;
  for (int32_t s = 0; s < num_seqs; ++s) tiles += (std::max<int32_t>(lens[s], 0) + q_tile - 1) / q_tile;
  const bool split = num_kv_heads > 1 && (split_kv_heads < 0 ? tiles < 2 * at::get_num_threads() : split_kv_heads > 0);
  std::vector<Item> items;
  for (int32_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= ctxs[s], "each request needs 1 <= q_len <= context_len");
    TORCH_CHECK(starts[s] >= 0 && starts[s] + lens[s] <= q.size(0), "query rows out of range");
    const int64_t used_blocks = (ctxs[s] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= max_blocks, "block table too short for the context");
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctxs[s] - lens[s] + 1 - window) : 0;
    for (int64_t b = first_key / block_size; b < used_blocks; ++b) {
      const int32_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "block id ", block, " outside the pool");
    }
    for (int32_t t = 0; t < lens[s]; t += static_cast<int32_t>(q_tile)) {
      const int32_t len = std::min<int32_t>(static_cast<int32_t>(q_tile), lens[s] - t);
      for (int32_t h = 0; h < num_kv_heads; h += split ? 1 : static_cast<int32_t>(num_kv_heads))
        items.push_back({s, t, len, h, split ? h + 1 : static_cast<int32_t>(num_kv_heads)});
    }
  }
  // Most keys first, so the last items handed out are the cheap ones.
  auto cost = [&](const Item& it) {
    const int64_t keys = ctxs[it.seq] - lens[it.seq] + it.tile_start + it.tile_len;
    return (window > 0 ? std::min<int64_t>(keys, window + it.tile_len) : keys) * it.tile_len * (it.kv_hi - it.kv_lo);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });

  const int64_t token_stride = num_kv_heads * row;  // elements between consecutive keys in a block
  const int64_t block_stride = block_size * token_stride;
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, acc;
    std::vector<int64_t> limit, first;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const int64_t past = ctxs[it.seq] - lens[it.seq];  // keys before the span's first query
      // Rows are (token of the tile, head of the item's KV heads), in q's own order: row r is token
      // r / heads, query head head_lo + r % heads.
      const int64_t heads = (it.kv_hi - it.kv_lo) * group, head_lo = it.kv_lo * group;
      const int64_t rows = it.tile_len * heads;
      const int64_t num_keys = past + it.tile_start + it.tile_len;  // the tile's last row sees these
      const int32_t* table = tables + it.seq * max_blocks;
      const float* q_tile_ptr = qp + (starts[it.seq] + it.tile_start) * num_heads * head_dim;
      limit.resize(rows);
      first.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {
        limit[r] = past + it.tile_start + r / heads + 1;  // keys [first[r], limit[r]) are visible
        first[r] = window > 0 ? std::max<int64_t>(0, limit[r] - window) : 0;
      }
      // Row r's scores live at scores[r * span + (j - key_lo)]: only keys some row sees are kept.
      const int64_t key_lo = first[0], span = num_keys - key_lo;
      const int64_t block_lo = key_lo / block_size * block_size;
      scores.resize(rows * span);
      acc.assign(rows * head_dim, 0.f);
      auto kv_offset = [&](int64_t r) { return ((head_lo + r % heads) / group) * row; };
      auto q_row = [&](int64_t r) { return (r / heads) * num_heads * head_dim + (head_lo + r % heads) * head_dim; };
      // What the next block's prefetch asks for: the item's KV heads of each of its keys.
      const int64_t kv_floats = (it.kv_hi - it.kv_lo) * row, kv_first = it.kv_lo * row;

      // Pass 1: scores. A block's keys for every head are contiguous, so it streams in whole.
      for (int64_t j0 = block_lo; j0 < num_keys; j0 += block_size) {
        const E* kb = kp + static_cast<int64_t>(table[j0 / block_size]) * block_stride;
        if (j0 + kPrefetchBlocks * block_size < num_keys)
          prefetch_block(kp + static_cast<int64_t>(table[j0 / block_size + kPrefetchBlocks]) * block_stride, block_size, token_stride,
                         kv_first, kv_floats);
        for (int64_t r = 0; r < rows; r += group) {  // a KV head's query heads of one token together
          const int64_t jbeg = std::max(j0, first[r]), jend = std::min(j0 + block_size, limit[r]);
          if (jend > jbeg)
            dot_keys_group(q_tile_ptr + q_row(r), head_dim, kb + (jbeg - j0) * token_stride + kv_offset(r),
                           token_stride, jend - jbeg, head_dim, fscale, scores.data() + r * span + (jbeg - key_lo),
                           span, group);
        }
      }
      // Pass 2: softmax of each row over its visible keys (soft-capped first; with its head's sink
      // in the denominator).
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * span + (first[r] - key_lo);
        const int64_t n = limit[r] - first[r];
        if (fcap > 0.f)
          for (int64_t j = 0; j < n; ++j) sr[j] = fcap * std::tanh(sr[j] / fcap);
        float m = max_of(sr, n);
        const float sink = sinkp ? sinkp[head_lo + r % heads] : -std::numeric_limits<float>::infinity();
        m = std::max(m, sink);
        const float sum = exp_shifted_sum(sr, n, m) + (sinkp ? std::exp(sink - m) : 0.f);
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) sr[j] *= inv;
      }
      // Pass 3: probabilities x values.
      for (int64_t j0 = block_lo; j0 < num_keys; j0 += block_size) {
        const E* vb = vp + static_cast<int64_t>(table[j0 / block_size]) * block_stride;
        if (j0 + kPrefetchBlocks * block_size < num_keys)
          prefetch_block(vp + static_cast<int64_t>(table[j0 / block_size + kPrefetchBlocks]) * block_stride, block_size, token_stride,
                         kv_first, kv_floats);
        for (int64_t r = 0; r < rows; r += group) {
          const int64_t jbeg = std::max(j0, first[r]), jend = std::min(j0 + block_size, limit[r]);
          if (jend > jbeg)
            accumulate_values_group(scores.data() + r * span + (jbeg - key_lo), span,
                                    vb + (jbeg - j0) * token_stride + kv_offset(r), token_stride, jend - jbeg,
                                    head_dim, acc.data() + r * head_dim, group);
        }
      }
      float* out_tile = op + (starts[it.seq] + it.tile_start) * num_heads * head_dim;
      for (int64_t r = 0; r < rows; r += heads)  // a token's rows are contiguous in out, as in acc
        std::copy(acc.begin() + r * head_dim, acc.begin() + (r + heads) * head_dim, out_tile + q_row(r));
    }
  });
}

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor block_tables, at::Tensor q_starts, at::Tensor q_lens,
                     at::Tensor context_lens, double scale, int64_t q_tile, int64_t window, double softcap,
                     at::Tensor sinks, int64_t split_kv_heads) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && k_cache.scalar_type() == v_cache.scalar_type(),
              "the CPU paged-attention kernel takes float32 queries and K, V caches of one dtype");
  const auto run = [&](auto tag) {
    paged_attention_impl<decltype(tag)>(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, scale,
                                        q_tile, window, softcap, sinks, split_kv_heads);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(c10::BFloat16{});
    case at::kHalf: return run(c10::Half{});
    case at::kChar: return run(int8_t{});
    default: TORCH_CHECK(false, "the CPU paged-attention kernel reads float32, bfloat16, float16 or int8 caches, not ",
                         k_cache.scalar_type());
  }
}
