// NAtS-L (SPEC 1.2; seed 001): per 64-token block and head group, a router decides whether the
// block's KV stays as explicit softmax memory or is written into the Gated DeltaNet state.
//
// Layer (x pre-normed, [B, T, d]); H GDN heads of widths K, V; HA = GA H softmax heads of widths
// KA = K/GA, VA = V/GA (softmax head GA j + i is the i-th channel slice of GDN head j):
//   q, k, v = silu(conv4(W x))                          shared by both branches (GdnLayerBase)
//   w       = softmax(mix_proj(q).view(HA, 2))          [..., 0] weights the GDN output, [..., 1] the softmax one
//   o_attn  = routed softmax attention(RMSNorm(q_a), RMSNorm(k_a), v_a), scale KA^-1/2, RoPE optional
//   o_gdn   = routed GDN(l2(q), l2(k), v, g, beta)
//   out     = o_proj((gdn_norm(o_gdn as [HA, VA]) w0 + attn_norm(o_attn) w1) * silu(g_proj x))
// Router: logits = router(mean of the block's x).view(H, 2), type = argmax softmax (0 softmax,
// 1 GDN), the last (possibly partial) block forced to GDN; optional budget (at most a fraction f of
// a head group's blocks so far, and at most a count, routed to softmax, greedy in block order).
//
// Softmax branch: query t sees key s <= t iff same block or block(s) was routed to softmax.
// GDN branch: every token's output includes its own block's writes; when block b ends, the
// committed state is S_end (routed to GDN: keep the writes) or exp(G_b) S_commit (softmax: no
// writes, the decay keeps running). Both are written with the route as a multiplier m in {0, 1},
//   P = M e^A / sum M e^A (M_ts = m for earlier blocks),  S_commit' = D + m (S_end - D), D = exp(G_b) S_commit,
// so autograd's derivative by m is the paper's router signal for the chosen op:
//   softmax-routed: sum over the group's heads, queries i after b, keys s in b of P_is dO_i.(v_s - O_i)
//   GDN-routed:     < dL/dS_commit', S_end - D > = < dL/dS_commit', sum_t exp(G_end - G_t) k_t u_t^T >
// The sparse rule (default) keeps only the chosen op's signal; dense passes both (straight-through).
//
// Decode commits after the block (seed 001 Sec. 4.1): while a block is incomplete both branches
// run (its KV appended, a running GDN state with its writes and the running sum of g); when the
// block's last token arrives it is routed from its mean-pooled inputs, its KV dropped for head
// groups routed to GDN, and the committed state set as above.
#pragma once
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "attention/gdn.h"
#include "attention/mixer.h"

namespace kvx::attention {

// The KV budget (beyond the paper): per head group, at most floor(fraction x blocks so far) and at
// most max_blocks (0: no cap) blocks routed to softmax; the count cap bounds the KV memory.
struct KvBudget {
  double fraction = 1.0;
  int64_t max_blocks = 0;
};

// One-hot routes chosen from router probabilities [B, NB, H, 2] (index 0 softmax, 1 GDN): argmax,
// then the budget in block order (softmax_counts [B, H] int64 in/out: blocks routed to softmax so
// far; blocks_before: blocks routed before these), then, if last_forced, the last block to GDN.
torch::Tensor choose_routes(const torch::Tensor& probs, const KvBudget& budget, torch::Tensor& softmax_counts,
                            int64_t blocks_before, bool last_forced);

// The routes as a differentiable function of the router probabilities: the value is `chosen`
// (one-hot); the gradient passed to probs is the incoming one, only at the chosen op if sparse.
torch::Tensor route_select(const torch::Tensor& probs, const torch::Tensor& chosen, bool sparse);

// Block-routed softmax attention, all blocks at once. q, k [B, HA, T, KA], v [B, HA, T, VA];
// keep [B, NB, H] (1: block routed to softmax for GDN head group j = heads GA j .. GA j + GA - 1).
torch::Tensor routed_softmax_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& keep, int64_t block, double scale);

// Routed GDN, inputs as gdn_recurrent; commit [B, NB, H] (1: block routed to GDN). Block-parallel
// (each block in the chunked form from the committed state) and the token-recurrent reference.
// Return (o [B, H, T, V], the committed state after the last block).
std::pair<torch::Tensor, torch::Tensor> gdn_routed_blocks(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, const torch::Tensor& g,
                                                          const torch::Tensor& beta, const torch::Tensor& commit,
                                                          int64_t block, double scale);
