// LLA codec (SPEC 1.3): capture of pre-RoPE K/V across loops, SVD initialisation (exact at full
// rank, the optimal rank-r error below it), the seed's budget -> ranks example, save/load with a
// teacher check, and the errors for ranks and teachers that cannot work.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "attention/dense.h"
#include "compress/lla_codec.h"
#include "support/fixtures.h"
#include "train/checkpoint.h"
#include "util/error.h"

using namespace kvx;

namespace {

model::ModelConfig looped_config(int loops, int kv_heads) {
  auto c = kvx::testing::mixer_config(4, kv_heads, 8, 24);
  c.num_hidden_layers = 2;
  c.loops = loops;
  c.sandwich_norm = true;
  c.vocab_size = 37;
  c.validate();
  return c;
}

std::vector<torch::Tensor> windows(int count, int64_t length, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> w;
  for (int i = 0; i < count; ++i) w.push_back(torch::randint(37, {2, length}, torch::kLong));
  return w;
}


// An SVD-initialised codec of m's K/V captured on these windows.
compress::LlaCodec svd_codec(model::Transformer& m, const model::ModelConfig& c, const std::string& variant, int rank_k,
                             int rank_v, const std::vector<torch::Tensor>& calibration) {
  const auto kv = compress::capture_stacked_kv(m, calibration, variant);
  return compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, variant, rank_k, rank_v), kv.keys, kv.values);
}

}  // namespace

TEST(LlaCodec, CaptureStacksEachLoopsPreRopeKeysAndValues) {
  const auto c = looped_config(3, 2);
  torch::manual_seed(1);
  model::Transformer m(c);
  const auto w = windows(1, 9, 2);
  const auto kv = compress::capture_stacked_kv(m, w, "head");
  ASSERT_EQ(kv.keys.size(), 2u);
  EXPECT_EQ(kv.keys[0].sizes(), torch::IntArrayRef({18, 2, 3 * 8}));  // N = 2 x 9 tokens, Hkv = 2, T d_h
  // Loop 0 of layer 0 is k_proj of the normed embedding (before RoPE).
  torch::NoGradGuard ng;
  auto* block = m->layers[0]->as<model::BlockImpl>();
  auto* dense = dynamic_cast<attention::DenseAttention*>(block->self_attn.get());
  const auto k0 = dense->k_proj(block->input_layernorm(m->embed_tokens(w[0]))).view({18, 2, 8});
  EXPECT_TRUE(torch::allclose(kv.keys[0].narrow(2, 0, 8), k0, 1e-6, 1e-6));
  const auto kv2d = compress::capture_stacked_kv(m, w, "2d");
  EXPECT_EQ(kv2d.values[1].sizes(), torch::IntArrayRef({18, 1, 2 * 3 * 8}));
}

TEST(LlaCodec, FullRankIsExactAndLowerRanksHitTheSvdOptimum) {
  const auto c = looped_config(2, 2);
  torch::manual_seed(3);
  model::Transformer m(c);
  const auto kv = compress::capture_stacked_kv(m, windows(2, 13, 4), "head");  // N = 52 >= W = 16
  const auto full = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "head", 16, 16), kv.keys, kv.values);
  for (auto [ek, ev] : compress::reconstruction_error(full, kv)) {
    EXPECT_LT(ek, 1e-10);
    EXPECT_LT(ev, 1e-10);
  }
  const auto low = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "head", 3, 5), kv.keys, kv.values);
  const auto err = compress::reconstruction_error(low, kv);
  for (int l = 0; l < 2; ++l) {
    // The discarded singular values' share of the centred energy, summed over the KV heads.
    auto expected = [&](const torch::Tensor& x, int r) {
      double kept = 0, total = 0;
      for (int64_t g = 0; g < x.size(1); ++g) {
        auto xg = x.select(1, g).to(torch::kDouble);
        auto s = torch::linalg_svdvals(xg - xg.mean(0)).pow(2);
        total += s.sum().item<double>();
        kept += s.narrow(0, 0, r).sum().item<double>();
      }
      return (total - kept) / total;
    };
    EXPECT_NEAR(err[l].first, expected(kv.keys[l], 3), 1e-5);
    EXPECT_NEAR(err[l].second, expected(kv.values[l], 5), 1e-5);
    EXPECT_GT(err[l].first, 0.0);
  }
  EXPECT_DOUBLE_EQ(low.shape.compression(), 2.0 * 16 / 8);
}

