// Nectar (SPEC 1.4; seed 003): a fixed document's attention, per layer and KV head, replaced by a
// small module. For a rotated query q placed after the document (keys k_j, values v_j, j < n):
//   alpha(q) = log sum_j e^{s_j}   (log mass),   A(q) = sum_j e^{s_j} v_j / sum_j e^{s_j}   (content),
//   s_j = q . k_j / sqrt(d_h)                                                   (seed Eq. 3.1)
// composed with exact attention over the local tokens (instruction and generated ones keep a
// normal cache) as one virtual logit/value pair:
//   ATT = (e^a A + N_loc) / (e^a + Z_loc)                                       (seed Eqs. 3.4-3.5)
// Query heads that share a KV head share its module; each query is evaluated separately.
//
// Modules (all KV heads of a layer batched, parameters [Hkv, ...]):
//  - MLP: h_{k+1} = SiLU(V_k q + U_k h_k + b_k), the query re-injected at every depth (seed Eq.
//    3.6); an optional shared backbone of depth D_b, then a score head (D_s layers, then a scalar)
//    and a target head (D_t layers, then a d_h-vector). The width is the largest that fits the budget.
//  - Quadrature: p learned pairs W, Z [p, d_h]; A = softmax(W q / sqrt d)^T Z, alpha =
//    logsumexp(W q / sqrt d) (analytic); initialised from the first p cached pairs.
// Budget: rho = |theta| / (2 n d_h) per layer and KV head (optionally scaled per layer group).
//
// Decode (CacheOptions::document): a dense layer's cache holds the local tokens only and its
// positions start at n; each read merges the module's pair into the fused kernel's log-sum-exp
// (kernels::VirtualPair) or, with `reference`, into the libtorch softmax.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/mixer.h"

namespace kvx::attention {

// A document's response to queries [B, H, T, d_h]: log mass [B, H, T] and content [B, H, T, d_h].
struct DocumentAttention {
  torch::Tensor log_mass, content;
};
using DocumentReader = std::function<DocumentAttention(const torch::Tensor& q)>;

// The exact response (seed Eq. 3.1) for rotated queries q [B, H, T, d_h] against a document's
// post-RoPE keys and values [B or 1, Hkv, n, d_h] (GQA: each KV head serves its query group).
DocumentAttention exact_document_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values);

// Causal attention over local keys/values [B, Hkv, Tk, d_h] (Tk may be 0, or the tensors
// undefined: no local tokens) for queries q [B, H, T, d_h] at local positions q_start + i, with
// the document's pair as one extra logit/value (seed Eqs. 3.4-3.5), in the max-shifted form.
torch::Tensor compose_document_attention(const torch::Tensor& q, const torch::Tensor& local_keys,
                                         const torch::Tensor& local_values, int64_t q_start, const DocumentAttention& doc);

struct NectarArch {
  std::string kind = "mlp";                                   // mlp | quadrature
  int backbone_depth = 1, score_depth = 1, target_depth = 2;  // (D_b, D_s, D_t), MLP only
  nlohmann::json to_json() const;
  static NectarArch from_json(const nlohmann::json& j);
  static NectarArch parse(const std::string& kind, const std::string& depths);  // depths "b,s,t" or ""
  void validate() const;
};

// One layer's modules, one per KV head, evaluated for every query head of its group.
class NectarLayer : public torch::nn::Module {
 public:
  virtual DocumentAttention forward(const torch::Tensor& q) = 0;  // q [B, H, T, d_h]
  int64_t parameters_per_head() const;                            // |theta| of one KV head's module
  int64_t size() const { return size_; }                          // MLP width or Quadrature pairs
 protected:
  NectarLayer(int heads, int kv_heads, int head_dim, int64_t size)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), size_(size) {}
  torch::Tensor by_kv_head(const torch::Tensor& q) const;                // [B, H, T, d] -> [Hkv, B G T, d]
  torch::Tensor by_query_head(const torch::Tensor& x, int64_t B, int64_t T) const;  // [Hkv, B G T, w] -> [B, H, T, w]
  int heads_, kv_heads_, head_dim_;
  int64_t size_;
};

