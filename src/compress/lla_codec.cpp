#include "compress/lla_codec.h"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "attention/dense.h"
#include "io/atomic_file.h"
#include "io/json_config.h"
#include "nn/tensor_io.h"
#include "eval/evaluate.h"
#include "text/corpus.h"
#include "model/sampling.h"
#include "train/adamw.h"
#include "train/checkpoint.h"
#include "train/dataset.h"
#include "util/error.h"

namespace kvx::compress {

std::shared_ptr<const attention::LlaCodecSet> LlaCodec::decode_set() const {
  auto set = std::make_shared<attention::LlaCodecSet>();
  set->loops = shape.loops;
  set->kv_heads = shape.kv_heads;
  set->head_dim = shape.head_dim;
  set->two_d = shape.across_heads();
  for (size_t l = 0; l < keys.size(); ++l) set->layers.emplace_back(keys[l], values[l]);
  return set;
}

namespace {

LlaCodecPart svd_part(const torch::Tensor& x, int rank) {  // x [N, G, W]
  LlaCodecPart p;
  const auto xd = x.to(torch::kDouble);
  p.mu = xd.mean(0);  // [G, W]
  std::vector<torch::Tensor> bases;
  for (int64_t g = 0; g < xd.size(1); ++g) {
    const auto centred = xd.select(1, g) - p.mu[g];
    const auto svd = torch::linalg_svd(centred, /*full_matrices=*/false);
    const auto vh = std::get<2>(svd);  // [min(N, W), W]
    if (vh.size(0) < rank)
      throw Error("LLA codec: rank " + std::to_string(rank) + " needs at least that many captured tokens (got " + std::to_string(static_cast<int>(vh.size(0))) +
                  "); capture more calibration text");
    bases.push_back(vh.narrow(0, 0, rank).t());  // [W, r]
  }
  p.down = torch::stack(bases).to(torch::kFloat32);
  p.up = p.down.clone();
  p.mu = p.mu.to(torch::kFloat32);
  return p;
}

// final_loop: the code is loop T's vector (mu = 0); every loop reconstructs it.
LlaCodecPart final_loop_part(const LlaShape& shape) {
  const int64_t G = shape.groups(), T = shape.loops, d = shape.head_dim;
  auto down = torch::zeros({G, T * d, d}), up = torch::zeros({G, T * d, d});
  const auto eye = torch::eye(d);
  for (int64_t g = 0; g < G; ++g) {
    down[g].narrow(0, (T - 1) * d, d).copy_(eye);
    for (int64_t t = 0; t < T; ++t) up[g].narrow(0, t * d, d).copy_(eye);
  }
  return {torch::zeros({G, T * d}), down, up};
}

// loop_head: per loop, the SVD of that loop's vectors across the heads (the stacked layout is
// heads, then loops, then d_h), placed block-diagonally so loops share nothing.
LlaCodecPart loop_head_part(const LlaShape& shape, const torch::Tensor& x, int rank) {  // x [N, 1, Hkv T d_h]
  const int64_t T = shape.loops, H = shape.kv_heads, d = shape.head_dim, r = rank / T, N = x.size(0);
  const auto per_loop = x.to(torch::kDouble).reshape({N, H, T, d});
  auto down = torch::zeros({1, H * T * d, rank}, torch::kDouble), up = down.clone();
  auto mu = per_loop.mean(0);  // [H, T, d]
  for (int64_t t = 0; t < T; ++t) {
    const auto xt = per_loop.select(2, t).reshape({N, H * d}) - mu.select(1, t).reshape({H * d});
    const auto vh = std::get<2>(torch::linalg_svd(xt, false));
    if (vh.size(0) < r) throw Error("LLA codec: loop_head rank needs more captured tokens; capture more calibration text");
    const auto basis = vh.narrow(0, 0, r).t().reshape({H, d, r});  // rows of loop t, per head
    for (int64_t h = 0; h < H; ++h) down[0].narrow(0, (h * T + t) * d, d).narrow(1, t * r, r).copy_(basis[h]);
  }
  up.copy_(down);
  return {mu.reshape({1, H * T * d}).to(torch::kFloat32), down.to(torch::kFloat32), up.to(torch::kFloat32)};
}

}  // namespace

LlaCodec LlaCodec::fit_svd(const LlaShape& shape, const std::vector<torch::Tensor>& stacked_keys,
                           const std::vector<torch::Tensor>& stacked_values) {
  shape.validate();
  if (static_cast<int>(stacked_keys.size()) != shape.layers || stacked_values.size() != stacked_keys.size())
    throw Error("LLA codec: captured K/V for " + std::to_string(static_cast<int>(stacked_keys.size())) + " layers, the teacher has " +
                std::to_string(shape.layers));
  LlaCodec c;
  c.shape = shape;
  for (int l = 0; l < shape.layers; ++l) {
    for (const auto* x : {&stacked_keys[l], &stacked_values[l]})
      if (x->dim() != 3 || x->size(1) != shape.groups() || x->size(2) != shape.width())
        throw Error("LLA codec: layer " + std::to_string(l) + " captured [N, G, W] must have G = " + std::to_string(shape.groups()) + " and W = " +
                    std::to_string(shape.width()));
    if (shape.variant == "final_loop") {
      c.keys.push_back(final_loop_part(shape));
      c.values.push_back(final_loop_part(shape));
    } else if (shape.variant == "loop_head") {
      c.keys.push_back(loop_head_part(shape, stacked_keys[l], shape.rank_k));
      c.values.push_back(loop_head_part(shape, stacked_values[l], shape.rank_v));
    } else {
      c.keys.push_back(svd_part(stacked_keys[l], shape.rank_k));
      c.values.push_back(svd_part(stacked_values[l], shape.rank_v));
    }
  }
  return c;
}

void LlaCodec::save(const std::string& dir) const {
  io::make_dirs(dir);
  nn::TensorMap t;
  for (int l = 0; l < shape.layers; ++l)
    for (auto [name, part] : {std::pair<const char*, const LlaCodecPart*>{"k", &keys[l]}, {"v", &values[l]}}) {
      const std::string p = "layers." + std::to_string(l) + "." + name + ".";
      t[p + "mu"] = part->mu;
      t[p + "down"] = part->down;
      t[p + "up"] = part->up;
    }
  nn::save_safetensors(dir + "/lla_codec.safetensors", t, {{"format", "pt"}, {"producer", "kvx"}});
  io::write_file_atomic(dir + "/lla_codec.json", shape.to_json().dump(2) + "\n");
}

LlaCodec LlaCodec::load(const std::string& dir, const model::ModelConfig& teacher) {
  LlaCodec c;
  c.shape = LlaShape::from_json(io::parse_json_file(dir + "/lla_codec.json"));
  const auto want = LlaShape::of_teacher(teacher, c.shape.variant, c.shape.rank_k, c.shape.rank_v);
  if (want.to_json() != c.shape.to_json())
    throw Error(dir + "/lla_codec.json describes " + c.shape.to_json().dump() + " but the teacher has " + want.to_json().dump() +
                "; the codec was fitted for another model");
  const auto t = nn::load_safetensors(dir + "/lla_codec.safetensors");
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    auto it = t.find(name);
    if (it == t.end()) throw Error(dir + "/lla_codec.safetensors: missing tensor '" + name + "'; the file does not match lla_codec.json");
    if (it->second.sizes() != torch::IntArrayRef(shape))
      throw Error(dir + "/lla_codec.safetensors: tensor '" + name + "' has the wrong shape for lla_codec.json");
    return it->second.to(torch::kFloat32);
  };
  const int64_t G = c.shape.groups(), W = c.shape.width();
  for (int l = 0; l < c.shape.layers; ++l)
    for (auto [name, rank, parts] : {std::tuple<const char*, int, std::vector<LlaCodecPart>*>{"k", c.shape.rank_k, &c.keys},
                                     {"v", c.shape.rank_v, &c.values}}) {
      const std::string p = "layers." + std::to_string(l) + "." + name + ".";
      parts->push_back({get(p + "mu", {G, W}), get(p + "down", {G, W, rank}), get(p + "up", {G, W, rank})});
    }
  return c;
}

