// Cache and parameter accounting per attention family, per layer (torch-free). The mixers'
// cache_bytes_per_token and `kvx cost` both use these formulas.
//
//   dense (MHA/GQA/MQA)  cache 2 Hkv d_h              K/V params 2 d Hkv d_h
//   lrkv  (SPEC 1.1)     cache 2 (d_h + H r)          K/V params 2 d d_h + 2 H r (d + d_h)
//                        (pair_aligned: B_h^K is a fixed plane selection, H r d_h fewer)
//   mla   (SPEC 2)       cache d_c + d_R              K/V params d (d_c + d_R) + 2 H d_c d_h
//   gdn   (SPEC 1.2)     cache 0; state H K V + (conv-1) H (2K + V) per sequence   K/V params d H (K + V)
//   natsl (SPEC 1.2)     cache f H (K + V) (the KV of softmax-routed blocks; f <= the budget
//                        fraction, data-dependent); state: committed and running GDN states,
//                        the sum of g, the tails and the current block's inputs   K/V params d H (K + V)
// (gdn/natsl: H GDN heads, K = d_h the key width, V the value width.)
// Ratios are to MHA with the same H and d_h: cache 2 H d_h, K/V params 2 H d d_h
// (LRKV: 1/H + r/d_h, seed 000 Eq. 9).
#pragma once
#include <string>
#include <vector>

#include "kernels/kv_format.h"
#include "model/config.h"

namespace kvx::attention {

struct AttentionShape {
  std::string kind = "dense";  // dense | lrkv | mla | gdn | natsl
  int hidden = 0;              // d (only the parameter counts need it)
  int heads = 0;               // H
  int kv_heads = 0;            // dense: Hkv (0: = H)
  int head_dim = 0;            // d_h
  int rank = 0;                // lrkv: r
  std::string rope = "expand"; // lrkv: RoPE mode
  int latent = 0;              // mla: d_c
  int rope_dim = 0;            // mla: d_R
  int value_dim = 0;           // gdn/natsl: V (d_h is the key width K)
  int conv = 4;                // gdn/natsl: short convolution kernel
  int attn_heads = 0;          // natsl: HA softmax heads (a multiple of H)
  double softmax_fraction = 1;  // natsl: the KV budget (at most this fraction of blocks kept)
  int block = 64;               // natsl: routing block
  bool qk_norm = false;         // dense: per-head q/k RMSNorm weights (Qwen3), in mixer_params

  // "kind:key=value,...": keys H, Hkv, d_h, d, r, rope, d_c, d_R, d_v, conv, HA, f, C; e.g.
  // "lrkv:H=18,r=55,d_h=128,d=2304", "mla:H=6,d_h=128,d_c=384,d_R=0", "gqa:H=32,Hkv=8,d_h=128"
  // (mha / gqa / mqa / dense are dense), "gdn:H=6,d_h=128,d_v=256", "natsl:H=6,HA=18,d_h=128,d_v=128,f=0.25".
  static AttentionShape parse(const std::string& spec);
  static AttentionShape of_layer(const model::ModelConfig& config, const std::string& kind);
  void validate() const;         // throws kvx::Error naming the bad field
  std::string describe() const;  // e.g. "lrkv H=18 d_h=128 r=55 (expand)"

  // Per token and layer (natsl: at the budget fraction).
  double cache_elements() const;
  double mha_cache_elements() const;  // gdn/natsl: H (K + V)
  // The cache's rows and their widths (natsl: if every block were kept), for exact bytes at a KV element type.
  std::vector<std::pair<int, int>> cache_rows() const;  // (count, width)
  double cache_bytes(kernels::KVType type) const;       // q8/q4: widths must be multiples of 32
  // Whether a decode cache of this type exists for the shape: q8/q4 need rows of whole 32-blocks;
  // LRKV rope expand decodes from f32 only (its keys are rebuilt per head at read time).
  bool decodes_from(kernels::KVType type) const;
  // Constant per-sequence state of the layer (gdn/natsl: the f32 GDN state and convolution tails).
  double state_elements() const;
  double state_bytes() const { return 4.0 * state_elements(); }
  double kv_params() const;                             // needs hidden
  double mha_kv_params() const;
  double mixer_params() const;  // every parameter of the layer's mixer (projections, norms, router); needs hidden
};

}  // namespace kvx::attention
