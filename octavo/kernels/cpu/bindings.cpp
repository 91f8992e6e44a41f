// The Python module of Octavo's CPU kernels: one binding per kernel, defined in its own file.
#include <torch/python.h>

#include "moe.h"

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                     torch::Tensor context_lens, double scale, int64_t q_tile, int64_t window, double softcap,
                     torch::Tensor sinks, int64_t split_kv_heads);
torch::Tensor pack(const std::vector<torch::Tensor>& parts, int64_t fmt);
void quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t fmt);
void dequantize_rows(torch::Tensor out, torch::Tensor packed, int64_t fmt, torch::Tensor rows, int64_t N);
void dequantize_transposed(torch::Tensor out, torch::Tensor packed, int64_t fmt);
const char* quant_isa();
torch::Tensor pack_i8(const std::vector<torch::Tensor>& parts, int64_t fmt);
void quant_linear_i8(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t fmt);
void quantize_activations_i8(torch::Tensor xq, torch::Tensor dx, torch::Tensor x);
void dequantize_rows_i8(torch::Tensor out, torch::Tensor packed, int64_t fmt, torch::Tensor rows, int64_t N);
bool quant_vnni();
void set_weight_prefetch(bool on);
bool weight_prefetch();
bool amx_built();
bool amx_selftest();
bool amx_enable(bool on);
bool amx_bf16_built();
bool amx_bf16_selftest();
bool amx_bf16_enable(bool on);
void quant_linear_bf16_i8(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t fmt);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads,
                     torch::Tensor q_weight, torch::Tensor k_weight, double eps);
int64_t pack_width();

// Every kernel lets go of the GIL while it runs: the server's event-loop thread can then format
// and send the last step's tokens meanwhile instead of stalling the engine thread.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // Outputs are allocated here, not by the Python wrappers: torch.empty from Python costs 2-4 us a
  // call on these machines, ~300 calls a decode step of a 30-layer model (docs/BENCHMARKS.md).
  m.def("paged_attention", [](at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                              at::Tensor q_starts, at::Tensor q_lens, at::Tensor context_lens, double scale,
                              int64_t q_tile, int64_t window, double softcap, std::optional<at::Tensor> sinks,
                              int64_t split_kv_heads) {
    at::Tensor out = at::empty_like(q);
    paged_attention(out, q, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, scale, q_tile, window,
                    softcap, sinks.has_value() ? *sinks : at::Tensor(at::empty({0}, q.options())), split_kv_heads);
    return out;
  }, "paged attention over the block pool (CPU, float32): a new [tokens, heads, head_dim] output", nogil);
  m.def("pack", &pack, "GGUF blocks (any format; a fused layer's parts, stacked by rows) -> the float32 kernels' layout", nogil);
  m.def("quant_linear", [](at::Tensor x, at::Tensor packed, int64_t fmt, int64_t n) {
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    quant_linear(out, x, packed, fmt);
    return out;
  }, "x @ W^T, W packed, x float32: a new [rows, n] output", nogil);
  m.def("dequantize_rows", &dequantize_rows, "rows of a packed W -> float32, as gguf-py rebuilds them", nogil);
  m.def("dequantize_transposed", &dequantize_transposed, "packed W -> float32 W^T (padded), as gguf-py rebuilds it", nogil);
  m.def("pack_i8", &pack_i8, "GGUF blocks (any format; a fused layer's parts, stacked by rows) -> the int8-activation kernels' layout (same size)", nogil);
  m.def("quant_linear_i8", [](at::Tensor x, at::Tensor packed, int64_t fmt, int64_t n) {
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    quant_linear_i8(out, x, packed, fmt);
    return out;
  }, "x @ W^T, W from pack_i8, x quantized to int8 per 32: a new [rows, n] output", nogil);
  m.def("quantize_activations_i8", &quantize_activations_i8, "x -> (int8 xq, float dx per 32) as quant_linear_i8 does", nogil);
  m.def("dequantize_rows_i8", &dequantize_rows_i8, "rows of a pack_i8 W -> float32, as gguf-py rebuilds them", nogil);
  m.def("set_weight_prefetch", &set_weight_prefetch, "the quantized kernels' software prefetch of the weights ahead, on or off");
  m.def("weight_prefetch", &weight_prefetch, "whether the quantized kernels prefetch the weights ahead");
  m.def("quant_vnni", &quant_vnni, "whether the int8 kernels were built with VNNI dot products");
  m.def("amx_built", &amx_built, "whether the int8 kernels were built with AMX-INT8 tiles");
  m.def("amx_selftest", &amx_selftest, "ask for the tile state, run one tile product, check it (run in a child first)");
  m.def("amx_bf16_built", &amx_bf16_built, "whether the int8 layout's prompt-row kernel was built with AMX-BF16 tiles");
  m.def("amx_bf16_selftest", &amx_bf16_selftest, "ask for the tile state, run one bfloat16 tile product, check it (in a child first)");
  m.def("amx_bf16_enable", &amx_bf16_enable, "allow quant_linear_bf16_i8 (after a child's self-test)");
  m.def("quant_linear_bf16_i8", [](at::Tensor x, at::Tensor packed, int64_t fmt, int64_t n) {
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    quant_linear_bf16_i8(out, x, packed, fmt);
    return out;
  }, "x @ W^T, W from pack_i8, x and W rounded to bfloat16 (AMX tiles): a new [rows, n] output", nogil);
  m.def("amx_enable", &amx_enable, "use AMX tiles for int8 steps of 16+ rows (after a child's self-test)");
  m.def("quant_isa", &quant_isa, "the vector instructions the quantized kernels were built for");
  m.def("rms_norm", [](at::Tensor x, at::Tensor weight, double eps) {
    at::Tensor out = at::empty_like(x);
    rms_norm(out, x, weight, eps);
    return out;
  }, "rms_norm(x) * weight (float32): a new output", nogil);
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = rms_norm(residual) * weight, in place (float32)", nogil);
  m.def("rotary_write_kv", &rotary_write_kv, "(per-head q/k RMSNorm,) RoPE on qkv's q and k heads in place, then k, v into the cache", nogil);
  m.def("silu_and_mul", [](at::Tensor gate_up) {
    at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(out, gate_up);
    return out;
  }, "silu(gate) * up from [n, 2 * inter] (float32): a new [n, inter] output", nogil);
  m.def("pack_width", &pack_width, "output rows per group of the packed layout");
  py::class_<MoeExperts>(m, "MoeExperts", "a mixture-of-experts layer's packed experts (moe.cpp)")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t, bool>(),
           py::arg("gate_up"), py::arg("down"), py::arg("fmt_gate_up"), py::arg("fmt_down"), py::arg("hidden"),
           py::arg("inter"), py::arg("int8"))
      .def("forward", &MoeExperts::forward, "x [n, hidden], expert ids and weights [n, k] -> the experts' sum [n, hidden]",
           nogil);
}
