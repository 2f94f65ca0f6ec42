// One Llama-style decoder layer as one call (op `octavo_cpu::llama_decoder_layer`), for GGUF
// weights kept in their blocks on the CPU:
//
//   h, residual = RMSNorm(hidden [+ residual])          (input_layernorm; no add on layer 0)
//   q, k, v     = split(h @ W_qkv^T)                     (GGUF matmul)
//   q, k        = rotary_neox(positions, q, k)
//   cache[slot] = k, v;  a = paged_attention(q, cache)
//   h, residual = RMSNorm(a @ W_o^T + residual)          (post_attention_layernorm)
//   out         = (silu(gate) * up)(h @ W_gate_up^T) @ W_down^T
//   -> (out, residual)
//
// It calls the same ops, in the same order and on the same tensors, as the Python layer does
// with the CPU backend's kernels registered (octavo.model_executor.models.llama), so its
// results are those of the Python path bit for bit. What it saves is the Python between them:
// at batch 1 a layer's ~12 module calls, views and wrapper checks cost more than its small
// ops. The ops are reached through the dispatcher (handles looked up once), so each keeps its
// own checks and its own threading.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace octavo_cpu {
namespace {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double)>
      fused_add_rms_norm;
  c10::TypedOperatorHandle<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&)>
      rotary_neox;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      std::string)>
      gguf_matmul;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      write_kv_cache;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, std::string,
                                      int64_t, int64_t, double)>
      paged_attention;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const Ops& ops() {
  static const Ops instance = [] {
    Ops o{
        find<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("octavo_cpu::rms_norm"),
        find<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
            "octavo_cpu::fused_add_rms_norm"),
        find<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&)>("octavo_cpu::rotary_neox"),
        find<at::Tensor(const at::Tensor&)>("octavo_cpu::silu_and_mul"),
        find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, std::string)>(
            "octavo_cpu::gguf_matmul"),
        find<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
            "octavo_cpu::write_kv_cache"),
        find<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double, std::string, int64_t,
                        int64_t, double)>("octavo_cpu::paged_attention"),
    };
    return o;
  }();
  return instance;
}

TensorPair llama_decoder_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, const at::Tensor& slot_mapping,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    const at::Tensor& qkv_weight, int64_t qkv_qtype, const at::Tensor& o_weight,
    int64_t o_qtype, const at::Tensor& gate_up_weight, int64_t gate_up_qtype,
    const at::Tensor& down_weight, int64_t down_qtype, const at::Tensor& cos_sin,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale) {
  TORCH_CHECK(hidden.dim() == 2, "octavo_cpu: hidden must be [num_tokens, hidden_size], got ",
              hidden.sizes());
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "octavo_cpu: num_heads, num_kv_heads and head_dim must be positive");
  const Ops& o = ops();
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;

  at::Tensor h, residual;
  if (residual_in.has_value() && residual_in->defined()) {
    std::tie(h, residual) = o.fused_add_rms_norm.call(hidden, *residual_in, input_norm, eps);
  } else {
    residual = hidden;
    h = o.rms_norm.call(hidden, input_norm, eps);
  }

  const at::Tensor qkv = o.gguf_matmul.call(h, qkv_weight, qkv_qtype, hidden_size, "");
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "octavo_cpu: the QKV weight has ",
              qkv.size(1), " rows, the heads need ", q_size + 2 * kv_size);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  at::Tensor q_rot, k_rot;
  std::tie(q_rot, k_rot) = o.rotary_neox.call(positions, q, k, cos_sin);

  o.write_kv_cache.call(k_rot, v, kv_cache, slot_mapping);
  const at::Tensor attn = o.paged_attention.call(q_rot, kv_cache, query_start_loc, seq_lens,
                                                 block_tables, scale, "", 0, 0, 0.0);
  const at::Tensor attn_out = o.gguf_matmul.call(attn.reshape({num_tokens, q_size}), o_weight,
                                                 o_qtype, q_size, "");

  std::tie(h, residual) = o.fused_add_rms_norm.call(attn_out, residual, post_norm, eps);
  const at::Tensor gate_up =
      o.gguf_matmul.call(h, gate_up_weight, gate_up_qtype, hidden_size, "");
  const at::Tensor act = o.silu_and_mul.call(gate_up);
  at::Tensor out = o.gguf_matmul.call(act, down_weight, down_qtype, act.size(1), "");
  return {out, residual};
}

}  // namespace
}  // namespace octavo_cpu

TORCH_LIBRARY_FRAGMENT(octavo_cpu, m) {
  m.def("llama_decoder_layer(Tensor hidden, Tensor? residual, Tensor positions, "
        "Tensor(a!) kv_cache, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
        "Tensor slot_mapping, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_weight, int qkv_qtype, Tensor o_weight, int o_qtype, "
        "Tensor gate_up_weight, int gate_up_qtype, Tensor down_weight, int down_qtype, "
        "Tensor cos_sin, int num_heads, int num_kv_heads, int head_dim, float scale) "
        "-> (Tensor, Tensor)",
        &octavo_cpu::llama_decoder_layer);
}
