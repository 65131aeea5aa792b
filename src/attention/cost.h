// Cache and parameter accounting per attention family, per layer (torch-free). The mixers'
// cache_bytes_per_token and `kvx cost` both use these formulas.
//
//   dense (MHA/GQA/MQA)  cache 2 Hkv d_h              K/V params 2 d Hkv d_h
//   lrkv  (SPEC 1.1)     cache 2 (d_h + H r)          K/V params 2 d d_h + 2 H r (d + d_h)
//                        (pair_aligned: B_h^K is a fixed plane selection, H r d_h fewer)
//   mla   (SPEC 2)       cache d_c + d_R              K/V params d (d_c + d_R) + 2 H d_c d_h
// Ratios are to MHA with the same H and d_h: cache 2 H d_h, K/V params 2 H d d_h
// (LRKV: 1/H + r/d_h, seed 000 Eq. 9).
#pragma once
#include <string>
#include <vector>

#include "kernels/kv_format.h"
#include "model/config.h"

namespace kvx::attention {

struct AttentionShape {
  std::string kind = "dense";  // dense | lrkv | mla
  int hidden = 0;              // d (only the parameter counts need it)
  int heads = 0;               // H
  int kv_heads = 0;            // dense: Hkv (0: = H)
  int head_dim = 0;            // d_h
  int rank = 0;                // lrkv: r
  std::string rope = "expand"; // lrkv: RoPE mode
  int latent = 0;              // mla: d_c
  int rope_dim = 0;            // mla: d_R

  // "kind:key=value,...": keys H, Hkv, d_h, d, r, rope, d_c, d_R; e.g. "lrkv:H=18,r=55,d_h=128,d=2304",
  // "mla:H=6,d_h=128,d_c=384,d_R=0", "gqa:H=32,Hkv=8,d_h=128" (mha / gqa / mqa are dense).
  static AttentionShape parse(const std::string& spec);
  static AttentionShape of_layer(const model::ModelConfig& config, const std::string& kind);
  void validate() const;         // throws kvx::Error naming the bad field
  std::string describe() const;  // e.g. "lrkv H=18 d_h=128 r=55 (expand)"

  // Per token and layer.
  double cache_elements() const;
  double mha_cache_elements() const { return 2.0 * heads * head_dim; }
  // The cache's rows and their widths, for exact bytes at a KV element type.
  std::vector<std::pair<int, int>> cache_rows() const;  // (count, width)
  double cache_bytes(kernels::KVType type) const;       // q8/q4: widths must be multiples of 32
  double kv_params() const;                             // needs hidden
  double mha_kv_params() const { return 2.0 * heads * hidden * head_dim; }
};

}  // namespace kvx::attention
