// Python bindings of the engine's CPU kernels. kernels/build.py compiles this file once, with no
// ISA flags, and links it with each ISA level's kernel units into that level's extension module
// (_C_<level>, entered through module_init.cpp): so nothing here may depend on the ISA macros,
// and the ops a level lacks are bound or not by asking the kernel units at import.
#include <torch/extension.h>

#include "decode_step.h"
#include "linear.h"

// The allocation helpers of torch_lite.h: here, so that no kernel unit includes ATen's op headers.
namespace tm_cpu {
at::Tensor empty(at::IntArrayRef sizes, at::TensorOptions options) { return at::empty(sizes, options); }
at::Tensor empty_like(const at::Tensor& x) { return at::empty_like(x); }
at::Tensor zeros(at::IntArrayRef sizes, at::TensorOptions options) { return at::zeros(sizes, options); }
}  // namespace tm_cpu

// module_init.cpp: the ISA level this module was compiled for ("avx2", ...).
const char* tm_isa_level();

// paged_attention.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                           double scale, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale, int64_t window, double softcap);

torch::Tensor paged_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                         torch::Tensor seq_lens, torch::Tensor query_start_loc, int64_t block_size, double scale,
                         c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, int64_t window,
                         double softcap);

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                             int64_t num_heads, int64_t num_kv_heads);
void write_scaled_cache(torch::Tensor x, torch::Tensor cache, torch::Tensor scales, torch::Tensor slot_mapping);

// sampling.cpp
torch::Tensor top_k_top_p(torch::Tensor logits, c10::optional<torch::Tensor> top_k, c10::optional<torch::Tensor> top_p);

// panel_linear.cpp
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias);
torch::Tensor panel_linear_silu_mul(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias);
std::string panel_isa();

// paged_prefill.cpp
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                            int64_t context_len, int64_t block_size, double scale,
                            c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                            int64_t window, double softcap);

// quant_linear.cpp
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t bits);
torch::Tensor dequantize_weight(torch::Tensor qweight, torch::Tensor scales, int64_t bits, at::ScalarType dtype);
torch::Tensor quant_embedding(torch::Tensor ids, torch::Tensor qweight, torch::Tensor scales, int64_t bits,
                              at::ScalarType dtype, int64_t rows);

// quant_panels.cpp (the op exists at every level; quant_panels_built() says whether it runs)
torch::Tensor quant_panel_linear(torch::Tensor x, torch::Tensor qpanels, torch::Tensor spanels, int64_t bits,
                                 int64_t N);
bool quant_panels_built();

// w8a8.cpp
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, torch::Tensor rowsum,
                          c10::optional<torch::Tensor> bias, int64_t N);
torch::Tensor w8a8_linear_silu_mul(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, torch::Tensor rowsum,
                                   c10::optional<torch::Tensor> bias, int64_t N);
std::vector<torch::Tensor> w8a8_quantize_activations(torch::Tensor x);
std::string w8a8_isa();

// lora.cpp
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor A, torch::Tensor Bt, torch::Tensor ranks,
              torch::Tensor slice_bounds, torch::Tensor row_slots);

// moe.cpp
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor topk_ids,
                          torch::Tensor topk_weights);

// shm_allreduce.cpp
bool shm_all_reduce(torch::Tensor x, torch::Tensor slots, torch::Tensor words, int64_t rank, int64_t world,
                    int64_t seq, int64_t spin_ns);

