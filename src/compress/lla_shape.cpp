#include "compress/lla_shape.h"

#include <algorithm>
#include <cmath>

#include "io/json_config.h"
#include "util/error.h"
#include "util/strings.h"

namespace kvx::compress {

namespace {

std::string str(int v) { return std::to_string(v); }

}  // namespace

void LlaShape::validate() const {
  if (variant != "head" && variant != "2d" && variant != "final_loop" && variant != "loop_head")
    throw Error("LLA codec: variant '" + variant + "' is not one of head (a code per KV head), 2d (one code across a layer's heads), "
                "final_loop (baseline: loop T's K/V for every loop), loop_head (baseline: a code per loop across heads)");
  if (loops < 1 || loops > 64 || layers < 1 || layers > 65536 || kv_heads < 1 || kv_heads > 65536 || head_dim < 1 ||
      head_dim > 65536)
    throw Error("LLA codec: the teacher's loops (1..64), layers, KV heads and head width (1..65536) are out of range");
  if (variant == "final_loop" && (rank_k != head_dim || rank_v != head_dim))
    throw Error("LLA codec: final_loop keeps loop T's K/V whole, so its ranks are d_h = " + str(head_dim) + " (got " + str(rank_k) +
                ", " + str(rank_v) + ")");
  if (variant == "loop_head" && (rank_k % loops != 0 || rank_v % loops != 0))
    throw Error("LLA codec: loop_head codes each of the " + str(loops) + " loops separately, so r_k and r_v must be multiples of " +
                str(loops) + " (got " + str(rank_k) + ", " + str(rank_v) + ")");
  const int64_t stacked = static_cast<int64_t>(loops) * head_dim * (across_heads() ? kv_heads : 1);
  if (stacked > (int64_t{1} << 24))
    throw Error("LLA codec: the stacked width " + std::to_string(stacked) + " is too large (at most 2^24 entries per code)");
  for (auto [name, r] : {std::pair<const char*, int>{"r_k", rank_k}, {"r_v", rank_v}})
    if (r < 1 || r > width())
      throw Error(std::string("LLA codec: ") + name + " = " + str(r) + " must be in [1, " + str(width()) + "] (the stacked width " +
                  (across_heads() ? "T Hkv d_h" : "T d_h") + " = " + str(width()) + "; a larger rank cannot add information)");
}

nlohmann::json LlaShape::to_json() const {
  return {{"variant", variant}, {"loops", loops},   {"layers", layers},
          {"kv_heads", kv_heads}, {"head_dim", head_dim}, {"rank_k", rank_k}, {"rank_v", rank_v}};
}

LlaShape LlaShape::from_json(const nlohmann::json& j) {
  io::JsonReader r(j, "LLA codec config");
  LlaShape s;
  s.variant = r.require<std::string>("variant");
  s.loops = r.require<int>("loops");
  s.layers = r.require<int>("layers");
  s.kv_heads = r.require<int>("kv_heads");
  s.head_dim = r.require<int>("head_dim");
  s.rank_k = r.require<int>("rank_k");
  s.rank_v = r.require<int>("rank_v");
  r.finish();
  s.validate();
  return s;
}

LlaShape LlaShape::of_teacher(const model::ModelConfig& t, const std::string& variant, int rank_k, int rank_v) {
  for (const auto& kind : t.layer_kinds())
    if (kind != "dense")
      throw Error("LLA codec: the teacher has a '" + kind + "' layer; the codec compresses dense (MHA/GQA/MQA) K/V only");
  if (t.loops < 2)
    throw Error("LLA codec: the teacher is not looped (loops = " + str(t.loops) +
                "); the codec shares a code across loops, train a looped model (e.g. --preset tiny-looped)");
  LlaShape s;
  s.variant = variant;
  s.loops = t.loops;
  s.layers = t.num_hidden_layers;
  s.kv_heads = t.num_key_value_heads;
  s.head_dim = t.head_dim;
  s.rank_k = rank_k;
  s.rank_v = rank_v;
  s.validate();
  return s;
}

std::string budget_number(const std::string& budget) {
  std::string b = budget;
  if (!b.empty() && (b.back() == 'x' || b.back() == 'X')) b.pop_back();
  return b;
}

std::pair<int, int> ranks_for_budget(const std::string& budget, const std::string& variant, const model::ModelConfig& teacher) {
  const std::string b = budget_number(budget);
  const double rho = whole_number(b).value_or(0);
  if (!(rho >= 1)) throw Error("--budget '" + budget + "' is not a compression factor >= 1 (write e.g. 4x)");
  if (variant == "final_loop") throw Error("--budget does not apply to final_loop (its compression is the loop count)");
  const LlaShape full = LlaShape::of_teacher(teacher, variant == "loop_head" ? "2d" : variant, 1, 1);  // its stacked width
  const int total = static_cast<int>(std::lround(2.0 * full.width() / rho));
  if (total < 2) throw Error("--budget " + budget + " leaves fewer than one dimension each for keys and values");
  int rank_v = std::min(full.width(), std::max(1, static_cast<int>(std::lround(total * 5.0 / 8.0))));
  int rank_k = std::min(full.width(), std::max(1, total - rank_v));
  if (variant == "loop_head") {  // whole ranks per loop
    const int T = teacher.loops;
    rank_v = std::max(T, rank_v / T * T);
    rank_k = std::max(T, (total - rank_v) / T * T);
  }
  return {rank_k, rank_v};
}

}  // namespace kvx::compress
