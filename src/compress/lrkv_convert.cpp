#include "compress/lrkv_convert.h"

#include <cmath>
#include <cstdio>

#include <iostream>

#include "attention/cost.h"
#include "attention/dense.h"
#include "attention/lrkv.h"
#include "eval/evaluate.h"
#include "io/atomic_file.h"
#include "text/corpus.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/strings.h"

namespace kvx::compress {

namespace {

// W: [H, d_h, d] per query head (Linear layout). Sets shared [d_h, d] and, for rank r, down
// [H r, d] (rows: U_h^T) and up [H, r, d_h] (B_h^T) so that W_h ~ W_s + (U_h B_h^T)^T.
void factor(const torch::Tensor& W, int64_t r, torch::Tensor& shared, torch::Tensor& down, torch::Tensor& up) {
  const int64_t H = W.size(0), dh = W.size(1), d = W.size(2);
  auto W64 = W.to(torch::kFloat64);
  auto Ws = W64.mean(0);
  shared = Ws;
  if (r == 0) return;
  down = torch::zeros({H * r, d}, torch::kFloat64);
  up = torch::zeros({H, r, dh}, torch::kFloat64);
  for (int64_t h = 0; h < H; ++h) {
    auto Dt = (W64[h] - Ws).t();  // [d, d_h] = U_h B_h^T
    auto svd = torch::linalg::svd(Dt, false, c10::nullopt);
    auto P = std::get<0>(svd).narrow(1, 0, r), S = std::get<1>(svd).narrow(0, 0, r), Q = std::get<2>(svd).narrow(0, 0, r).t();
    auto root = S.sqrt();
    down.narrow(0, h * r, r).copy_((P * root).t());  // U_h^T
    up[h].copy_((Q * root).t());                     // B_h^T
  }
}

}  // namespace

model::ModelConfig lrkv_config_for(const model::ModelConfig& dense, const LrkvConversion& o) {
  model::ModelConfig c = dense;
  if (c.qk_norm)
    throw Error("convert lrkv: the model normalises each head's keys (qk_norm, as Qwen3), which LRKV's shared keys do not; "
                "only models without qk_norm can be converted");
  const auto kinds = c.layer_kinds();
  std::string layout;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] != "dense" && kinds[i] != "lrkv")
      throw Error("convert lrkv: layer " + std::to_string(i) + " is '" + kinds[i] + "'; only dense layers can be converted");
    layout += (i ? ",lrkv" : "lrkv");
  }
  c.layout = layout;
  c.lrkv_rank = o.rank;
  c.lrkv_rope = o.rope;
  c.validate();  // rank within [0, d_h], even for pair_aligned, known mode
  return c;
}

std::string cache_growth_warning(const model::ModelConfig& source, const model::ModelConfig& lrkv) {
  auto elements = [](const model::ModelConfig& c) {
    double e = 0;
    for (const auto& kind : c.layer_kinds()) e += attention::AttentionShape::of_layer(c, kind).cache_elements();
    return e;
  };
  const double before = elements(source), after = elements(lrkv);
  if (after <= before) return "";
  // A GQA layer caches 2 Hkv d_h a token, LRKV 2 (d_h + H r): smaller while r <= (Hkv - 1) d_h / H.
  const int H = source.num_attention_heads, hkv = source.num_key_value_heads, dh = source.head_dim;
  const int break_even = (hkv - 1) * dh / H;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * after / before);
  return std::string("LRKV at rank ") + std::to_string(lrkv.lrkv_rank) + " caches " + buf + " of the source's KV (" +
         std::to_string(H) + " query heads on " + std::to_string(hkv) + " KV heads: its heads of a group get identical " +
         "residuals); " + (break_even >= 1 ? "ranks up to " + std::to_string(break_even) + " keep it no larger"
                                           : std::string("only rank 0 (one shared K/V, as the source has) keeps it no larger"));
}

