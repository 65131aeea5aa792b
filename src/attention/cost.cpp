#include "attention/cost.h"

#include <sstream>

#include "util/error.h"

namespace kvx::attention {

namespace {

int parse_int(const std::string& spec, const std::string& key, const std::string& value) {
  try {
    size_t used = 0;
    const int v = std::stoi(value, &used);
    if (used == value.size()) return v;
  } catch (...) {
  }
  throw Error("shape '" + spec + "': " + key + "=" + value + " is not an integer");
}

}  // namespace

AttentionShape AttentionShape::parse(const std::string& spec) {
  const std::string usage =
      "; write kind:key=value,... with kind mha|gqa|mqa|lrkv|mla and keys H, Hkv, d_h, d, r, rope, d_c, d_R "
      "(e.g. lrkv:H=18,r=55,d_h=128)";
  AttentionShape s;
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  if (kind == "mha" || kind == "gqa" || kind == "mqa" || kind == "dense") {
    s.kind = "dense";
  } else if (kind == "lrkv" || kind == "mla") {
    s.kind = kind;
  } else {
    throw Error("shape '" + spec + "': unknown attention kind '" + kind + "'" + usage);
  }
  if (colon != std::string::npos) {
    std::stringstream ss(spec.substr(colon + 1));
    std::string item;
    while (std::getline(ss, item, ',')) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) throw Error("shape '" + spec + "': '" + item + "' is not key=value" + usage);
      const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
      if (key == "H") s.heads = parse_int(spec, key, value);
      else if (key == "Hkv") s.kv_heads = parse_int(spec, key, value);
      else if (key == "d_h") s.head_dim = parse_int(spec, key, value);
      else if (key == "d") s.hidden = parse_int(spec, key, value);
      else if (key == "r") s.rank = parse_int(spec, key, value);
      else if (key == "rope") s.rope = value;
      else if (key == "d_c") s.latent = parse_int(spec, key, value);
      else if (key == "d_R") s.rope_dim = parse_int(spec, key, value);
      else throw Error("shape '" + spec + "': unknown key '" + key + "'" + usage);
    }
  }
  if (kind == "mha") s.kv_heads = s.heads;
  if (kind == "mqa") s.kv_heads = 1;
  if (kind == "gqa" && s.kv_heads == 0) throw Error("shape '" + spec + "': gqa needs Hkv" + usage);
  if (s.kind == "dense" && s.kv_heads == 0) s.kv_heads = s.heads;
  s.validate();
  return s;
}

AttentionShape AttentionShape::of_layer(const model::ModelConfig& c, const std::string& kind) {
  AttentionShape s;
  s.kind = kind;
  s.hidden = c.hidden_size;
  s.heads = c.num_attention_heads;
  s.kv_heads = c.num_key_value_heads;
  s.head_dim = c.head_dim;
  s.rank = c.lrkv_rank;
  s.rope = c.lrkv_rope;
  s.latent = c.kv_lora_rank;
  s.rope_dim = c.qk_rope_head_dim;
  s.validate();
  return s;
}

void AttentionShape::validate() const {
  const std::string what = "attention shape (" + kind + ")";
  if (kind != "dense" && kind != "lrkv" && kind != "mla")
    throw Error(what + ": no cost model for mixer kind '" + kind + "' (known: dense, lrkv, mla)");
  if (heads < 1) throw Error(what + ": H must be positive");
  if (head_dim < 1) throw Error(what + ": d_h must be positive");
  if (hidden < 0) throw Error(what + ": d must not be negative");
  if (kind == "dense" && (kv_heads < 1 || heads % kv_heads != 0))
    throw Error(what + ": Hkv (" + std::to_string(kv_heads) + ") must divide H (" + std::to_string(heads) + ")");
  if (kind == "lrkv" && (rank < 0 || rank > head_dim))
    throw Error(what + ": r (" + std::to_string(rank) + ") must be in [0, d_h = " + std::to_string(head_dim) +
                "]; a residual rank above the head width adds cache without adding rank");
  if (kind == "mla" && (latent < 1 || rope_dim < 0))
    throw Error(what + ": needs d_c >= 1 and d_R >= 0");
}

std::string AttentionShape::describe() const {
  std::string s = kind + " H=" + std::to_string(heads);
  if (kind == "dense") s += " Hkv=" + std::to_string(kv_heads);
  s += " d_h=" + std::to_string(head_dim);
  if (kind == "lrkv") s += " r=" + std::to_string(rank) + " (" + rope + ")";
  if (kind == "mla") s += " d_c=" + std::to_string(latent) + " d_R=" + std::to_string(rope_dim);
  if (hidden > 0) s += " d=" + std::to_string(hidden);
  return s;
}

std::vector<std::pair<int, int>> AttentionShape::cache_rows() const {
  if (kind == "dense") return {{2 * kv_heads, head_dim}};
  if (kind == "lrkv") {  // K_s, V_s; R_h^K, R_h^V per head
    std::vector<std::pair<int, int>> rows = {{2, head_dim}};
    if (rank > 0) rows.push_back({2 * heads, rank});
    return rows;
  }
  return {{1, latent + rope_dim}};  // mla: one row [c | k_R] per token
}

double AttentionShape::cache_elements() const {
  double n = 0;
  for (auto [count, width] : cache_rows()) n += static_cast<double>(count) * width;
  return n;
}

double AttentionShape::cache_bytes(kernels::KVType type) const {
  double n = 0;
  for (auto [count, width] : cache_rows()) n += static_cast<double>(count) * kernels::row_bytes(type, width);
  return n;
}

double AttentionShape::kv_params() const {
  const double d = hidden, H = heads, dh = head_dim;
  if (kind == "dense") return 2.0 * d * kv_heads * dh;
  if (kind == "lrkv") {
    double p = 2.0 * d * dh + 2.0 * H * rank * (d + dh);
    if (rope == "pair_aligned") p -= H * rank * dh;  // B_h^K is a fixed plane selection
    return p;
  }
  return d * (latent + rope_dim) + 2.0 * H * latent * dh;
}

}  // namespace kvx::attention