namespace {

// The fused decode step, where this level has it (AVX512-BF16, or AVX2 + FMA). module_local: two
// levels' modules in one process (tests load several) each bind their own class.
void bind_fused_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  using tm_cpu::FusedDecoderApi;
  if (!tm_cpu::fused_decoder_built()) return;
  py::class_<FusedDecoderApi>(m, "FusedDecoder", py::module_local(),
                              "A whole decode step of a Llama-family model in one parallel region")
      .def(py::init(&tm_cpu::make_fused_decoder), py::arg("embed"), py::arg("embed_scales"), py::arg("embed_bits"),
           py::arg("norms"), py::arg("linears"), py::arg("kv_caches"), py::arg("cos"), py::arg("sin"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("vocab_size"),
           py::arg("eps"), py::arg("block_size"), py::arg("scale"),
           py::arg("kv_scales") = std::vector<torch::Tensor>{})
      .def("forward", &FusedDecoderApi::forward, py::arg("ids"), py::arg("positions"), py::arg("slots"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("logits_rows"), py::arg("query_start_loc") = py::none(),
           py::arg("row_slots") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("set_lora", &FusedDecoderApi::set_lora, py::arg("specs"),
           "multi-LoRA buffers: 4 per layer (qkv, o, gate_up, down), each (A, Bt, ranks, slice_bounds) or None")
      .def("clear_lora", &FusedDecoderApi::clear_lora)
      .def_property("spin_ns", &FusedDecoderApi::spin_ns, &FusedDecoderApi::set_spin_ns,
                    "the most a thread spins at a barrier of the step before it sleeps (ns; 0: at once)")
      .def_readwrite("count_waits", &FusedDecoderApi::count_waits_, "count how the step's barrier waits go (benchmarks)")
      .def("take_wait_stats", &FusedDecoderApi::take_wait_stats,
           "(waits that spun, slept after spinning, slept at once, total wait ns) since the last call")
      .def("set_tensor_parallel", &FusedDecoderApi::set_tensor_parallel, py::arg("slots"), py::arg("words"),
           py::arg("rank"), py::arg("world"), py::arg("spin_ns"))
      .def_readwrite("tp_seq", &FusedDecoderApi::tp_seq_, "the next all-reduce's sequence number, less one")
      .def_readwrite("adaptive_spin", &FusedDecoderApi::adaptive_spin_,
                     "cut a thread's spin budget when its spins run out, grow it back when they succeed");
  m.def("barrier_next_spin_budget", &tm_cpu::barrier_next_spin_budget, py::arg("budget"), py::arg("max_spin_ns"),
        py::arg("waited_ns"), "the fused step's barrier: a thread's spin budget after a wait (waited_ns < 0: its "
        "spin saw the wait end; else the wait's whole length, spin and sleep)");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("isa", &tm_isa_level, "the ISA level this module was compiled for (kernels/isa.py's names)");
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("paged_rows", &paged_rows, "every query row of a flat batch, decode-style and batch-invariant (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("block_size"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("context_len"), py::arg("block_size"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("rms_norm", &rms_norm, "RMSNorm, float32 inside (a float32 weight on bf16 x: scaled in float32, "
        "rounded once, as Gemma's (1 + w) norm)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), both in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up (GeGLU)");
  m.def("argmax_rows", &argmax_rows, "each row's first largest value's index (greedy sampling)");
  m.def("top_k_top_p", &top_k_top_p, "the logits with the tokens outside each row's top k, then its top-p "
        "nucleus, at -inf (ties at a cut kept)", py::arg("logits"), py::arg("top_k"), py::arg("top_p"));
  m.def("rope_and_cache", &rope_and_cache, "rotary embedding of q and k, k and v written to the paged cache; "
        "returns q", py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("num_heads"), py::arg("num_kv_heads"));
  m.def("write_scaled_cache", &write_scaled_cache, "new K or V rows quantized per (token, kv head) into an int8 / "
        "float8 e4m3 cache and its float32 scales");
  m.def("quant_linear", &quant_linear, "weight-only int4/int8 linear (groups of 32)");
  m.def("panel_linear_silu_mul", &panel_linear_silu_mul, "a gate/up bf16 panel linear with silu(gate) * up in its AMX epilogue",
        py::arg("x"), py::arg("panels"), py::arg("N"), py::arg("bias"));
  m.def("pack_panels", &pack_panels, "a bf16 [N, K] weight packed in panels of 32 rows for panel_linear");
  m.def("panel_linear", &panel_linear, "bf16 linear on panel-packed weights (small and medium batches)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("dequantize_weight", &dequantize_weight, "an int4/int8 weight, dequantized (for large batches)");
  m.def("quant_embedding", &quant_embedding, "rows of an int4/int8 table (rows or panels: give `rows`), dequantized",
        py::arg("ids"), py::arg("qweight"), py::arg("scales"), py::arg("bits"), py::arg("dtype"), py::arg("rows") = -1);
  if (quant_panels_built()) {
    m.def("quant_panel_linear", &quant_panel_linear, "int4/int8 weights on output panels x int8 activations (AVX2 / AVX-512 VNNI)",
          py::arg("x"), py::arg("qpanels"), py::arg("spanels"), py::arg("bits"), py::arg("out_features"));
    m.def("set_quant_amx_rows", &tm_cpu::set_quant_amx_rows,
          "bf16 calls of quant_panel_linear from this many rows run on AMX tiles (panels dequantized to bf16)");
    m.def("quant_panels_amx", &tm_cpu::quant_panels_amx, "whether a bf16 call of M rows runs on AMX tiles", py::arg("M"));
    m.def("set_quant_amx_int_rows", &tm_cpu::set_quant_amx_int_rows,
          "rows from which int8-activation calls take AMX-INT8 tiles (the same bits)", py::arg("rows"));
    m.def("quant_panels_amx_int", &tm_cpu::quant_panels_amx_int,
          "whether a call of M rows takes the int8 products on AMX-INT8 tiles", py::arg("M"));
    m.attr("QUANT_AMX_INT_ROWS") = tm_cpu::kQuantAmxIntRows;  // set_quant_amx_int_rows' default
  }
  m.def("w8a8_linear", &w8a8_linear, "int8 weights x per-token int8 activations, int32 sums (--quantization w8a8)",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("rowsum"), py::arg("bias"), py::arg("N"));
  m.def("w8a8_linear_silu_mul", &w8a8_linear_silu_mul, "a gate/up W8A8 linear with silu(gate) * up in its epilogue",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("rowsum"), py::arg("bias"), py::arg("N"));
  m.def("w8a8_quantize_activations", &w8a8_quantize_activations, "per-token asymmetric uint8 (u, scale, zero point)");
  m.def("w8a8_isa", &w8a8_isa, "the instruction path w8a8_linear runs");
  m.def("panel_isa", &panel_isa, "the instructions panel_linear (bf16 linears, the fused decode step's) runs");
  m.def("lora_add", &lora_add, "multi-LoRA: y [M, N] += each row's adapter delta (row_slots; -1: none), in place",
        py::arg("y"), py::arg("x"), py::arg("A"), py::arg("Bt"), py::arg("ranks"), py::arg("slice_bounds"),
        py::arg("row_slots"));
  m.def("moe_experts", &moe_experts, "mixture-of-experts FFN: each token's top-k experts (silu(gate) * up, down), "
        "summed with its routing weights", py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("topk_ids"),
        py::arg("topk_weights"));
  m.def("shm_all_reduce", &shm_all_reduce, "tensor-parallel all-reduce through shared memory (false: aborted)",
        py::call_guard<py::gil_scoped_release>());
  bind_fused_decoder(m);
}