model::Transformer convert_to_lrkv(const model::Transformer& dense, const LrkvConversion& o) {
  torch::NoGradGuard ng;
  const model::ModelConfig c = lrkv_config_for(dense->config(), o);
  const auto kinds = dense->config().layer_kinds();
  model::Transformer out(c);
  // Shared names (embeddings, norms, MLPs, q_proj, o_proj) copy over; the K/V projections are factored.
  const auto src = dense->state_dict_hf();
  for (auto& p : out->named_parameters()) {
    const std::string name = "model." + p.key();
    auto it = src.find(name);
    if (it != src.end() && it->second.sizes() == p.value().sizes()) p.value().copy_(it->second);
    else if (p.key() == "lm_head.weight" && src.count("lm_head.weight")) p.value().copy_(src.at("lm_head.weight"));
  }
  const int64_t H = c.num_attention_heads, dh = c.head_dim, r = o.rank;
  const auto& src_layers = *dense->layers;
  const auto& dst_layers = *out->layers;
  for (size_t i = 0; i < kinds.size(); ++i) {
    auto* to = dynamic_cast<attention::LrkvAttention*>(dst_layers[i]->as<model::BlockImpl>()->self_attn.get());
    if (kinds[i] == "lrkv") {  // already LRKV: copy as is
      auto* from = dynamic_cast<attention::LrkvAttention*>(src_layers[i]->as<model::BlockImpl>()->self_attn.get());
      if (from->rank() != r || from->rope_mode() != to->rope_mode())
        throw Error("convert lrkv: layer " + std::to_string(i) + " is LRKV with another rank or RoPE mode");
      continue;
    }
    auto* from = dynamic_cast<attention::DenseAttention*>(src_layers[i]->as<model::BlockImpl>()->self_attn.get());
    const int64_t hkv = c.num_key_value_heads, d = c.hidden_size;
    // Per query head: [H, d_h, d] (GQA heads share their KV head's projection).
    auto per_head = [&](const torch::Tensor& w) { return w.view({hkv, dh, d}).repeat_interleave(H / hkv, 0); };
    const bool pair = to->rope_mode() == attention::LrkvRope::PairAligned;
    torch::Tensor ks, kd, ku, vs, vd, vu;
    factor(per_head(from->k_proj->weight), pair ? 0 : r, ks, kd, ku);  // pair_aligned: only the mean (B_h^K is fixed)
    factor(per_head(from->v_proj->weight), r, vs, vd, vu);
    to->k_shared_proj->weight.copy_(ks);
    to->v_shared_proj->weight.copy_(vs);
    if (r > 0) {
      to->v_down_proj->weight.copy_(vd);
      to->v_up.copy_(vu);
      if (pair) {
        // B_h^K fixed: U_h^T = D_h's rows on the selected dims, in the latent's order.
        auto W = per_head(from->k_proj->weight).to(torch::kFloat64);
        for (int64_t h = 0; h < H; ++h) {
          auto D = W[h] - ks;                                   // [d_h, d]
          auto sel = to->k_up[h].to(torch::kFloat64);           // [r, d_h] 0/1
          to->k_down_proj->weight.narrow(0, h * r, r).copy_(torch::matmul(sel, D));
        }
      } else {
        to->k_down_proj->weight.copy_(kd);
        to->k_up.copy_(ku);
      }
    }
  }
  return out;
}

