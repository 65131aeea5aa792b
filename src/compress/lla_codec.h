// LLA, the cross-loop latent KV codec of a looped transformer (SPEC 1.3; seed 002).
//
// Per dense layer, separately for keys (pre-RoPE) and values, the K/V a token produces in each of
// the T loops are stacked, x = [x_1; ...; x_T], and coded
//   c = (x - mu) W_down   (r),        x^_t = c W_up,t^T + mu_t   (loop t's reconstruction),
// with one codec per KV head (variant "head": x has T d_h entries) or one per layer across its KV
// heads (variant "2d", LLA-2D: T Hkv d_h entries). Ranks r_k for keys and r_v for values;
// compression rho = 2 T d_h Hkv / (Hkv-codes x (r_k + r_v)), e.g. head variant 2 T d_h / (r_k + r_v).
//
// Initialisation (fit_svd; head and 2d): per codec, the top-r right singular vectors of the centred stacked
// activations captured from the teacher, W_down = W_up = V_r, so x^ is the rank-r projection of
// x - mu (the best rank-r reconstruction in squared error). Distillation against the teacher
// refines W_down, W_up and mu afterwards (not here yet).
//
// Files: <dir>/lla_codec.safetensors (per layer "layers.<l>.{k,v}.{mu,down,up}") and
// <dir>/lla_codec.json (variant, ranks, the teacher's shape), checked against the teacher on load.
#pragma once
#include <torch/torch.h>

#include <array>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "attention/lla.h"
#include "model/config.h"
#include "model/transformer.h"
#include "train/trainer.h"

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

// Ranks for a compression budget ("4x" or "4"): r_k + r_v = 2 width / budget, split 3:5 so values
// get more (the seed's Ouro-1.4B example: 96 + 160 at 4x).
std::pair<int, int> ranks_for_budget(const std::string& budget, const std::string& variant, const model::ModelConfig& teacher);

using attention::LlaCodecPart;  // mu [G, W], down [G, W, r], up [G, W, r]

struct LlaCodec {
  LlaShape shape;
  std::vector<LlaCodecPart> keys, values;  // per layer

  // What decode reads (CacheOptions::lla): history stored as codes, reconstructed per loop.
  std::shared_ptr<const attention::LlaCodecSet> decode_set() const;

  // Per layer, stacked K and V [N, G, W] (N tokens) -> the SVD-initialised codec.
  static LlaCodec fit_svd(const LlaShape& shape, const std::vector<torch::Tensor>& stacked_keys,
                          const std::vector<torch::Tensor>& stacked_values);
  void save(const std::string& dir) const;
  static LlaCodec load(const std::string& dir, const model::ModelConfig& teacher);
};

// Pre-RoPE keys and values of every (loop, layer) of a looped dense teacher on token windows,
// stacked across loops for the codec: per layer [N, G, W] with N = batch x tokens.
struct StackedKV {
  std::vector<torch::Tensor> keys, values;
};
StackedKV capture_stacked_kv(model::Transformer& teacher, const std::vector<torch::Tensor>& windows, const std::string& variant);

// `kvx fit lla`: capture the teacher's K/V on calibration text (its own tokenizer and corpora),
// fit the codec by SVD, save it, and measure on held-out windows, decoding one token per step
// through the codes: CE, KL(teacher || student) and top-1 agreement, per-layer reconstruction
// error, persistent bytes per token. Writes <out>/lla_codec.{json,safetensors} and <out>/report.json.
struct FitLlaRun {
  std::string teacher, out, data_dir;
  std::vector<std::string> sources{"brown", "kjv"};
  std::string variant = "head";
  int rank_k = 0, rank_v = 0;  // or a budget
  std::string budget;          // e.g. "4x"
  int calibration_tokens = 8192;
  // Distillation after the SVD init: the teacher frozen, only the codec trained with
  // KL(teacher || student) + 0.5 / (T D) sum_(t,d) ||a_t,d - a^_t,d||^2 (attention outputs), the
  // student reading history reconstructed from codes of the teacher's K/V (off-policy); the
  // held-out-KL best of the evaluations is kept.
  int distill_steps = 0;
  double distill_lr = 1e-3;
  int distill_batch = 4;
  int distill_evals = 4;  // held-out evaluations during distillation
  int eval_windows = 16;
  int seq_len = 0;  // 0: min(128, the teacher's context)
  bool verbose = true;
  const train::TrainingData* data = nullptr;  // given (tests): used instead of the corpora
};
nlohmann::json fit_lla_run(const FitLlaRun& run);

// One distillation loss (and its parts) for the codec on token windows ids [B, n]; differentiable
// in the codec's tensors. Returns {total, kl, attention mse}.
std::array<torch::Tensor, 3> lla_distillation_loss(model::Transformer& teacher, const LlaCodec& codec, const torch::Tensor& ids);

// Relative squared reconstruction error ||x - x^||^2 / ||x - mu||^2 per layer, for keys and values.
std::vector<std::pair<double, double>> reconstruction_error(const LlaCodec& codec, const StackedKV& kv);

}  // namespace kvx::compress