StackedKV capture_stacked_kv(model::Transformer& teacher, const std::vector<torch::Tensor>& windows, const std::string& variant) {
  const auto& cfg = teacher->config();
  LlaShape probe;
  probe.variant = variant;
  if (variant != "head" && variant != "2d" && variant != "final_loop" && variant != "loop_head")
    LlaShape::of_teacher(cfg, variant, 1, 1);  // throws, naming the valid variants
  const auto shape = LlaShape::of_teacher(cfg, probe.across_heads() ? "2d" : "head", 1, 1);  // the stacked layout
  const int T = cfg.loops, D = cfg.num_hidden_layers;
  // Per window: [layer][loop] K/V [B, Hkv, n, d_h]; stacked per layer into pieces of [B n, G, W].
  std::vector<std::vector<torch::Tensor>> k(D, std::vector<torch::Tensor>(T)), v = k, key_pieces(D), value_pieces(D);
  torch::NoGradGuard ng;
  for (const auto& ids : windows) {
    teacher->forward(ids, [&](int loop, int layer, const torch::Tensor& x) {
      auto* dense = dynamic_cast<attention::DenseAttention*>(teacher->layers[layer]->as<model::BlockImpl>()->self_attn.get());
      std::tie(k[layer][loop], v[layer][loop]) = dense->keys_values_pre_rope(x);
    });
    for (int l = 0; l < D; ++l) {
      key_pieces[l].push_back(attention::stack_loops(k[l], shape.across_heads()).reshape({-1, shape.groups(), shape.width()}));
      value_pieces[l].push_back(attention::stack_loops(v[l], shape.across_heads()).reshape({-1, shape.groups(), shape.width()}));
    }
  }
  StackedKV out;
  for (int l = 0; l < D; ++l) {
    out.keys.push_back(torch::cat(key_pieces[l], 0));
    out.values.push_back(torch::cat(value_pieces[l], 0));
  }
  return out;
}