std::pair<torch::Tensor, torch::Tensor> gdn_routed_recurrent(const torch::Tensor& q, const torch::Tensor& k,
                                                             const torch::Tensor& v, const torch::Tensor& g,
                                                             const torch::Tensor& beta, const torch::Tensor& commit,
                                                             int64_t block, double scale);

// The decode cache. Constant part: conv tails, committed and running GDN states, running sum of g,
// the current block's inputs. Growing part: per batch row and head group, the keys/values of the
// blocks routed to softmax plus the current block's: torch buffers (reference path, f32) or, on
// the fused path when KA == VA, one kernels::KVStore per (row, group) with GA KV heads in the
// cache element type, read by kernels::decode_attention.
class NatslCache : public MixerCache {
 public:
  NatslCache(int64_t batch, const AttentionShape& shape, int64_t hidden, const CacheOptions& options);
  int64_t length() const override { return length_; }
  int64_t bytes() const override;  // kv_bytes() + the constant part
  double bytes_per_token() const override;  // KV bytes of one token kept in every head group
  void clear() override;
  // Random history for decode benchmarks: complete blocks kept in each head group at the fraction
  // options.history_softmax_fraction (< 0: the layer's budget), evenly spread.
  void append_random_history(int64_t tokens, uint32_t seed) override;
  int64_t kv_bytes() const;  // the keys and values held
  int64_t kv_tokens(int64_t b, int64_t group) const;
  void drop_newest(int64_t b, int64_t group, int64_t tokens);

  ConvTails tails;
  torch::Tensor committed, running;  // GDN states [B, H, K, V]
  torch::Tensor g_sum;               // [B, H], sum of g over the current block
  std::vector<torch::Tensor> block_inputs;  // the current block's x, [B, n, d] pieces
  int64_t block_filled = 0;
  // [b][group]: [1, GA, tokens, KA] post-RoPE keys and [1, GA, tokens, VA] values.
  std::vector<std::vector<SequenceBuffer>> keys, values;
  std::vector<std::vector<kernels::KVStore>> stores;  // fused: [b][group]
  torch::Tensor softmax_counts;           // [B, H] int64, blocks routed to softmax
  std::vector<torch::Tensor> routes;      // per completed block, [B, H] int64 (0 softmax, 1 GDN)
  int64_t length_ = 0;
  bool fused;     // GDN steps through kernels::gdn_decode_step
  bool fused_kv;  // softmax branch through kernels::decode_attention over `stores`
  int threads;

 private:
  int64_t batch_, hidden_;
  AttentionShape shape_;
  CacheOptions options_;
};

class NatslAttention : public GdnLayerBase {
 public:
  NatslAttention(const model::ModelConfig& config, int layer);
  torch::Tensor forward(const torch::Tensor& x) override;
  std::unique_ptr<MixerCache> new_cache(int64_t batch, const CacheOptions& options) const override;
  torch::Tensor step(const torch::Tensor& x, MixerCache& cache) override;

  // The routes of the last forward, [B, NB, H] (0 softmax, 1 GDN), for the routing statistics.
  const torch::Tensor& last_routes() const { return last_routes_; }

  nn::Linear mix_proj{nullptr}, router{nullptr};
  nn::RMSNorm q_norm{nullptr}, k_norm{nullptr}, gdn_norm{nullptr}, attn_norm{nullptr};

 private:
  // Per-head-group router probabilities [B, NB, H, 2] from pooled block inputs [B, NB, d].
  torch::Tensor router_probs(const torch::Tensor& pooled);
  // The softmax branch's q, k, v [B, HA, n, w] from the shared inputs at positions start..
  void softmax_inputs(const GdnInputs& in, int64_t start, torch::Tensor& qa, torch::Tensor& ka, torch::Tensor& va);
  // The output from both branches: o_gdn [B, H, n, V], o_attn [B, HA, n, VA].
  torch::Tensor combine(const torch::Tensor& o_gdn, const torch::Tensor& o_attn, const GdnInputs& in, const torch::Tensor& x);
  // A piece of the input that lies inside one block (decode).
  torch::Tensor step_within_block(const torch::Tensor& x, NatslCache& cache);
  void commit_block(NatslCache& cache);
  // The softmax branch on the fused path: per token, append to the group's store, then attend.
  torch::Tensor softmax_branch_fused(const torch::Tensor& qa, const torch::Tensor& ka, const torch::Tensor& va,
                                     NatslCache& cache, double scale);
  int64_t attn_heads_, groups_, block_;
  bool rope_enabled_, sparse_router_grad_;
  KvBudget budget_;
  nn::Rope rope_;
  torch::Tensor last_routes_;
};

}  // namespace kvx::attention
