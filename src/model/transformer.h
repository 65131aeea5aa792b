// Decoder-only transformer: embedding, pre-RMSNorm blocks (mixer from the layout + SwiGLU MLP),
// final norm, tied or untied LM head. Parameter names follow Hugging Face Llama
// ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight").
// Looped (config.loops = T > 1, Ouro-style, SPEC 1.3): the block stack runs T times with shared
// weights and RoPE; after each loop but the last the final norm is applied and the normed state
// feeds the next loop. The decode state holds one cache per (loop, layer), loop-major. Sandwich
// norms (Ouro names input_layernorm_2, post_attention_layernorm_2) normalise each sub-layer's
// output before the residual add.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "attention/mixer.h"
#include "model/config.h"
#include "nn/layers.h"
#include "nn/tensor_io.h"

namespace kvx::model {

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& c, int layer);
  torch::Tensor forward(const torch::Tensor& h);
  torch::Tensor step(const torch::Tensor& h, attention::MixerCache& cache);
  // The rest of the block given its mixer's output for input h: residuals, sandwich norms, MLP.
  torch::Tensor finish(const torch::Tensor& h, const torch::Tensor& attn_out);
  nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  nn::RMSNorm input_layernorm_2{nullptr}, post_attention_layernorm_2{nullptr};  // sandwich norms (optional)
  std::shared_ptr<attention::Mixer> self_attn;
  nn::SwiGLU mlp{nullptr};
};
TORCH_MODULE(Block);

// One cache per (loop, layer); the decode state of a whole model.
struct DecodeState {
  std::vector<std::unique_ptr<attention::MixerCache>> layers;
  int64_t length() const { return layers.empty() ? 0 : layers[0]->length(); }
  int64_t bytes() const;
  double bytes_per_token() const;
  void clear();
};

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const ModelConfig& c);
  // ids: [B, T] int64 -> logits [B, T, V] (float32).
  torch::Tensor forward(const torch::Tensor& ids);
  // The same, calling observe(loop, layer, the layer's normed mixer input [B, T, d]) on the way
  // (activation capture, e.g. for a latent KV codec).
  using LayerObserver = std::function<void(int, int, const torch::Tensor&)>;
  // mixer_output(loop, layer, normed input), when given and defined, replaces the layer's own
  // mixer output (a student attention reading compressed history, e.g. LLA distillation).
  using MixerOverride = std::function<torch::Tensor(int, int, const torch::Tensor&)>;
  torch::Tensor forward(const torch::Tensor& ids, const LayerObserver& observe, const MixerOverride& mixer_output = nullptr);
  DecodeState new_state(int64_t batch, const attention::CacheOptions& options = {}) const;
  // Appends ids [B, T] to the state and returns their logits [B, T, V]. Errors past the context limit.
  torch::Tensor step(const torch::Tensor& ids, DecodeState& state);
  // The training objective for next-token targets [B, T] (-100: ignored): mean cross-entropy, or with an exit gate
  // the expected cross-entropy over the exit distribution minus exit_entropy_weight x its entropy.
  torch::Tensor lm_loss(const torch::Tensor& ids, const torch::Tensor& targets);
  // Exit gate: every loop's normed state [B, T, d] and the exit distribution [B, T, loops].
  struct LoopStates {
    std::vector<torch::Tensor> normed;
    torch::Tensor exit_probs;
  };
  LoopStates loop_states(const torch::Tensor& ids);
  // p_t = lambda_t prod_{s<t} (1 - lambda_s), the last loop the rest: lambdas [..., loops] -> [..., loops].
  static torch::Tensor exit_distribution(const torch::Tensor& lambdas);
  double kv_bytes_per_token(kernels::KVType type = kernels::KVType::F32) const;  // all layers and loops, per batch row
  double state_bytes() const;  // constant-size decode state of all layers and loops (GDN, NAtS-L), per batch row
  int64_t num_parameters(bool include_embedding = true) const;

  nn::TensorMap state_dict_hf() const;            // HF names -> tensors
  void load_state_dict_hf(const nn::TensorMap& tensors, const std::string& what);  // strict, clear errors
  const ModelConfig& config() const { return config_; }

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers;
  nn::RMSNorm norm{nullptr};
  nn::Linear lm_head{nullptr};
  nn::Linear early_exit_gate{nullptr};  // d -> 1 with bias, when config.exit_gate

 private:
  // The loops over the stack; returns the last state before the final norm and, when `normed` is
  // given, appends each loop's normed state.
  torch::Tensor run(const torch::Tensor& ids, const LayerObserver& observe, const MixerOverride& mixer_output,
                    std::vector<torch::Tensor>* normed);
  torch::Tensor logits(const torch::Tensor& h);  // final norm, then the LM head
  torch::Tensor head(const torch::Tensor& normed);
  // With an exit gate: the LM head on each token's exit loop (first cumulative p >= threshold).
  torch::Tensor gated_logits(const std::vector<torch::Tensor>& normed);
  void init_weights();
  ModelConfig config_;
};
TORCH_MODULE(Transformer);

}  // namespace kvx::model