nlohmann::json convert_lrkv_run(const ConvertRun& run) {
  if (run.out.empty()) throw Error("convert lrkv: give an output directory (--out)");
  if (run.heal_steps < 0) throw Error("convert lrkv: --heal-steps must be >= 0 (0: no healing), got " + std::to_string(run.heal_steps));
  if (run.heal_steps > 0 && !(std::isfinite(run.heal_lr) && run.heal_lr > 0))
    throw Error("convert lrkv: --heal-lr must be a positive number, got " + format_number(run.heal_lr));
  auto source = train::load_model(run.from);
  const auto& src_cfg = source.model->config();
  const model::ModelConfig lrkv_cfg = lrkv_config_for(src_cfg, run.conversion);  // rank and RoPE mode checked before the data
  const std::string warning = cache_growth_warning(src_cfg, lrkv_cfg);
  if (!warning.empty() && run.verbose) std::cerr << "warning: " << warning << "\n";
  const std::string data_dir = run.data_dir.empty() ? text::default_data_dir() : run.data_dir;
  const int seq_len = run.seq_len > 0 ? run.seq_len : std::min(256, src_cfg.max_position_embeddings);
  if (seq_len > src_cfg.max_position_embeddings)
    throw Error("convert lrkv: --seq-len " + std::to_string(seq_len) + " exceeds the model's context limit of " +
                std::to_string(src_cfg.max_position_embeddings));
  // The source's own tokenizer and corpora, so the CE numbers are comparable.
  const train::TrainingData data = run.data ? *run.data : train::training_data_for(source.tokenizer, data_dir, run.sources);
  const int windows = std::max(1, std::min<int>(run.eval_windows, static_cast<int>((data.validation.tokens.size() - 1) / seq_len)));
  const auto batches = train::evaluation_batches(data.validation.tokens, windows, 8, seq_len);
  auto quality = [&](model::Transformer& m) { return eval::evaluate_lm(m, batches, data.tokenizer); };

  const auto before = quality(source.model);
  auto converted = convert_to_lrkv(source.model, run.conversion);
  const auto after = quality(converted);
  const std::string converted_dir = run.out + "/converted";
  io::make_dirs(run.out);
  train::save_model_dir(converted_dir, converted, data.tokenizer);
  if (run.verbose)
    std::cerr << "convert lrkv: rank " << run.conversion.rank << " (" << run.conversion.rope << "): validation CE "
              << before.cross_entropy << " -> " << after.cross_entropy << "; healing for " << run.heal_steps << " steps\n";

  nlohmann::json healed_json = nullptr;
  if (run.heal_steps > 0) {
    train::TrainArgs args;
    args.config.name = "heal";
    args.config.model = converted->config();
    args.config.data.data_dir = data_dir;
    args.config.data.sources = run.sources;
    args.config.train.steps = run.heal_steps;
    args.config.train.lr = run.heal_lr;
    args.config.train.warmup = std::min(20, std::max(1, run.heal_steps / 10));
    args.config.train.seq_len = seq_len;
    args.config.train.eval_every = std::max(1, run.heal_steps / 2);
    args.config.train.checkpoint_every = std::max(1, run.heal_steps / 2);
    args.run_dir = run.out + "/heal";
    args.init_from = converted_dir;
    args.resume = !train::latest_checkpoint(args.run_dir).empty();  // an interrupted heal continues
    args.verbose = run.verbose;
    train::run_training(args, data);
    auto healed = train::load_model(args.run_dir);
    const auto h = quality(healed.model);
    healed_json = {{"cross_entropy", h.cross_entropy}, {"bits_per_byte", h.bits_per_byte}, {"model", healed.dir}};
  }
  auto q = [](const eval::LmQuality& x) { return nlohmann::json{{"cross_entropy", x.cross_entropy}, {"bits_per_byte", x.bits_per_byte}}; };
  nlohmann::json report = {{"from", source.dir},
                           {"rank", run.conversion.rank},
                           {"rope", run.conversion.rope},
                           {"validation_windows", windows},
                           {"seq_len", seq_len},
                           {"kv_bytes_per_token_before", source.model->kv_bytes_per_token()},
                           {"kv_bytes_per_token_after", converted->kv_bytes_per_token()},
                           {"warning", warning.empty() ? nlohmann::json(nullptr) : nlohmann::json(warning)},
                           {"before", q(before)},
                           {"converted", q(after)},
                           {"converted_model", converted_dir},
                           {"heal_steps", run.heal_steps},
                           {"healed", healed_json}};
  io::write_file_atomic(run.out + "/report.json", report.dump(2) + "\n");
  return report;
}

}  // namespace kvx::compress
