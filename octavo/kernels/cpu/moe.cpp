// The experts of a mixture-of-experts layer in one call, for the float32 and the int8-activation
// kernels alike. What it replaces is the Python loop of `reference.moe_experts` (per expert: the
// rows gathered, gate|up, silu(gate) * up, down, scaled by the router's weight, added into the
// output): ~60 torch calls a layer, about 0.5 ms of a Qwen3-30B-A3B-shaped decode step's layer
// where the expert weights themselves stream in ~1 ms (docs/BENCHMARKS.md). Here the (token,
// slot) pairs are sorted by expert once (counting sort, tokens in order within an expert), every
// routed row is gathered into one buffer, and each chosen expert runs the same kernels on its
// rows: a step reads each chosen expert's weights once and no other. Each row goes through the
// same kernels, in the same order of float operations, as in the reference (the kernels give a
// row the same bits whatever rows share the call), and the sum over a token's experts is made in
// expert order, y * w rounded and then added, as index_add_ does: the results are the reference's
// bit for bit.
#include "moe.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <utility>

void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt);
void quant_linear_i8(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t fmt);
void silu_and_mul(at::Tensor out, at::Tensor gate_up);

MoeExperts::MoeExperts(std::vector<at::Tensor> gate_up_, std::vector<at::Tensor> down_, int64_t fmt_gate_up_,
                       int64_t fmt_down_, int64_t hidden_, int64_t inter_, bool int8_)
    : gate_up(std::move(gate_up_)), down(std::move(down_)), fmt_gate_up(fmt_gate_up_), fmt_down(fmt_down_),
      hidden(hidden_), inter(inter_), int8(int8_) {
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "one gate|up and one down weight per expert");
  for (const at::Tensor& w : gate_up) TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "packed uint8 weights");
  for (const at::Tensor& w : down) TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "packed uint8 weights");
}

at::Tensor MoeExperts::forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == hidden,
              "x: contiguous float32 [n, hidden]");
  const int64_t n = x.size(0), E = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == n && ids.is_contiguous(),
              "ids: contiguous int64 [n, k]");
  const int64_t k = ids.size(1), pairs = n * k;
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes() && weights.is_contiguous(),
              "weights: contiguous float32 [n, k]");
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  // counting sort of the pairs by expert (stable: tokens in order within an expert)
  std::vector<int64_t> start(E + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert id ", id[p], " out of range [0, ", E, ")");
    ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[next[id[p]]++] = p;
  }
  const auto opts = x.options();
  at::Tensor xs = at::empty({pairs, hidden}, opts), gu = at::empty({pairs, 2 * inter}, opts);
  at::Tensor act = at::empty({pairs, inter}, opts), y = at::empty({pairs, hidden}, opts);
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t j = 0; j < pairs; ++j) std::memcpy(xsp + j * hidden, xp + (order[j] / k) * hidden, hidden * sizeof(float));
  const auto linear = int8 ? quant_linear_i8 : quant_linear;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = start[e], c = start[e + 1] - s;
    if (c == 0) continue;
    linear(gu.narrow(0, s, c), xs.narrow(0, s, c), gate_up[e], fmt_gate_up);
    silu_and_mul(act.narrow(0, s, c), gu.narrow(0, s, c));
    linear(y.narrow(0, s, c), act.narrow(0, s, c), down[e], fmt_down);
  }
  at::Tensor out = at::zeros({n, hidden}, opts);
  float* op = out.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t j = 0; j < pairs; ++j) {  // expert order, as the reference's index_add_ calls
    const int64_t p = order[j];
    const float w = wp[p];
    float* o = op + (p / k) * hidden;
    const float* yr = yp + j * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const float t = yr[i] * w;  // rounded, then added (-ffp-contract=off: no fused multiply-add)
      o[i] += t;
    }
  }
  return out;
}