TEST(LlaCodec, BudgetPicksTheSeedsRanks) {
  auto c = looped_config(4, 2);
  c.head_dim = 128;  // Ouro-1.4B: T = 4, d_h = 128, 4x -> (96, 160)
  EXPECT_EQ(compress::ranks_for_budget("4x", "head", c), std::make_pair(96, 160));
  const auto s = compress::LlaShape::of_teacher(c, "head", 96, 160);
  EXPECT_DOUBLE_EQ(s.compression(), 4.0);
  EXPECT_DOUBLE_EQ(s.teacher_bytes_per_token() / s.bytes_per_token(), 4.0);
  EXPECT_THROW(compress::ranks_for_budget("0.5x", "head", c), Error);
  EXPECT_THROW(compress::ranks_for_budget("fast", "head", c), Error);
}

TEST(LlaCodec, SavedCodecLoadsOnlyForItsTeacher) {
  const auto c = looped_config(2, 2);
  torch::manual_seed(5);
  model::Transformer m(c);
  const auto codec = svd_codec(m, c, "2d", 6, 10, windows(2, 13, 6));
  const std::string dir = kvx::testing::temp_dir("lla_codec");
  codec.save(dir);
  const auto back = compress::LlaCodec::load(dir, c);
  EXPECT_TRUE(torch::equal(back.values[1].up, codec.values[1].up));
  EXPECT_EQ(back.shape.to_json(), codec.shape.to_json());
  auto other = c;
  other.num_key_value_heads = 1;
  try {
    compress::LlaCodec::load(dir, other);
    FAIL() << "a codec loaded for another teacher";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fitted for another model"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(LlaCodec, RanksAndTeachersThatCannotWorkAreRefused) {
  const auto c = looped_config(2, 2);
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      FAIL() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { compress::LlaShape::of_teacher(c, "head", 17, 4); }, "must be in [1, 16]");
  expect_error([&] { compress::LlaShape::of_teacher(c, "head", 0, 4); }, "r_k = 0 must be in");
  expect_error([&] { compress::LlaShape::of_teacher(c, "3d", 4, 4); }, "is not one of head");
  auto flat = c;
  flat.loops = 1;
  expect_error([&] { compress::LlaShape::of_teacher(flat, "head", 4, 4); }, "is not looped");
  auto mixed = c;
  mixed.layout = "dense,mla";
  expect_error([&] { compress::LlaShape::of_teacher(mixed, "head", 4, 4); }, "compresses dense");
}

// ---- decode with the history stored as codes (attention/lla.h) ----

TEST(LlaDecode, FullRankCodesDecodeLikeTheTeacherAndCommitOnlyAfterTheLastLoop) {
  for (const char* variant : {"head", "2d"}) {
    auto c = looped_config(3, 2);
    c.max_position_embeddings = 64;
    torch::manual_seed(7);
    model::Transformer m(c);
    m->to(torch::kFloat64);
    const auto kv = compress::capture_stacked_kv(m, windows(3, 20, 8), variant);
    const int W = std::string(variant) == "2d" ? 2 * 3 * 8 : 3 * 8;
    const auto codec = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, variant, W, W), kv.keys, kv.values);
    torch::NoGradGuard ng;
    const auto ids = torch::randint(37, {2, 17}, torch::kLong);
    const auto full = m->forward(ids);
    attention::CacheOptions o;
    o.lla = codec.decode_set();
    auto state = m->new_state(2, o);
    ASSERT_EQ(state.layers.size(), 6u);
    std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, 5), state)};
    for (int t = 5; t < 17; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
    const auto inc = torch::cat(parts, 1);
    EXPECT_LT((inc - full).abs().max().item<double>(), 1e-4) << variant;  // codes are f32
    // The persistent cache is the codes only: layers x groups x (r_k + r_v) f32 per token.
    const int groups = std::string(variant) == "2d" ? 1 : 2;
    EXPECT_EQ(state.bytes(), 17 * 2 * 4 * 2 * groups * (W + W));
    // A token's code is committed only after its last loop (caches are loop-major: layer 0 of
    // loops 0, 1, 2 is at 0, 2, 4).
    auto& store = dynamic_cast<attention::LlaLoopCache&>(*state.layers[0]).store();
    EXPECT_EQ(store.committed(), 17);
    auto& attn = *m->layers[0]->as<model::BlockImpl>()->self_attn;
    const auto x = torch::randn({2, 1, c.hidden_size}, torch::kFloat64);
    attn.step(x, *state.layers[0]);
    attn.step(x, *state.layers[2]);
    EXPECT_EQ(store.committed(), 17);
    attn.step(x, *state.layers[4]);
    EXPECT_EQ(store.committed(), 18);
  }
}

