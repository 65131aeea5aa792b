#include "attention/cost.h"
#include <algorithm>

#include <cstdio>
#include <sstream>

#include "util/error.h"
#include "util/strings.h"

namespace kvx::attention {

namespace {

int parse_int(const std::string& spec, const std::string& key, const std::string& value) {
  if (const auto v = whole_int(value)) return *v;
  throw Error("shape '" + spec + "': " + key + "=" + value + " is not an integer");
}

}  // namespace

AttentionShape AttentionShape::parse(const std::string& spec) {
  const std::string usage =
      "; write kind:key=value,... with kind mha|gqa|mqa|dense|lrkv|mla|gdn|natsl and keys H, Hkv, d_h, d, r, rope, d_c, d_R, "
      "d_v, conv, HA, f, C (e.g. lrkv:H=18,r=55,d_h=128 or natsl:H=6,HA=18,d_h=128,d_v=128,f=0.25)";
  AttentionShape s;
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  if (kind == "mha" || kind == "gqa" || kind == "mqa" || kind == "dense") {
    s.kind = "dense";
  } else if (kind == "lrkv" || kind == "mla" || kind == "gdn" || kind == "natsl") {
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
      else if (key == "d_v") s.value_dim = parse_int(spec, key, value);
      else if (key == "conv") s.conv = parse_int(spec, key, value);
      else if (key == "HA") s.attn_heads = parse_int(spec, key, value);
      else if (key == "C") s.block = parse_int(spec, key, value);
      else if (key == "f") {
        const auto f = whole_number(value);
        if (!f) throw Error("shape '" + spec + "': f=" + value + " is not a number");
        s.softmax_fraction = *f;
      }
      else throw Error("shape '" + spec + "': unknown key '" + key + "'" + usage);
    }
  }
  if ((kind == "mha" && s.kv_heads != 0 && s.kv_heads != s.heads) || (kind == "mqa" && s.kv_heads != 0 && s.kv_heads != 1))
    throw Error("shape '" + spec + "': " + kind + " has " + (kind == "mha" ? "Hkv = H" : "Hkv = 1") + ", not Hkv=" +
                std::to_string(s.kv_heads) + "; write gqa:H=..,Hkv=.. for another grouping" + usage);
  if (kind == "mha") s.kv_heads = s.heads;
  if (kind == "mqa") s.kv_heads = 1;
  if (kind == "gqa" && s.kv_heads == 0) throw Error("shape '" + spec + "': gqa needs Hkv" + usage);
  if (s.kind == "dense" && s.kv_heads == 0) s.kv_heads = s.heads;
  if ((s.kind == "gdn" || s.kind == "natsl") && s.value_dim == 0) s.value_dim = s.head_dim;
  if (s.kind == "natsl" && s.attn_heads == 0) s.attn_heads = s.heads;
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
  s.qk_norm = c.qk_norm && kind == "dense";
  if (kind == "gdn" || kind == "natsl") {
    s.heads = c.linear_num_heads;
    s.kv_heads = 0;
    s.head_dim = c.linear_key_head_dim;
    s.value_dim = c.linear_value_head_dim;
    s.conv = c.linear_conv_kernel_dim;
    if (kind == "natsl") {
      s.attn_heads = c.nats_attention_heads;
      s.softmax_fraction = c.nats_max_softmax_fraction;
      s.block = c.nats_block_size;
    }
  }
  s.validate();
  return s;
}

void AttentionShape::validate() const {
  const std::string what = "attention shape (" + kind + ")";
  if (kind != "dense" && kind != "lrkv" && kind != "mla" && kind != "gdn" && kind != "natsl")
    throw Error(what + ": no cost model for mixer kind '" + kind + "' (known: dense, lrkv, mla, gdn, natsl)");
  if (heads < 1) throw Error(what + ": H must be positive");
  if (head_dim < 1) throw Error(what + ": d_h must be positive");
  if (hidden < 0) throw Error(what + ": d must not be negative");
  if (kind == "dense" && (kv_heads < 1 || heads % kv_heads != 0))
    throw Error(what + ": Hkv (" + std::to_string(kv_heads) + ") must divide H (" + std::to_string(heads) + ")");
  if (kind == "lrkv" && (rank < 0 || rank > head_dim))
    throw Error(what + ": r (" + std::to_string(rank) + ") must be in [0, d_h = " + std::to_string(head_dim) +
                "]; a residual rank above the head width adds cache without adding rank");
  if (kind == "lrkv") {
    const auto modes = model::lrkv_rope_modes();
    if (std::find(modes.begin(), modes.end(), rope) == modes.end())
      throw Error(what + ": rope '" + rope + "' is not one of expand, shared_rope, pair_aligned");
    if (rope == "pair_aligned" && rank % 2 != 0)
      throw Error(what + ": rope pair_aligned keeps whole RoPE planes (2 dims each), so r (" + std::to_string(rank) +
                  ") must be even");
  }
  if (kind == "mla" && (latent < 1 || rope_dim < 0))
    throw Error(what + ": needs d_c >= 1 and d_R >= 0");
  if ((kind == "gdn" || kind == "natsl") && (value_dim < 1 || conv < 1))
    throw Error(what + ": needs d_v >= 1 and conv >= 1");
  if (kind == "natsl") {
    if (attn_heads < 1 || attn_heads % heads != 0 || head_dim % (attn_heads / heads) != 0 ||
        value_dim % (attn_heads / heads) != 0)
      throw Error(what + ": HA (" + std::to_string(attn_heads) + ") must be a multiple of H (" + std::to_string(heads) +
                  ") that splits d_h and d_v evenly");
    if (!(softmax_fraction > 0 && softmax_fraction <= 1)) throw Error(what + ": the budget f must be in (0, 1]");
    if (block < 1) throw Error(what + ": the routing block C must be >= 1");
  }
}