std::array<torch::Tensor, 3> lla_distillation_loss(model::Transformer& teacher, const LlaCodec& codec, const torch::Tensor& ids) {
  const auto& cfg = teacher->config();
  const int T = cfg.loops, D = cfg.num_hidden_layers;
  auto dense = [&](int layer) {
    return dynamic_cast<attention::DenseAttention*>(teacher->layers[layer]->as<model::BlockImpl>()->self_attn.get());
  };
  // The teacher: logits, pre-RoPE K/V of every (loop, layer), attention outputs.
  std::vector<std::vector<torch::Tensor>> k(D, std::vector<torch::Tensor>(T)), v = k, a = k;
  torch::Tensor teacher_logp;
  {
    torch::NoGradGuard ng;
    teacher_logp = torch::log_softmax(teacher->forward(ids, [&](int t, int d, const torch::Tensor& x) {
      std::tie(k[d][t], v[d][t]) = dense(d)->keys_values_pre_rope(x);
      a[d][t] = dense(d)->forward(x);
    }), -1);
  }
  // Reconstructions per layer and loop from the codes of the teacher's K/V.
  std::vector<std::vector<torch::Tensor>> kh(D), vh(D);
  for (int d = 0; d < D; ++d) {
    const auto ck = codec.keys[d].encode(attention::stack_loops(k[d], codec.shape.across_heads()));
    const auto cv = codec.values[d].encode(attention::stack_loops(v[d], codec.shape.across_heads()));
    for (int t = 0; t < T; ++t) {
      kh[d].push_back(codec.keys[d].decode_loop(ck, t, T, cfg.head_dim));
      vh[d].push_back(codec.values[d].decode_loop(cv, t, T, cfg.head_dim));
    }
  }
  torch::Tensor mse = torch::zeros({}, teacher_logp.options());
  const auto student_logp = torch::log_softmax(teacher->forward(ids, nullptr, [&](int t, int d, const torch::Tensor& x) {
    auto out = dense(d)->forward_with_history(x, kh[d][t], vh[d][t]);
    mse = mse + (out - a[d][t]).pow(2).sum(-1).mean();
    return out;
  }), -1);
  const auto kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean();
  mse = mse * (0.5 / (T * D));
  return {kl + mse, kl, mse};
}

namespace {

// Each row's first half, continued by the student decoding through the codes (no gradient).
torch::Tensor on_policy_windows(model::Transformer& model, const LlaCodec& codec, const torch::Tensor& x, uint64_t seed) {
  torch::NoGradGuard ng;
  attention::CacheOptions options;
  options.lla = codec.decode_set();
  const int64_t n = x.size(1), keep = n / 2;
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < x.size(0); ++b) {
    const auto row = x[b].to(torch::kInt32).contiguous();
    const std::vector<int32_t> prompt(row.data_ptr<int32_t>(), row.data_ptr<int32_t>() + keep);
    const auto gen = model::generate(model, prompt, static_cast<int>(n - keep), {1.0, 1.0}, seed * 1000003 + b, nullptr, options);
    std::vector<int64_t> ids(prompt.begin(), prompt.end());
    ids.insert(ids.end(), gen.tokens.begin(), gen.tokens.end());
    rows.push_back(torch::tensor(ids, torch::kLong));
  }
  return torch::stack(rows);
}

}  // namespace