TEST(LlaDecode, LowRankCodesStayCloseAndTheMismatchesAreRefused) {
  auto c = looped_config(2, 2);
  torch::manual_seed(9);
  model::Transformer m(c);
  const auto codec = svd_codec(m, c, "head", 12, 14, windows(4, 30, 10));
  torch::NoGradGuard ng;
  const auto ids = torch::randint(37, {1, 20}, torch::kLong);
  const auto full = torch::log_softmax(m->forward(ids), -1);
  attention::CacheOptions o;
  o.lla = codec.decode_set();
  auto state = m->new_state(1, o);
  std::vector<torch::Tensor> parts;
  for (int t = 0; t < 20; ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
  const auto student = torch::log_softmax(torch::cat(parts, 1), -1);
  const double kl = (full.exp() * (full - student)).sum(-1).mean().item<double>();
  EXPECT_GT(kl, 0.0);
  EXPECT_LT(kl, 0.05);  // 26 of 32 stacked dimensions kept on a random model
  auto other = c;
  other.loops = 3;
  model::Transformer m3(other);
  EXPECT_THROW(m3->new_state(1, o), Error);
  o.type = kernels::KVType::Q8;
  EXPECT_THROW(m->new_state(1, o), Error);
}

namespace {

// Logits of ids decoded with these cache options: a first chunk of `prefill` tokens, a second chunk
// of 5 read against committed history, then one token per step.
torch::Tensor decode_logits(model::Transformer& m, const torch::Tensor& ids, const attention::CacheOptions& o, int64_t prefill) {
  auto state = m->new_state(ids.size(0), o);
  std::vector<torch::Tensor> parts{m->step(ids.narrow(1, 0, prefill), state), m->step(ids.narrow(1, prefill, 5), state)};
  for (int64_t t = prefill + 5; t < ids.size(1); ++t) parts.push_back(m->step(ids.narrow(1, t, 1), state));
  return torch::cat(parts, 1);
}

}  // namespace

TEST(LlaDecode, TheFusedKernelReadEqualsTheLibtorchReferenceAtLowRank) {
  for (const char* variant : {"head", "2d"}) {
    auto c = looped_config(3, 2);
    c.num_attention_heads = 4;  // GQA: 2 query heads per KV head
    torch::manual_seed(21);
    model::Transformer m(c);
    const auto codec = svd_codec(m, c, variant, 5, 9, windows(4, 30, 5));
    torch::NoGradGuard ng;
    const auto ids = torch::randint(37, {2, 40}, torch::kLong);
    attention::CacheOptions fused, reference;
    fused.lla = reference.lla = codec.decode_set();
    reference.reference = true;
    const auto a = decode_logits(m, ids, fused, 9), b = decode_logits(m, ids, reference, 9);
    EXPECT_LT((a - b).abs().max().item<double>(), 2e-4) << variant;
    EXPECT_GT((a - m->forward(ids)).abs().max().item<double>(), 1e-3) << variant;  // low rank: not the teacher
  }
}

TEST(LlaDecode, WithSinkAndWindowEvictionAFullRankCodecDecodesLikeTheEvictingTeacher) {
  auto c = looped_config(2, 2);
  c.max_position_embeddings = 128;
  torch::manual_seed(23);
  model::Transformer m(c);
  const auto codec = svd_codec(m, c, "head", 16, 16, windows(3, 30, 6));
  torch::NoGradGuard ng;
  const auto ids = torch::randint(37, {1, 100}, torch::kLong);
  // A 7-token first chunk with window 3: a query sees the sink and its window inside the chunk (two runs).
  auto teacher = attention::CacheOptions::parse("f32", "sink=2,window=3", false);
  auto student = teacher;
  student.lla = codec.decode_set();
  const auto want = decode_logits(m, ids, teacher, 7), got = decode_logits(m, ids, student, 7);
  EXPECT_LT((got - want).abs().max().item<double>(), 2e-4);
  EXPECT_GT((want - m->forward(ids)).abs().max().item<double>(), 1e-3);  // eviction did change the outputs
  // Rows no read can reach are dropped: the codes held stay bounded (sink + at most max(2 window, 64) + 1).
  auto state = m->new_state(1, student);
  for (int64_t t = 0; t < 100; ++t) m->step(ids.narrow(1, t, 1), state);
  EXPECT_LE(state.bytes(), (2 + 64 + 1) * 2 * 2 * 4 * (16 + 16));
  // A window wider than a tile, compacted several times over 250 tokens, chunks of 7 after the prompt.
  c.max_position_embeddings = 256;
  model::Transformer longer(c);
  const auto codec2 = svd_codec(longer, c, "head", 16, 16, windows(3, 30, 6));
  const auto long_ids = torch::randint(37, {1, 250}, torch::kLong);
  auto t2 = attention::CacheOptions::parse("f32", "sink=3,window=40", false);
  auto s2 = t2;
  s2.lla = codec2.decode_set();
  auto chunked = [&](const attention::CacheOptions& o) {
    auto st = longer->new_state(1, o);
    std::vector<torch::Tensor> parts;
    for (int64_t at = 0; at < 250; at += 7) parts.push_back(longer->step(long_ids.narrow(1, at, std::min<int64_t>(7, 250 - at)), st));
    return torch::cat(parts, 1);
  };
  EXPECT_LT((chunked(s2) - chunked(t2)).abs().max().item<double>(), 2e-4);
  student.reference = true;
  EXPECT_THROW(m->new_state(1, student), Error);
}

TEST(LlaDecode, TheAbsorbedReadIsLabelledAndApproximateOnARopeModel) {
  auto c = looped_config(2, 2);
  torch::manual_seed(25);
  model::Transformer m(c);
  const auto codec = svd_codec(m, c, "head", 16, 16, windows(3, 30, 7));
  torch::NoGradGuard ng;
  const auto ids = torch::randint(37, {1, 30}, torch::kLong);
  attention::CacheOptions exact, absorbed;
  exact.lla = absorbed.lla = codec.decode_set();
  absorbed.lla_absorbed = true;
  EXPECT_NE(absorbed.describe().find("absorbed"), std::string::npos);
  const auto full = m->forward(ids), a = decode_logits(m, ids, exact, 1), b = decode_logits(m, ids, absorbed, 1);
  EXPECT_LT((a - full).abs().max().item<double>(), 2e-4);  // full rank, RoPE after reconstruction: exact
  EXPECT_TRUE(torch::isfinite(b).all().item<bool>());
  EXPECT_GT((b - full).abs().max().item<double>(), 1e-3);  // RoPE dropped on history keys: not exact
  EXPECT_LT((b.narrow(1, 0, 1) - full.narrow(1, 0, 1)).abs().max().item<double>(), 2e-4);  // no history yet: exact
  absorbed.reference = true;
  EXPECT_THROW(m->new_state(1, absorbed), Error);
}

TEST(FitLla, FitsSavesAndMeasuresTheCodecThroughDecode) {
  train::TokenizedText test;
  const auto data = kvx::testing::synthetic_data(9000, 1500, 12000, &test);
  auto c = looped_config(2, 2);
  c.vocab_size = data.tokenizer.vocab_size();
  c.max_position_embeddings = 64;
  torch::manual_seed(11);
  model::Transformer m(c);
  const std::string dir = kvx::testing::temp_dir("fit_lla");
  train::save_model_dir(dir + "/teacher", m, data.tokenizer);
  compress::FitLlaRun run;
  run.teacher = dir + "/teacher";
  run.out = dir + "/codec";
  run.budget = "2x";  // T d_h = 16 -> r_k + r_v = 16, split 6 / 10
  run.calibration_tokens = 1024;
  run.eval_windows = 2;
  run.seq_len = 32;
  run.verbose = false;
  run.data = &data;
  run.distill_steps = 4;
  run.distill_evals = 2;
  run.distill_batch = 2;
  const auto report = compress::fit_lla_run(run);
  ASSERT_FALSE(report["distillation"].is_null());
  EXPECT_EQ(report["distillation"]["curve"].size(), 2u);
  EXPECT_LE(report["kl_vs_teacher"].get<double>(), report["distillation"]["init_kl"].get<double>() + 1e-12);  // the best is kept
  // On-policy: the student samples the second half of each window through its codes.
  run.on_policy = true;
  run.distill_steps = 2;
  run.out = dir + "/codec-on-policy";
  const auto on = compress::fit_lla_run(run);
  EXPECT_TRUE(on["distillation"]["on_policy"].get<bool>());
  // The random-initialisation ablation starts worse than the SVD and names its init.
  run.on_policy = false;
  run.init = "random";
  run.attention_weight = 0;
  run.out = dir + "/codec-random";
  const auto rnd = compress::fit_lla_run(run);
  EXPECT_EQ(rnd["init"], "random");
  EXPECT_GT(rnd["distillation"]["init_kl"].get<double>(), report["distillation"]["init_kl"].get<double>());
  run.init = "pca";
  EXPECT_THROW(compress::fit_lla_run(run), Error);
  run.init = "svd";
  // Refused before any work: a budget and ranks together (accounted at one, fitted at the other),
  // and distilling a baseline (training fills the structural zeros that define it).
  auto refusal = [&](compress::FitLlaRun bad) {
    try {
      compress::fit_lla_run(bad);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  compress::FitLlaRun both = run;
  both.rank_k = both.rank_v = 4;
  EXPECT_NE(refusal(both).find("not both"), std::string::npos);
  for (const char* baseline : {"final_loop", "loop_head"}) {
    compress::FitLlaRun bad = run;
    bad.variant = baseline;
    bad.budget = std::string(baseline) == "final_loop" ? "" : "2x";
    EXPECT_NE(refusal(bad).find("defined by its structure"), std::string::npos) << baseline;
  }
  EXPECT_LE(on["kl_vs_teacher"].get<double>(), on["distillation"]["init_kl"].get<double>() + 1e-12);
  EXPECT_EQ(report["codec"]["rank_k"], 6);
  EXPECT_EQ(report["codec"]["rank_v"], 10);
  EXPECT_DOUBLE_EQ(report["compression"].get<double>(), 2.0);
  EXPECT_GT(report["kl_vs_teacher"].get<double>(), 0.0);
  EXPECT_LE(report["top1_agreement"].get<double>(), 1.0);
  EXPECT_EQ(report["reconstruction_error"].size(), 2u);
  EXPECT_NO_THROW(compress::LlaCodec::load(run.out, c));
  EXPECT_TRUE(std::filesystem::exists(run.out + "/report.json"));
  std::filesystem::remove_all(dir);
}

TEST(LlaDistillation, ExactHistoryIsTheTeacherAndTheLossReachesTheCodec) {
  auto c = looped_config(2, 2);
  c.num_attention_heads = 4;  // GQA: 2 query heads per KV head
  torch::manual_seed(13);
  model::Transformer m(c);
  m->to(torch::kFloat64);
  const auto ids = torch::randint(37, {2, 11}, torch::kLong);
  {
    torch::NoGradGuard ng;
    auto* block = m->layers[0]->as<model::BlockImpl>();
    auto* dense = dynamic_cast<attention::DenseAttention*>(block->self_attn.get());
    const auto x = block->input_layernorm(m->embed_tokens(ids)).to(torch::kFloat64);
    const auto [k, v] = dense->keys_values_pre_rope(x);
    EXPECT_LT((dense->forward_with_history(x, k, v) - dense->forward(x)).abs().max().item<double>(), 1e-12);
  }
  const auto kv = compress::capture_stacked_kv(m, windows(3, 20, 14), "head");
  auto full = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "head", 16, 16), kv.keys, kv.values);
  for (auto* parts : {&full.keys, &full.values})
    for (auto& p : *parts) p = {p.mu.to(torch::kFloat64), p.down.to(torch::kFloat64), p.up.to(torch::kFloat64)};
  const auto exact = compress::lla_distillation_loss(m, full, ids);
  EXPECT_LT(exact[1].item<double>(), 1e-10);  // KL
  EXPECT_LT(exact[2].item<double>(), 1e-10);  // attention MSE
  auto low = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "head", 3, 4), kv.keys, kv.values);
  for (auto* parts : {&low.keys, &low.values})
    for (auto& p : *parts) p = {p.mu.to(torch::kFloat64).requires_grad_(), p.down.to(torch::kFloat64).requires_grad_(),
                                p.up.to(torch::kFloat64).requires_grad_()};
  const auto loss = compress::lla_distillation_loss(m, low, ids);
  EXPECT_GT(loss[1].item<double>(), 0.0);
  EXPECT_GT(loss[2].item<double>(), 0.0);
  loss[0].backward();
  EXPECT_GT(low.keys[1].down.grad().abs().sum().item<double>(), 0.0);
  EXPECT_GT(low.values[0].up.grad().abs().sum().item<double>(), 0.0);
}