std::string AttentionShape::describe() const {
  std::string s = kind + " H=" + std::to_string(heads);
  if (kind == "dense") s += " Hkv=" + std::to_string(kv_heads);
  s += " d_h=" + std::to_string(head_dim);
  if (kind == "lrkv") s += " r=" + std::to_string(rank) + " (" + rope + ")";
  if (kind == "mla") s += " d_c=" + std::to_string(latent) + " d_R=" + std::to_string(rope_dim);
  if (kind == "gdn" || kind == "natsl") s += " d_v=" + std::to_string(value_dim);
  if (kind == "natsl") {
    char f[32];
    std::snprintf(f, sizeof f, "%g", softmax_fraction);
    s += " HA=" + std::to_string(attn_heads) + " f<=" + f;
  }
  if (hidden > 0) s += " d=" + std::to_string(hidden);
  return s;
}

std::vector<std::pair<int, int>> AttentionShape::cache_rows() const {
  if (kind == "dense") return {{2 * kv_heads, head_dim}};
  if (kind == "lrkv") {  // K_s, V_s; the latents of all heads, [R_0 | .. | R_{H-1}], for K and for V
    std::vector<std::pair<int, int>> rows = {{2, head_dim}};
    if (rank > 0) rows.push_back({2, heads * rank});
    return rows;
  }
  if (kind == "gdn") return {};
  if (kind == "natsl") {  // per softmax head: a key row of K/GA and a value row of V/GA
    const int groups = attn_heads / heads;
    return {{attn_heads, head_dim / groups}, {attn_heads, value_dim / groups}};
  }
  return {{1, latent + rope_dim}};  // mla: one row [c | k_R] per token
}

double AttentionShape::cache_elements() const {
  double n = 0;
  for (auto [count, width] : cache_rows()) n += static_cast<double>(count) * width;
  return kind == "natsl" ? softmax_fraction * n : n;
}

double AttentionShape::mha_cache_elements() const {
  if (kind == "gdn" || kind == "natsl") return static_cast<double>(heads) * (head_dim + value_dim);
  return 2.0 * heads * head_dim;
}

double AttentionShape::cache_bytes(kernels::KVType type) const {
  double n = 0;
  for (auto [count, width] : cache_rows()) n += static_cast<double>(count) * kernels::row_bytes(type, width);
  return kind == "natsl" ? softmax_fraction * n : n;
}

bool AttentionShape::decodes_from(kernels::KVType type) const {
  if (kind == "lrkv" && rope == "expand" && type != kernels::KVType::F32) return false;
  if (type == kernels::KVType::Q8 || type == kernels::KVType::Q4)
    for (auto [count, width] : cache_rows())
      if (width % kernels::kQBlock != 0) return false;
  return true;
}

double AttentionShape::state_elements() const {
  if (kind != "gdn" && kind != "natsl") return 0;
  const double H = heads, K = head_dim, V = value_dim, tails = (conv - 1.0) * H * (2 * K + V);
  if (kind == "gdn") return H * K * V + tails;
  return 2 * H * K * V + H + tails + static_cast<double>(block) * hidden;  // natsl
}

double AttentionShape::mha_kv_params() const {
  if (kind == "gdn" || kind == "natsl") return static_cast<double>(hidden) * heads * (head_dim + value_dim);
  return 2.0 * heads * hidden * head_dim;
}

double AttentionShape::mixer_params() const {
  const double d = hidden, H = heads, dh = head_dim;
  if (kind == "gdn" || kind == "natsl") {
    const double K = head_dim, V = value_dim;
    // q, k, v, a, b, gate (g_proj), o projections; q/k/v convolutions; A_log, dt_bias; output norm(s)
    double p = d * H * (2 * K + V) + 2 * d * H + d * H * V + H * V * d + conv * H * (2 * K + V) + 2 * H;
    if (kind == "gdn") return p + V;
    const double groups = attn_heads / heads;
    // o_w (H K -> 2 HA), router (d -> 2 H), q/k RMSNorm (K/GA), the two branch RMSNorms (V/GA)
    return p + H * K * 2 * attn_heads + d * 2 * H + 2 * K / groups + 2 * V / groups;
  }
  const double q_width = kind == "mla" ? H * (dh + rope_dim) : H * dh;
  return d * q_width + kv_params() + H * dh * d + (qk_norm ? 2 * dh : 0);  // qk_norm: one d_h RMSNorm weight each for q, k
}

double AttentionShape::kv_params() const {
  const double d = hidden, H = heads, dh = head_dim;
  if (kind == "dense") return 2.0 * d * kv_heads * dh;
  if (kind == "lrkv") {
    double p = 2.0 * d * dh + 2.0 * H * rank * (d + dh);
    if (rope == "pair_aligned") p -= H * rank * dh;  // B_h^K is a fixed plane selection
    return p;
  }
  if (kind == "gdn" || kind == "natsl") return d * H * (dh + value_dim);
  return d * (latent + rope_dim) + 2.0 * H * latent * dh;
}

}  // namespace kvx::attention