class NectarMlp : public NectarLayer {
 public:
  NectarMlp(int heads, int kv_heads, int head_dim, const NectarArch& arch, int64_t width);
  DocumentAttention forward(const torch::Tensor& q) override;
  // Data-dependent initialisation from sample queries [N, H, d_h] and their targets (alpha [N, H],
  // A [N, H, d_h]): input weights scaled to unit pre-activations, output biases at the targets'
  // means, output weights small, so training starts at the mean response.
  void initialize(const torch::Tensor& q, const torch::Tensor& log_mass, const torch::Tensor& content);
  static int64_t parameter_count(const NectarArch& arch, int head_dim, int64_t width);
  // The largest width whose parameter count fits `budget`; throws naming the smallest budget when none does.
  static int64_t width_for_budget(const NectarArch& arch, int head_dim, double budget);

 private:
  struct Depth {
    torch::Tensor in, rec, bias;  // V_k [Hkv, w, d], U_k [Hkv, w, w] (undefined for the first), b_k [Hkv, w]
  };
  torch::Tensor run(const std::vector<Depth>& stack, const torch::Tensor& x, torch::Tensor h) const;
  std::vector<Depth> backbone_, score_, target_;
  torch::Tensor score_out_, score_bias_, target_out_, target_bias_;  // [Hkv, 1, w], [Hkv, 1], [Hkv, d, w], [Hkv, d]
};

class NectarQuadrature : public NectarLayer {
 public:
  NectarQuadrature(int heads, int kv_heads, int head_dim, int64_t pairs);
  DocumentAttention forward(const torch::Tensor& q) override;
  // W, Z = the first p cached pairs (post-RoPE keys and values [Hkv, n, d_h], n >= p).
  void initialize(const torch::Tensor& keys, const torch::Tensor& values);
  static int64_t pairs_for_budget(int head_dim, double budget);  // p = floor(budget / 2 d), >= 1

 private:
  torch::Tensor w_, z_;  // [Hkv, p, d_h]
};

// The exact document in a module's place (the full-document teacher): its cached post-RoPE keys
// and values [1, Hkv, n, d_h] of one layer. No parameters.
class ExactDocument : public NectarLayer {
 public:
  ExactDocument(int heads, const torch::Tensor& keys, const torch::Tensor& values);
  DocumentAttention forward(const torch::Tensor& q) override { return exact_document_attention(q, keys_, values_); }

 private:
  torch::Tensor keys_, values_;
};

// No document at all (the model without it, a lower bound on what a module should beat): zero
// mass (log mass -inf), so only the local tokens are read. Needs at least one local token.
class NoDocument : public NectarLayer {
 public:
  NoDocument(int heads, int kv_heads, int head_dim) : NectarLayer(heads, kv_heads, head_dim, 0) {}
  DocumentAttention forward(const torch::Tensor& q) override;
};

// What decode reads: every layer's module and the document length (positions of local tokens start there).
struct NectarDocument {
  int64_t tokens = 0;
  std::vector<std::shared_ptr<NectarLayer>> layers;
};

// A dense layer's decode cache after a document: local tokens only, positions from `offset`.
class NectarCache : public MixerCache {
 public:
  NectarCache(std::unique_ptr<MixerCache> local, std::shared_ptr<NectarLayer> module, int64_t offset)
      : local_(std::move(local)), module_(std::move(module)), offset_(offset) {}
  int64_t length() const override { return offset_ + local_->length(); }
  int64_t bytes() const override { return local_->bytes(); }  // the module's weights are static, counted apart
  double bytes_per_token() const override { return local_->bytes_per_token(); }
  void clear() override { local_->clear(); }
  MixerCache& local() { return *local_; }
  NectarLayer& module() { return *module_; }
  int64_t offset() const { return offset_; }

 private:
  std::unique_ptr<MixerCache> local_;
  std::shared_ptr<NectarLayer> module_;
  int64_t offset_;
};

}  // namespace kvx::attention