nlohmann::json fit_lla_run(const FitLlaRun& run) {
  if (run.out.empty()) throw Error("fit lla: give an output directory (--out)");
  if (!run.budget.empty() && (run.rank_k > 0 || run.rank_v > 0))
    throw Error("fit lla: give a budget (--budget " + run.budget + ") or ranks (--ranks " + std::to_string(run.rank_k) + "," +
                std::to_string(run.rank_v) + "), not both");
  if (run.init != "svd" && run.init != "random") throw Error("fit lla: --init '" + run.init + "' is not one of svd, random");
  const bool fixed_shape = run.variant == "final_loop" || run.variant == "loop_head";  // baselines defined by their structure
  if (run.init == "random" && fixed_shape) throw Error("fit lla: --init random applies to the head and 2d codecs");
  // Distillation trains every entry of mu, down and up, which would fill the baselines' structural
  // zeros (final_loop reading other loops, loop_head mixing them) under the baseline's name.
  if (run.distill_steps > 0 && fixed_shape)
    throw Error("fit lla: the " + run.variant + " baseline is defined by its structure, which distillation would not keep; "
                "drop the distillation steps (its fit is the SVD) or distil a head or 2d codec");
  auto teacher = train::load_model(run.teacher);
  const auto& cfg = teacher.model->config();
  auto [rank_k, rank_v] = run.variant == "final_loop" ? std::make_pair(cfg.head_dim, cfg.head_dim)
                          : run.budget.empty()        ? std::make_pair(run.rank_k, run.rank_v)
                                                      : ranks_for_budget(run.budget, run.variant, cfg);
  const auto shape = LlaShape::of_teacher(cfg, run.variant, rank_k, rank_v);
  const int seq_len = run.seq_len > 0 ? run.seq_len : std::min(128, cfg.max_position_embeddings);
  if (seq_len > cfg.max_position_embeddings)
    throw Error("fit lla: --seq-len " + std::to_string(seq_len) + " exceeds the teacher's context limit of " +
                std::to_string(cfg.max_position_embeddings));
  const train::TrainingData data = run.data ? *run.data : train::training_data_for(teacher.tokenizer, run.data_dir, run.sources);
  const int calib_windows = std::max(1, run.calibration_tokens / seq_len);
  std::vector<torch::Tensor> calibration;
  for (const auto& b : train::evaluation_batches(data.train.tokens, calib_windows, 8, seq_len)) calibration.push_back(b.first);
  teacher.model->eval();
  if (run.verbose)
    std::cerr << "fit lla: capturing K/V of " << cfg.loops << " loops x " << cfg.num_hidden_layers << " layers on "
              << calib_windows * seq_len << " calibration tokens\n";
  const auto kv = capture_stacked_kv(teacher.model, calibration, run.variant);
  auto codec = LlaCodec::fit_svd(shape, kv.keys, kv.values);
  if (run.init == "random") {  // the ablation: random orthonormal bases, the same means
    torch::manual_seed(1234);
    for (auto* parts : {&codec.keys, &codec.values})
      for (auto& p : *parts) {
        auto q = std::get<0>(torch::linalg_qr(torch::randn({p.down.size(0), p.down.size(1), p.down.size(2)})));
        p.down = q.contiguous();
        p.up = q.clone();
      }
  }
  auto errors = reconstruction_error(codec, kv);  // of the initial codec; again for the distilled one

  const int windows =
      std::max(1, std::min<int>(run.eval_windows, static_cast<int>((data.validation.tokens.size() - 1) / seq_len)));
  const auto batches = train::evaluation_batches(data.validation.tokens, windows, 8, seq_len);
  if (run.verbose) std::cerr << "fit lla: held-out quality, one token per step through the codes (" << windows << " windows)\n";
  const auto full = eval::evaluate_lm(teacher.model, batches, data.tokenizer);
  auto held_out = [&](const LlaCodec& c) {
    attention::CacheOptions options;
    options.lla = c.decode_set();
    return eval::evaluate_lm_cached(teacher.model, batches, data.tokenizer, options, 1);
  };
  auto student = held_out(codec);
  const double init_kl = student.kl_vs_full;
  const auto init_errors_list = errors;
  nlohmann::json distill = nullptr;
  if (run.distill_steps > 0) {
    // The teacher frozen; the codec's tensors are the only parameters.
    for (auto& p : teacher.model->parameters()) p.requires_grad_(false);
    std::vector<std::pair<std::string, torch::Tensor>> params;
    for (int l = 0; l < shape.layers; ++l)
      for (auto* part : {&codec.keys[l], &codec.values[l]})
        for (auto* t : {&part->mu, &part->down, &part->up}) {
          *t = t->detach().clone().requires_grad_(true);
          params.emplace_back("codec." + std::to_string(params.size()), *t);
        }
    train::AdamWOptions ao;
    ao.weight_decay = 0;
    train::AdamW opt(params, ao);
    train::BatchSampler sampler(&data.train.tokens, run.distill_batch, seq_len, 1234);
    auto snapshot = [&](const LlaCodec& c) {  // a deep copy (the optimiser updates c in place)
      LlaCodec out{c.shape, {}, {}};
      for (int l = 0; l < shape.layers; ++l)
        for (auto [from, to] : {std::make_pair(&c.keys, &out.keys), std::make_pair(&c.values, &out.values)})
          to->push_back({(*from)[l].mu.detach().clone(), (*from)[l].down.detach().clone(), (*from)[l].up.detach().clone()});
      return out;
    };
    LlaCodec best = snapshot(codec);
    double best_kl = init_kl;
    nlohmann::json curve = nlohmann::json::array();
    const int every = std::max(1, run.distill_steps / std::max(1, run.distill_evals));
    for (int step = 1; step <= run.distill_steps; ++step) {
      auto x = sampler.next().first;
      if (run.on_policy) x = on_policy_windows(teacher.model, codec, x, static_cast<uint64_t>(step));
      const auto losses = lla_distillation_loss(teacher.model, codec, x);
      opt.zero_grad();
      (losses[1] + run.attention_weight * losses[2]).backward();
      const double lr = run.distill_lr * std::min(1.0, step / 10.0) * 0.5 * (1 + std::cos(M_PI * step / run.distill_steps));
      opt.step(lr);
      if (run.verbose && (step % 10 == 0 || step == 1))
        std::fprintf(stderr, "fit lla: step %4d/%d | loss %.5f | kl %.5f | attn mse %.5f\n", step, run.distill_steps,
                     losses[0].item<double>(), losses[1].item<double>(), losses[2].item<double>());
      if (step % every == 0 || step == run.distill_steps) {
        torch::NoGradGuard ng;
        const auto q = held_out(codec);
        curve.push_back({{"step", step}, {"held_out_kl", q.kl_vs_full}, {"top1_agreement", q.top1_agreement}});
        if (run.verbose) std::fprintf(stderr, "fit lla: step %d held-out KL %.5f (best %.5f)\n", step, q.kl_vs_full, best_kl);
        if (q.kl_vs_full < best_kl) {
          best_kl = q.kl_vs_full;
          best = snapshot(codec);
        }
      }
    }
    codec = best;
    student = held_out(codec);  // the kept codec, measured again
    errors = reconstruction_error(codec, kv);
    nlohmann::json init_errors = nlohmann::json::array();
    for (const auto& [k, v] : init_errors_list) init_errors.push_back({{"keys", k}, {"values", v}});
    distill = {{"steps", run.distill_steps}, {"lr", run.distill_lr}, {"on_policy", run.on_policy},
               {"init_reconstruction_error", init_errors},
               {"attention_weight", run.attention_weight}, {"init_kl", init_kl}, {"curve", curve}};
  }
  for (int l = 0; l < shape.layers; ++l)
    for (auto* part : {&codec.keys[l], &codec.values[l]})
      for (auto* t : {&part->mu, &part->down, &part->up}) *t = t->detach();
  codec.save(run.out);
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& [k, v] : errors) layers.push_back({{"keys", k}, {"values", v}});
  nlohmann::json report = {{"teacher", teacher.dir},
                           {"codec", shape.to_json()},
                           {"compression", shape.compression()},
                           {"bytes_per_token", shape.bytes_per_token()},
                           {"teacher_bytes_per_token", shape.teacher_bytes_per_token()},
                           {"calibration_tokens", calib_windows * seq_len},
                           {"reconstruction_error", layers},
                           {"validation_windows", windows},
                           {"seq_len", seq_len},
                           {"teacher_cross_entropy", full.cross_entropy},
                           {"cross_entropy", student.quality.cross_entropy},
                           {"kl_vs_teacher", student.kl_vs_full},
                           {"top1_agreement", student.top1_agreement},
                           {"init", run.init},
                           {"distillation", distill}};
  io::write_file_atomic(run.out + "/report.json", report.dump(2) + "\n");
  return report;
}

std::vector<std::pair<double, double>> reconstruction_error(const LlaCodec& codec, const StackedKV& kv) {
  std::vector<std::pair<double, double>> out;
  auto rel = [](const LlaCodecPart& p, const torch::Tensor& x) {
    const auto err = (p.decode(p.encode(x)) - x).pow(2).sum().item<double>();
    return err / std::max((x - p.mu).pow(2).sum().item<double>(), 1e-30);
  };
  for (size_t l = 0; l < codec.keys.size(); ++l) out.emplace_back(rel(codec.keys[l], kv.keys[l]), rel(codec.values[l], kv.values[l]));
  return out;
}

}  // namespace kvx::compress