TEST(LlaBaselines, FinalLoopReuseAndThePerLoopHeadCodec) {
  const auto c = looped_config(3, 2);
  torch::manual_seed(17);
  model::Transformer m(c);
  const auto kv = compress::capture_stacked_kv(m, windows(3, 20, 18), "head");
  // final_loop: every loop reconstructs loop T's vector exactly.
  const auto fl = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "final_loop", 8, 8), kv.keys, kv.values);
  EXPECT_DOUBLE_EQ(fl.shape.compression(), 3.0);
  const auto x = kv.values[1].narrow(0, 0, 5);  // [5, Hkv, T d_h]
  const auto xhat = fl.values[1].decode(fl.values[1].encode(x));
  for (int t = 0; t < 3; ++t) EXPECT_TRUE(torch::allclose(xhat.narrow(2, t * 8, 8), x.narrow(2, 2 * 8, 8), 1e-6, 1e-6)) << t;
  EXPECT_THROW(compress::LlaShape::of_teacher(c, "final_loop", 4, 8), Error);
  // loop_head at full per-loop rank (Hkv d_h per loop) reconstructs exactly; it never mixes loops.
  const auto kv2 = compress::capture_stacked_kv(m, windows(3, 20, 18), "loop_head");
  const auto lh = compress::LlaCodec::fit_svd(compress::LlaShape::of_teacher(c, "loop_head", 48, 48), kv2.keys, kv2.values);
  for (auto [ek, ev] : compress::reconstruction_error(lh, kv2)) {
    EXPECT_LT(ek, 1e-10);
    EXPECT_LT(ev, 1e-10);
  }
  const auto down = lh.keys[0].down[0].reshape({2, 3, 8, 48});  // [head, loop, d_h, code]
  for (int t = 0; t < 3; ++t)
    for (int u = 0; u < 3; ++u)
      if (u != t) EXPECT_EQ(down.select(1, t).narrow(2, u * 16, 16).abs().max().item<double>(), 0.0) << t << " " << u;
  EXPECT_THROW(compress::LlaShape::of_teacher(c, "loop_head", 7, 9), Error);  // not multiples of T = 3
}
