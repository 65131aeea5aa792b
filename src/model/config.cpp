#include "model/config.h"

#include <algorithm>
#include <sstream>

#include "io/json_config.h"
#include "util/error.h"
#include "util/strings.h"

namespace kvx::model {

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  io::JsonReader r(j, "model config");
  ModelConfig c;
  c.vocab_size = r.require<int>("vocab_size");
  c.hidden_size = r.require<int>("hidden_size");
  c.num_hidden_layers = r.require<int>("num_hidden_layers");
  c.num_attention_heads = r.require<int>("num_attention_heads");
  c.num_key_value_heads = r.get<int>("num_key_value_heads", c.num_attention_heads);
  c.head_dim = r.get<int>("head_dim", c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.intermediate_size = r.require<int>("intermediate_size");
  c.max_position_embeddings = r.require<int>("max_position_embeddings");
  c.rope_theta = r.get<double>("rope_theta", c.rope_theta);
  c.rms_norm_eps = r.get<double>("rms_norm_eps", c.rms_norm_eps);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", c.tie_word_embeddings);
  c.layout = r.get<std::string>("layout", c.layout);
  c.qk_norm = r.get<bool>("qk_norm", c.qk_norm);
  c.lrkv_rank = r.get<int>("lrkv_rank", c.lrkv_rank);
  c.lrkv_rope = r.get<std::string>("lrkv_rope", c.lrkv_rope);
  c.kv_lora_rank = r.get<int>("kv_lora_rank", c.kv_lora_rank);
  c.qk_rope_head_dim = r.get<int>("qk_rope_head_dim", c.qk_rope_head_dim);
  c.loops = r.get<int>("loops", c.loops);
  c.sandwich_norm = r.get<bool>("sandwich_norm", c.sandwich_norm);
  c.exit_gate = r.get<bool>("exit_gate", c.exit_gate);
  c.exit_threshold = r.get<double>("exit_threshold", c.exit_threshold);
  c.exit_entropy_weight = r.get<double>("exit_entropy_weight", c.exit_entropy_weight);
  c.linear_num_heads = r.get<int>("linear_num_heads", c.linear_num_heads);
  c.linear_key_head_dim = r.get<int>("linear_key_head_dim", c.linear_key_head_dim);
  c.linear_value_head_dim = r.get<int>("linear_value_head_dim", c.linear_value_head_dim);
  c.linear_conv_kernel_dim = r.get<int>("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
  c.nats_attention_heads = r.get<int>("nats_attention_heads", c.nats_attention_heads);
  c.nats_block_size = r.get<int>("nats_block_size", c.nats_block_size);
  c.nats_rope = r.get<bool>("nats_rope", c.nats_rope);
  c.nats_router_grad = r.get<std::string>("nats_router_grad", c.nats_router_grad);
  c.nats_max_softmax_fraction = r.get<double>("nats_max_softmax_fraction", c.nats_max_softmax_fraction);
  c.nats_max_softmax_blocks = r.get<int>("nats_max_softmax_blocks", c.nats_max_softmax_blocks);
  std::string arch = r.get<std::string>("model_type", "kvx");
  if (arch != "kvx") throw Error("model config: model_type '" + arch + "' is not a kvx model (expected \"kvx\")");
  r.finish();
  c.validate();
  return c;
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j = {{"model_type", "kvx"},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden_size},
          {"num_hidden_layers", num_hidden_layers},
          {"num_attention_heads", num_attention_heads},
          {"num_key_value_heads", num_key_value_heads},
          {"head_dim", head_dim},
          {"intermediate_size", intermediate_size},
          {"max_position_embeddings", max_position_embeddings},
          {"rope_theta", rope_theta},
          {"rms_norm_eps", rms_norm_eps},
          {"tie_word_embeddings", tie_word_embeddings},
          {"layout", layout}};
  if (qk_norm) j["qk_norm"] = true;
  if (loops != 1) j["loops"] = loops;
  if (sandwich_norm) j["sandwich_norm"] = true;
  if (exit_gate) {
    j["exit_gate"] = true;
    j["exit_threshold"] = exit_threshold;
    j["exit_entropy_weight"] = exit_entropy_weight;
  }
  // Family settings only where a layer uses the family (dense configs stay plain Llama ones).
  if (uses("lrkv")) {
    j["lrkv_rank"] = lrkv_rank;
    j["lrkv_rope"] = lrkv_rope;
  }
  if (uses("mla")) {
    j["kv_lora_rank"] = kv_lora_rank;
    j["qk_rope_head_dim"] = qk_rope_head_dim;
  }
  if (uses("gdn") || uses("natsl")) {
    j["linear_num_heads"] = linear_num_heads;
    j["linear_key_head_dim"] = linear_key_head_dim;
    j["linear_value_head_dim"] = linear_value_head_dim;
    j["linear_conv_kernel_dim"] = linear_conv_kernel_dim;
  }
  if (uses("natsl")) {
    j["nats_attention_heads"] = nats_attention_heads;
    j["nats_block_size"] = nats_block_size;
    j["nats_rope"] = nats_rope;
    j["nats_router_grad"] = nats_router_grad;
    j["nats_max_softmax_fraction"] = nats_max_softmax_fraction;
    j["nats_max_softmax_blocks"] = nats_max_softmax_blocks;
  }
  return j;
}

std::vector<std::string> lrkv_rope_modes() { return {"expand", "shared_rope", "pair_aligned"}; }
std::vector<std::string> mixer_kinds() { return {"dense", "lrkv", "mla", "gdn", "natsl"}; }

bool ModelConfig::uses(const std::string& kind) const {
  for (const auto& k : layer_kinds())
    if (k == kind) return true;
  return false;
}

void ModelConfig::validate() const {
  auto positive = [](int v, const char* name) {
    if (v <= 0) throw Error(std::string("model config: ") + name + " must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(intermediate_size, "intermediate_size");
  positive(max_position_embeddings, "max_position_embeddings");
  if (qk_norm)
    for (const auto& kind : layer_kinds())
      if (kind != "dense")
        throw Error("model config: qk_norm (Qwen3's per-head query/key RMSNorm) applies to dense layers only, found '" + kind +
                    "'; drop qk_norm or use layout dense");
  if (num_attention_heads % num_key_value_heads != 0)
    throw Error("model config: num_key_value_heads (" + std::to_string(num_key_value_heads) +
                ") must divide num_attention_heads (" + std::to_string(num_attention_heads) +
                "); use H (MHA), a divisor of H (GQA) or 1 (MQA)");
  if (head_dim % 2 != 0) throw Error("model config: head_dim must be even for RoPE, got " + std::to_string(head_dim));
  if (rope_theta <= 0) throw Error("model config: rope_theta must be positive");
  if (rms_norm_eps <= 0) throw Error("model config: rms_norm_eps must be positive");
  const auto known = mixer_kinds();
  for (const auto& kind : layer_kinds())  // layer_kinds validates the layout's form
    if (std::find(known.begin(), known.end(), kind) == known.end()) {
      std::string valid;
      for (const auto& k : known) valid += (valid.empty() ? "" : ", ") + k;
      throw Error("model config: layout names an unknown mixer kind '" + kind + "' (valid: " + valid + ")");
    }
  if (loops < 1 || loops > 64)
    throw Error("model config: loops (times the layer stack runs) must be in [1, 64], got " + std::to_string(loops));
  if (exit_gate && loops < 2)
    throw Error("model config: exit_gate needs loops >= 2 (it picks the loop whose state feeds the LM head)");
  if (exit_gate && !(exit_threshold > 0 && exit_threshold <= 1))
    throw Error("model config: exit_threshold must be in (0, 1], got " + std::to_string(exit_threshold) +
                " (1 always reads the last loop)");
  if (exit_gate && !(exit_entropy_weight >= 0))
    throw Error("model config: exit_entropy_weight must be >= 0, got " + std::to_string(exit_entropy_weight));
  if (uses("lrkv")) {
    if (lrkv_rank < 0 || lrkv_rank > head_dim)
      throw Error("model config: lrkv_rank (" + std::to_string(lrkv_rank) + ") must be in [0, head_dim = " +
                  std::to_string(head_dim) + "]; a residual rank above the head width adds cache without adding rank");
    const auto modes = lrkv_rope_modes();
    if (std::find(modes.begin(), modes.end(), lrkv_rope) == modes.end())
      throw Error("model config: lrkv_rope '" + lrkv_rope + "' is not one of expand, shared_rope, pair_aligned");
    if (lrkv_rope == "pair_aligned" && lrkv_rank % 2 != 0)
      throw Error("model config: lrkv_rope pair_aligned keeps the residual in whole RoPE planes, so lrkv_rank must be even (got " +
                  std::to_string(lrkv_rank) + ")");
  }
  if (uses("mla")) {
    if (kv_lora_rank < 1) throw Error("model config: kv_lora_rank (MLA latent width d_c) must be positive");
    if (qk_rope_head_dim < 2 || qk_rope_head_dim % 2 != 0)
      throw Error("model config: qk_rope_head_dim (MLA decoupled RoPE key width d_R) must be even and >= 2, got " +
                  std::to_string(qk_rope_head_dim));
  }
  if (uses("gdn") || uses("natsl")) {
    positive(linear_num_heads, "linear_num_heads");
    positive(linear_key_head_dim, "linear_key_head_dim");
    positive(linear_value_head_dim, "linear_value_head_dim");
    positive(linear_conv_kernel_dim, "linear_conv_kernel_dim");
  }
  if (uses("natsl")) {
    positive(nats_attention_heads, "nats_attention_heads");
    positive(nats_block_size, "nats_block_size");
    const int H = linear_num_heads, HA = nats_attention_heads;
    if (HA % H != 0)
      throw Error("model config: nats_attention_heads (" + std::to_string(HA) + ") must be a multiple of linear_num_heads (" +
                  std::to_string(H) + "): each GDN head's channels are split among HA/H softmax heads that share its route");
    const int GA = HA / H;
    if (linear_key_head_dim % GA != 0 || linear_value_head_dim % GA != 0)
      throw Error("model config: linear_key_head_dim (" + std::to_string(linear_key_head_dim) + ") and linear_value_head_dim (" +
                  std::to_string(linear_value_head_dim) + ") must be divisible by nats_attention_heads / linear_num_heads = " +
                  std::to_string(GA) + " (the softmax heads per routing group)");
    if (nats_rope && (linear_key_head_dim / GA) % 2 != 0)
      throw Error("model config: the NAtS-L softmax head width linear_key_head_dim / (nats_attention_heads / linear_num_heads) = " +
                  std::to_string(linear_key_head_dim / GA) + " must be even for RoPE; change the widths or set nats_rope false");
    if (nats_router_grad != "sparse" && nats_router_grad != "dense")
      throw Error("model config: nats_router_grad '" + nats_router_grad +
                  "' is not one of sparse (the paper's rule), dense (straight-through)");
    if (!(nats_max_softmax_fraction > 0 && nats_max_softmax_fraction <= 1))
      throw Error("model config: nats_max_softmax_fraction must be in (0, 1] (1 = no KV budget), got " +
                  std::to_string(nats_max_softmax_fraction));
    if (nats_max_softmax_blocks < 0)
      throw Error("model config: nats_max_softmax_blocks must be >= 0 (0 = no cap), got " + std::to_string(nats_max_softmax_blocks));
  }
}

std::vector<std::string> ModelConfig::layer_kinds() const { return expand_layout(layout, num_hidden_layers); }

std::vector<std::string> expand_layout(const std::string& layout, int num_layers) {
  constexpr int kMaxLayers = 1 << 16;  // a sanity bound: the layout is expanded into one entry per layer
  if (num_layers < 1 || num_layers > kMaxLayers)
    throw Error("num_hidden_layers must be in [1, " + std::to_string(kMaxLayers) + "], got " + std::to_string(num_layers));
  std::vector<std::string> kinds;
  std::stringstream ss(layout);
  std::string item;
  int items = 0;
  while (std::getline(ss, item, ',')) {
    ++items;
    std::string kind = item;
    int count = 1;
    auto star = item.find('*');
    if (star != std::string::npos) {
      kind = item.substr(0, star);
      count = whole_int(item.substr(star + 1)).value_or(-1);
      if (count <= 0)
        throw Error("layout '" + layout + "': bad repeat count in '" + item + "' (write kind*N with N >= 1)");
    }
    if (kind.empty()) throw Error("layout '" + layout + "': empty mixer kind");
    if (count > num_layers - static_cast<int>(kinds.size()))  // checked before expanding: N may be huge
      throw Error("layout '" + layout + "' describes more than num_hidden_layers = " + std::to_string(num_layers) +
                  " layers; make them agree");
    kinds.insert(kinds.end(), count, kind);
  }
  if (items == 1 && layout.find('*') == std::string::npos) kinds.assign(num_layers, kinds.empty() ? "" : kinds[0]);
  if (static_cast<int>(kinds.size()) != num_layers)
    throw Error("layout '" + layout + "' describes " + std::to_string(kinds.size()) + " layers but num_hidden_layers is " +
                std::to_string(num_layers) + "; make them agree");
  return kinds;
}

}  // namespace kvx::model
