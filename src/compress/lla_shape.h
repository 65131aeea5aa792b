// The shape of an LLA codec (SPEC 1.3): variant, the teacher's loops/layers/KV heads/head width,
// and the key and value ranks; lla_codec.json. Torch-free (fuzzed with the other config files).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "model/config.h"

namespace kvx::compress {

// Variants: head (a code per KV head), 2d (LLA-2D, one code across a layer's heads), and two
// baselines in the same format at a matched persistent budget: final_loop (store only loop T's
// K/V and reuse them for every loop: r = d_h per head, a fixed selection, compression T) and
// loop_head (MLA-style head codec: one code per loop across the heads, no sharing across loops;
// block-diagonal, ranks multiples of T).
struct LlaShape {
  std::string variant = "head";  // head | 2d | final_loop | loop_head
  int loops = 1, layers = 0, kv_heads = 0, head_dim = 0;
  int rank_k = 0, rank_v = 0;
  bool across_heads() const { return variant == "2d" || variant == "loop_head"; }
  int groups() const { return across_heads() ? 1 : kv_heads; }                      // codes per token and layer
  int width() const { return loops * head_dim * (across_heads() ? kv_heads : 1); }  // entries of one stacked x
  double compression() const { return 2.0 * width() / (rank_k + rank_v); }
  // Persistent bytes per token (f32 codes, all layers) vs the teacher's T layers of full K/V.
  double bytes_per_token() const { return 4.0 * layers * groups() * (rank_k + rank_v); }
  double teacher_bytes_per_token() const { return 4.0 * layers * 2.0 * loops * kv_heads * head_dim; }
  void validate() const;  // ranks in [1, width()], a known variant
  nlohmann::json to_json() const;
  static LlaShape from_json(const nlohmann::json& j);
  // The teacher's shape (every layer dense) with these ranks; errors name what does not fit.
  static LlaShape of_teacher(const model::ModelConfig& teacher, const std::string& variant, int rank_k, int rank_v);
};

// A compression budget's number as written, without its optional x ("4x", "4X", "4" -> "4").
std::string budget_number(const std::string& budget);

// Ranks for a compression budget ("4x" or "4"): r_k + r_v = 2 width / budget, split 3:5 so values
// get more (the seed's Ouro-1.4B example: 96 + 160 at 4x).
std::pair<int, int> ranks_for_budget(const std::string& budget, const std::string& variant, const model::ModelConfig& teacher);

}  // namespace kvx::compress
