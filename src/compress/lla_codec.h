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
#include "compress/lla_shape.h"
#include "model/config.h"
#include "model/transformer.h"
#include "train/trainer.h"

namespace kvx::compress {

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
  // On-policy: each training window keeps its first half and continues it with the student's own
  // samples (decoding through the current codes, temperature 1; no gradient through sampling).
  bool on_policy = false;
  // Ablations: "random" replaces the SVD bases by random orthonormal ones (mu still the mean);
  // attention_weight scales the attention-output term (0: KL only).
  std::string init = "svd";
  double attention_weight = 1.0;
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
