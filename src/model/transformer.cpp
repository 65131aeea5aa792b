#include "model/transformer.h"

#include <cmath>

#include "attention/dense.h"
#include "attention/lla.h"
#include "attention/nectar.h"
#include "util/error.h"

namespace kvx::model {

BlockImpl::BlockImpl(const ModelConfig& c, int layer) {
  input_layernorm = register_module("input_layernorm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  self_attn = register_module("self_attn", attention::make_mixer(c.layer_kinds()[layer], c, layer));
  post_attention_layernorm = register_module("post_attention_layernorm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  mlp = register_module("mlp", nn::SwiGLU(c.hidden_size, c.intermediate_size));
  if (c.sandwich_norm) {
    input_layernorm_2 = register_module("input_layernorm_2", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
    post_attention_layernorm_2 = register_module("post_attention_layernorm_2", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  }
}

torch::Tensor BlockImpl::finish(const torch::Tensor& h, const torch::Tensor& attn_out) {
  auto x = h + (input_layernorm_2 ? input_layernorm_2(attn_out) : attn_out);
  auto m = mlp(post_attention_layernorm(x));
  return x + (post_attention_layernorm_2 ? post_attention_layernorm_2(m) : m);
}

torch::Tensor BlockImpl::forward(const torch::Tensor& h) { return finish(h, self_attn->forward(input_layernorm(h))); }

torch::Tensor BlockImpl::step(const torch::Tensor& h, attention::MixerCache& cache) {
  return finish(h, self_attn->step(input_layernorm(h), cache));
}

int64_t DecodeState::bytes() const {
  int64_t b = 0;
  for (const auto& l : layers) b += l->bytes();
  return b;
}
double DecodeState::bytes_per_token() const {
  double b = 0;
  for (const auto& l : layers) b += l->bytes_per_token();
  return b;
}
void DecodeState::clear() {
  for (auto& l : layers) l->clear();
}

TransformerImpl::TransformerImpl(const ModelConfig& c) : config_(c) {
  c.validate();
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int i = 0; i < c.num_hidden_layers; ++i) layers->push_back(Block(c, i));
  norm = register_module("norm", nn::RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (!c.tie_word_embeddings) lm_head = register_module("lm_head", nn::linear_no_bias(c.hidden_size, c.vocab_size));
  if (c.exit_gate) early_exit_gate = register_module("early_exit_gate", nn::Linear(c.hidden_size, 1));
  init_weights();
}

void TransformerImpl::init_weights() {
  torch::NoGradGuard ng;
  const double out_std = 0.02 / std::sqrt(2.0 * config_.num_hidden_layers * config_.loops);  // residual adds in all loops
  for (auto& p : named_parameters()) {
    const std::string& n = p.key();
    if (p.value().dim() < 2) continue;  // norms keep their ones
    auto ends_with = [&](const std::string& suffix) {
      return n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    const bool residual_out = ends_with("self_attn.o_proj.weight") || ends_with("mlp.down_proj.weight");
    p.value().normal_(0.0, residual_out ? out_std : 0.02);
  }
  for (auto& layer : *layers) layer->as<BlockImpl>()->self_attn->initialize();
  if (early_exit_gate) early_exit_gate->bias.zero_();  // lambda = 1/2 at the start
}

torch::Tensor TransformerImpl::head(const torch::Tensor& x) {
  return config_.tie_word_embeddings ? nn::linear(x, embed_tokens->weight) : lm_head(x);
}

torch::Tensor TransformerImpl::logits(const torch::Tensor& h) { return head(norm(h)); }

torch::Tensor TransformerImpl::exit_distribution(const torch::Tensor& lambdas) {
  const int64_t T = lambdas.size(-1);
  // survive_t = prod_{s<t} (1 - lambda_s); p_t = lambda_t survive_t, p_T = survive_T.
  auto stay = 1 - lambdas.narrow(-1, 0, T - 1);
  auto survive = torch::cat({torch::ones_like(lambdas.narrow(-1, 0, 1)), torch::cumprod(stay, -1)}, -1);
  auto p = survive * lambdas;
  return torch::cat({p.narrow(-1, 0, T - 1), survive.narrow(-1, T - 1, 1)}, -1);
}

torch::Tensor TransformerImpl::gated_logits(const std::vector<torch::Tensor>& normed) {
  std::vector<torch::Tensor> lambdas;
  for (const auto& x : normed) lambdas.push_back(torch::sigmoid(early_exit_gate(x)));
  const auto p = exit_distribution(torch::cat(lambdas, -1));               // [B, T, loops]
  auto reached = (torch::cumsum(p, -1) >= config_.exit_threshold).to(torch::kInt);
  reached.select(-1, p.size(-1) - 1).fill_(1);  // the last loop always exits (its cumulative sum is 1 up to rounding)
  const auto exit = std::get<1>(torch::max(reached, -1));  // the first loop that reached it
  const auto states = torch::stack(normed, 2);                              // [B, T, loops, d]
  const auto index = exit.unsqueeze(-1).unsqueeze(-1).expand({states.size(0), states.size(1), 1, states.size(3)});
  return head(states.gather(2, index).squeeze(2));
}

TransformerImpl::LoopStates TransformerImpl::loop_states(const torch::Tensor& ids) {
  if (!config_.exit_gate) throw Error("loop_states: the model has no exit gate (exit_gate in config.json)");
  LoopStates out;
  run(ids, nullptr, nullptr, &out.normed);
  std::vector<torch::Tensor> lambdas;
  for (const auto& x : out.normed) lambdas.push_back(torch::sigmoid(early_exit_gate(x)));
  out.exit_probs = exit_distribution(torch::cat(lambdas, -1));
  return out;
}

torch::Tensor TransformerImpl::lm_loss(const torch::Tensor& ids, const torch::Tensor& targets) {
  auto ce = [](const torch::Tensor& logits, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}),
                                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
        .view(y.sizes());
  };
  // Targets of -100 (torch's ignore_index; MQAR rows use it) count nowhere: the mean is over the rest.
  const auto valid = (targets != -100).to(torch::kFloat32);
  const auto count = valid.sum().clamp_min(1.0);
  if (!config_.exit_gate) return ce(forward(ids), targets).sum() / count;
  const auto s = loop_states(ids);
  torch::Tensor expected = torch::zeros_like(targets, torch::kFloat32).to(s.exit_probs.scalar_type());
  for (size_t t = 0; t < s.normed.size(); ++t) expected = expected + s.exit_probs.select(-1, t) * ce(head(s.normed[t]), targets);
  const auto entropy = -(s.exit_probs * torch::log(s.exit_probs.clamp_min(1e-12))).sum(-1);
  return ((expected - config_.exit_entropy_weight * entropy) * valid.to(expected.scalar_type())).sum() / count;
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& ids) { return forward(ids, nullptr); }

torch::Tensor TransformerImpl::forward(const torch::Tensor& ids, const LayerObserver& observe, const MixerOverride& mixer_output) {
  if (!config_.exit_gate) return logits(run(ids, observe, mixer_output, nullptr));
  std::vector<torch::Tensor> normed;
  run(ids, observe, mixer_output, &normed);
  return gated_logits(normed);
}

torch::Tensor TransformerImpl::run(const torch::Tensor& ids, const LayerObserver& observe, const MixerOverride& mixer_output,
                                   std::vector<torch::Tensor>* normed) {
  if (ids.size(1) > config_.max_position_embeddings)
    throw Error("sequence of " + std::to_string(ids.size(1)) + " tokens exceeds the model's context limit of " +
                std::to_string(config_.max_position_embeddings) + " (max_position_embeddings); use a shorter input");
  auto h = embed_tokens(ids);
  for (int t = 0; t < config_.loops; ++t) {
    if (t > 0) h = normed ? normed->back() : norm(h);  // the normed state of loop t-1 feeds loop t
    for (size_t i = 0; i < layers->size(); ++i) {
      auto* block = layers[i]->as<BlockImpl>();
      if (!observe && !mixer_output) {
        h = block->forward(h);
        continue;
      }
      const auto x = block->input_layernorm(h);
      if (observe) observe(t, static_cast<int>(i), x);
      torch::Tensor a;
      if (mixer_output) a = mixer_output(t, static_cast<int>(i), x);
      h = block->finish(h, a.defined() ? a : block->self_attn->forward(x));
    }
    if (normed) normed->push_back(norm(h));
  }
  return h;
}

DecodeState TransformerImpl::new_state(int64_t batch, const attention::CacheOptions& options) const {
  DecodeState s;
  if (options.share_kv_layers > 1 && options.lla)
    throw Error("cross-layer KV sharing and an LLA codec are separate baselines; drop --share-kv-layers or --lla");
  if (options.document) {  // Nectar: local tokens after a document module
    if (options.lla || options.share_kv_layers > 1)
      throw Error("a Nectar document module composes with plain dense caches; drop --lla and --share-kv-layers");
    if (config_.loops != 1) throw Error("Nectar document modules are fitted for non-looped models (loops = 1)");
    for (const auto& kind : config_.layer_kinds())
      if (kind != "dense") throw Error("a Nectar document module needs every layer dense, found '" + kind + "'");
    if (options.document->layers.size() != layers->size())
      throw Error("the Nectar document module has " + std::to_string(options.document->layers.size()) +
                  " layers but the model has " + std::to_string(layers->size()) + "; it was fitted for another model");
  }
  if (options.lla) {  // history as cross-loop codes
    if (options.lla->loops != config_.loops)
      throw Error("the LLA codec was fitted for " + std::to_string(options.lla->loops) + " loops but the model runs " +
                  std::to_string(config_.loops));
    for (const auto& kind : config_.layer_kinds())
      if (kind != "dense") throw Error("an LLA codec needs every layer dense, found '" + kind + "'");
    s.layers = attention::make_lla_caches(options, static_cast<int>(layers->size()));
    return s;
  }
  if (options.share_kv_layers > 1) {  // CLA: the first layer of each run of adjacent layers keeps K/V for all
    if (options.type != kernels::KVType::F32 || options.evict.enabled())
      throw Error("cross-layer KV sharing runs on the libtorch f32 caches; drop --kv-cache and --evict");
    const auto kinds = config_.layer_kinds();
    auto reference = options;
    reference.reference = true;
    for (int t = 0; t < config_.loops; ++t)
      for (size_t l = 0; l < layers->size(); ++l) {
        if (kinds[l] != "dense") throw Error("cross-layer KV sharing needs every layer dense, found '" + kinds[l] + "'");
        const size_t first = l - l % options.share_kv_layers;
        if (l == first) {
          s.layers.push_back((*layers)[l]->as<BlockImpl>()->self_attn->new_cache(batch, reference));
        } else {
          const auto* source = dynamic_cast<const attention::DenseKVCache*>(s.layers[t * layers->size() + first].get());
          if (!source) throw Error("cross-layer KV sharing: layer " + std::to_string(first) + " made no libtorch KV cache");
          s.layers.push_back(std::make_unique<attention::SharedKVCache>(source));
        }
      }
    return s;
  }
  // Eviction applies to the layers that keep per-token K/V; GDN layers (a constant-size state)
  // keep theirs, so hybrids evict their attention layers. A model of GDN layers alone has
  // nothing to evict.
  const auto kinds = config_.layer_kinds();
  attention::CacheOptions stateful = options;
  stateful.evict = {};
  if (options.evict.enabled() && std::all_of(kinds.begin(), kinds.end(), [](const std::string& k) { return k == "gdn"; }))
    throw Error("every layer of this model is GDN (a constant-size state), so there is no KV to evict; drop --evict");
  for (int t = 0; t < config_.loops; ++t)
    for (size_t i = 0; i < kinds.size(); ++i)
      s.layers.push_back((*layers)[i]->as<BlockImpl>()->self_attn->new_cache(batch, kinds[i] == "gdn" ? stateful : options));
  return s;
}

torch::Tensor TransformerImpl::step(const torch::Tensor& ids, DecodeState& state) {
  const int64_t end = state.length() + ids.size(1);
  if (end > config_.max_position_embeddings)
    throw Error("context of " + std::to_string(end) + " tokens exceeds the model's limit of " +
                std::to_string(config_.max_position_embeddings) +
                " (max_position_embeddings); shorten the prompt or lower --max-new");
  const size_t D = layers->size();
  if (state.layers.size() != D * config_.loops)
    throw Error("decode state has " + std::to_string(state.layers.size()) + " caches but this model needs " +
                std::to_string(D * config_.loops) + " (layers x loops); make it with this model's new_state");
  auto h = embed_tokens(ids);
  std::vector<torch::Tensor> normed;  // exit gate: each loop's normed state
  for (int t = 0; t < config_.loops; ++t) {
    if (t > 0) h = config_.exit_gate ? normed.back() : norm(h);
    for (size_t i = 0; i < D; ++i) h = layers[i]->as<BlockImpl>()->step(h, *state.layers[t * D + i]);
    if (config_.exit_gate) normed.push_back(norm(h));
  }
  return config_.exit_gate ? gated_logits(normed) : logits(h);
}

double TransformerImpl::kv_bytes_per_token(kernels::KVType type) const {
  double b = 0;
  for (const auto& layer : *layers) b += layer->as<BlockImpl>()->self_attn->cache_bytes_per_token(type);
  return b * config_.loops;
}

double TransformerImpl::state_bytes() const {
  double b = 0;
  for (const auto& layer : *layers) b += layer->as<BlockImpl>()->self_attn->state_bytes();
  return b * config_.loops;
}

int64_t TransformerImpl::num_parameters(bool include_embedding) const {
  int64_t n = 0;
  for (const auto& p : named_parameters()) {
    if (!include_embedding && p.key().rfind("embed_tokens", 0) == 0) continue;
    n += p.value().numel();
  }
  return n;
}

namespace {
std::string to_hf(const std::string& name) { return name.rfind("lm_head", 0) == 0 ? name : "model." + name; }
}  // namespace

nn::TensorMap TransformerImpl::state_dict_hf() const {
  nn::TensorMap out;
  for (const auto& p : named_parameters()) out[to_hf(p.key())] = p.value().detach();
  return out;
}

void TransformerImpl::load_state_dict_hf(const nn::TensorMap& tensors, const std::string& what) {
  torch::NoGradGuard ng;
  size_t used = 0;
  for (auto& p : named_parameters()) {
    const std::string name = to_hf(p.key());
    auto it = tensors.find(name);
    if (it == tensors.end())
      throw Error(what + ": missing tensor '" + name + "'; the weights do not match config.json (different layout or tie_word_embeddings?)");
    if (it->second.sizes() != p.value().sizes()) {
      std::ostringstream ss;
      ss << what << ": tensor '" << name << "' has shape " << it->second.sizes() << " but config.json implies "
         << p.value().sizes() << "; the weights do not match the config";
      throw Error(ss.str());
    }
    p.value().copy_(it->second.to(p.value().scalar_type()));
    ++used;
  }
  if (used != tensors.size()) {
    for (const auto& [name, t] : tensors) {
      bool known = false;
      for (const auto& p : named_parameters()) known = known || to_hf(p.key()) == name;
      if (!known) throw Error(what + ": unexpected tensor '" + name + "' not used by config.json; the weights do not match the config");
    }
  }
}

}  // namespace kvx::model
