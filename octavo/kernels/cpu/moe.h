// A mixture-of-experts layer's experts in one call (moe.cpp): the gated MLPs of every expert,
// held by the object, run on the tokens the router sent them and summed with its weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

struct MoeExperts {
  // gate_up[e]: expert e's fused gate|up weight [2 * inter, hidden], down[e]: [hidden, inter],
  // packed for the float32 kernels (`pack`) or the int8 ones (`pack_i8`) as `int8` says.
  MoeExperts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t fmt_gate_up, int64_t fmt_down,
             int64_t hidden, int64_t inter, bool int8);
  // x [n, hidden] float32, ids / weights [n, k] (int64 expert ids, float32 weights) -> [n, hidden]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights) const;

  std::vector<at::Tensor> gate_up, down;
  int64_t fmt_gate_up, fmt_down, hidden, inter;
  bool int8;
};
