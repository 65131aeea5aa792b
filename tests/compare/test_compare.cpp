// The compare harness: budget accounting, content-hash arm keys, resuming without redoing
// finished arms, and a report that lists every arm. Uses a synthetic byte-level corpus.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "compare/report.h"
#include "compare/runner.h"
#include "io/atomic_file.h"
#include "support/fixtures.h"
#include "train/checkpoint.h"
#include "util/error.h"

using namespace kvx;
namespace fs = std::filesystem;

namespace {

using kvx::testing::temp_dir;

struct SyntheticData {
  train::TokenizedText test;
  train::TrainingData data = kvx::testing::synthetic_data(9000, 1500, 12000, &test);
  // Quiet options writing under a fresh temp dir, reading this data.
  compare::CompareOptions options(const std::string& dir_name) const {
    compare::CompareOptions o;
    o.out_dir = temp_dir(dir_name);
    o.verbose = false;
    o.data = &data;
    o.test = &test;
    return o;
  }
};

TEST(Compare, LoopedArmsAreAccountedAgainstTheLoopedTeachersFullCache) {
  auto e = compare::builtin_experiment("posthoc", "tiny");
  e.groups = {};  // accounting only
  std::vector<std::string> names;
  for (const auto& a : e.arms)
    if (a.name == "looped" || a.spec.value("base", "") == "looped") names.push_back(a.name);
  compare::select_arms(e, names);
  compare::CompareOptions o;
  o.out_dir = temp_dir("loop-budget");
  o.verbose = false;
  const auto r = compare::run_experiment(e, o);
  const double full = 2.0 * 4 * 2 * 6 * 64 * 4;  // K,V x loops x layers x heads x d_h x 4 bytes
  // 4x: T d_h = 256 per head, r_k + r_v = 128 split 48 + 80; 1.33x: 385 = 144 + 241.
  const std::map<std::string, double> want = {
      {"looped", full},          {"looped+q8", 2 * 4 * 2 * 6 * 68}, {"looped+cla-2x", full / 2},
      {"lla-4x", 4.0 * 2 * 6 * 128}, {"lla-1.33x", 4.0 * 2 * 6 * 385}, {"lla-16x", 4.0 * 2 * 6 * 32},
      {"lla2d-4x", 4.0 * 2 * 1 * (6 * 128)}, {"head-codec-4x", 4.0 * 2 * 1 * (6 * 128)},
      {"final-loop-4x", 4.0 * 2 * 6 * 128}, {"lla-4x+sink4-w60", 4.0 * 2 * 6 * 128 * 64 / 128},
      {"lla-16x-distilled-equal-ranks", 4.0 * 2 * 6 * 32}};
  for (const auto& a : r.arms) {
    if (!want.count(a.name)) continue;
    EXPECT_DOUBLE_EQ(a.metrics["kv_bytes_per_token"].get<double>(), want.at(a.name)) << a.name;
    if (a.name != "looped") EXPECT_NEAR(a.metrics["compression"].get<double>(), full / want.at(a.name), 1e-9) << a.name;
    // % of MHA against the looped teacher's own full cache (it read 300% against the base model's)
    EXPECT_NEAR(a.metrics["kv_pct_of_mha"].get<double>(), 100 * want.at(a.name) / full, 1e-9) << a.name;
  }
  for (const auto& a : r.arms)
    if (a.name == "lla-4x") EXPECT_EQ(a.metrics["rank_k"].get<int>() * 10 + a.metrics["rank_v"].get<int>(), 48 * 10 + 80);
  fs::remove_all(o.out_dir);
}

compare::Experiment micro() {
  auto e = compare::builtin_experiment("posthoc", "tiny");
  auto& m = e.base.model;
  m.vocab_size = 256;
  m.hidden_size = 32;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 4;
  m.head_dim = 32;
  m.intermediate_size = 48;
  m.max_position_embeddings = 128;
  auto& t = e.base.train;
  t.steps = 6;
  t.batch_size = 4;
  t.seq_len = 32;
  t.eval_every = 3;
  t.eval_batches = 1;
  t.checkpoint_every = 3;
  e.base.data.mqar_max_pairs = 4;
  e.eval.test_windows = 4;
  e.eval.long_context_tokens = 128;
  e.eval.mqar_pairs = {1, 4};
  e.eval.mqar_sequences = 4;
  e.groups = {"quality", "mqar"};
  e.arms.resize(4);  // mha, +f32, +bf16, +q8
  e.arms[0].spec = {{"model", {{"num_key_value_heads", 4}}}};
  e.arms.push_back({"mqa", "train", {{"model", {{"num_key_value_heads", 1}}}}});
  e.arms.push_back({"mha+sink2-w6", "posthoc", {{"base", "mha"}, {"kv_cache", "f32"}, {"evict", "sink=2,window=6"}}});
  return e;
}

}  // namespace

TEST(Compare, BudgetAccountingMatchesHandComputedBytes) {
  auto e = compare::builtin_experiment("posthoc", "tiny");
  e.groups = {};  // accounting only: nothing trained
  compare::select_arms(e, compare::demo_arms("posthoc"));  // the MHA transforms (the looped arms: next test)
  e.arms.push_back({"gqa-h4", "train", {{"model", {{"num_key_value_heads", 2}}}}});
  const auto arch = compare::builtin_experiment("arch", "tiny");
  e.arms.push_back(compare::find_arm(arch, "mla"));
  e.arms.push_back(compare::find_arm(arch, "lrkv-r2-pair"));
  e.arms.push_back(compare::find_arm(arch, "gdn"));
  e.arms.push_back(compare::find_arm(arch, "natsl-hybrid"));
  compare::CompareOptions o;
  o.out_dir = temp_dir("budget");
  o.verbose = false;
  auto r = compare::run_experiment(e, o);
  std::map<std::string, double> want = {
      {"mha", 2 * 4 * 8 * 32 * 4},        // 2 (K,V) x layers x Hkv x d_h x 4 bytes
      {"mha+f32", 8192},    {"mha+bf16", 2 * 4 * 8 * 32 * 2},
      {"mha+q8", 2 * 4 * 8 * 34},          // one 32-value block: 32 int8 + fp16 scale
      {"mha+q4", 2 * 4 * 8 * 18},          // 16 bytes of nibbles + fp16 scale
      {"mha+sink4-w28", 8192.0 * 32 / 128},  // holds 32 of the 128-token context
      {"mha+sink4-w60", 8192.0 * 64 / 128},
      {"mha+q8+sink4-w60", 2176.0 * 64 / 128},
      {"gqa-h4", 2 * 4 * 2 * 32 * 4},
      {"mha->lrkv-r8", 4 * 2 * (32 + 8 * 8) * 4},  // layers x 2 (d_h + H r) x 4 bytes: 37.5%
      {"mla", 4 * (112 + 16) * 4},                 // layers x (d_c + d_R) x 4 bytes: 25%
      {"lrkv-r2-pair", 4 * 2 * (32 + 8 * 2) * 4},
      {"gdn", 0},                                   // constant state only
      {"natsl-hybrid", 8 * (24 + 24) * 4}};         // one NAtS-L layer, every block kept (budget 1): HA (KA + VA) x 4 bytes
  ASSERT_EQ(r.arms.size(), want.size());
  for (const auto& a : r.arms) {
    EXPECT_DOUBLE_EQ(a.metrics["kv_bytes_per_token"].get<double>(), want.at(a.name)) << a.name;
    EXPECT_DOUBLE_EQ(a.metrics["kv_pct_of_mha"].get<double>(), 100 * want.at(a.name) / 8192) << a.name;
  }
  // GDN's state (H = 4 heads of K = V = 48, plus 3 convolution taps of q, k, v per layer) amortised at 4K.
  const double gdn_state = 4 * 4.0 * (4 * 48 * 48 + 3 * 4 * (3 * 48));
  for (const auto& a : r.arms)
    if (a.name == "gdn") {
      EXPECT_DOUBLE_EQ(a.metrics["state_bytes"].get<double>(), gdn_state);
      EXPECT_DOUBLE_EQ(a.metrics["kv_state_bytes_per_token@4K"].get<double>(), gdn_state / 4096);
    }
  fs::remove_all(o.out_dir);
}

TEST(Compare, ArmKeysFollowTheConfigAndNothingElse) {
  auto e = compare::builtin_experiment("arch", "tiny");
  const auto base = compare::arm_run_config(e, compare::find_arm(e, "mha"));
  const std::string key = compare::train_arm_key(base);
  auto moved = base;
  moved.data.data_dir = "/elsewhere";
  EXPECT_EQ(compare::train_arm_key(moved), key);
  auto renamed = base;
  renamed.name = "other";
  EXPECT_EQ(compare::train_arm_key(renamed), key);
  for (auto change : std::vector<std::function<void(train::RunConfig&)>>{
           [](train::RunConfig& c) { c.train.steps += 1; }, [](train::RunConfig& c) { c.train.lr *= 2; },
           [](train::RunConfig& c) { c.train.seed += 1; }, [](train::RunConfig& c) { c.model.num_key_value_heads = 4; },
           [](train::RunConfig& c) { c.data.mqar_fraction = 0; }}) {
    auto c = base;
    change(c);
    EXPECT_NE(compare::train_arm_key(c), key);
  }
  // posthoc's base and arch's mha are the same model.
  auto p = compare::builtin_experiment("posthoc", "tiny");
  EXPECT_EQ(compare::train_arm_key(compare::arm_run_config(p, compare::find_arm(p, "mha"))), key);
}

TEST(Compare, ConvertArmConvertsHealsAndIsReused) {
  SyntheticData d;
  auto e = micro();
  e.groups = {"quality"};
  compare::select_arms(e, {"mha+f32"});  // keeps its base
  ASSERT_EQ(e.arms.size(), 2u);
  e.arms.push_back({"mha->lrkv-r8", "convert", {{"base", "mha"}, {"rank", 8}, {"rope", "expand"}, {"heal_steps", 2}}});
  auto o = d.options("convert");
  auto first = compare::run_experiment(e, o);
  ASSERT_EQ(first.arms.size(), 3u);
  const auto& conv = first.arms[2];
  EXPECT_TRUE(conv.metrics.contains("test_ce"));
  EXPECT_DOUBLE_EQ(conv.metrics["kv_bytes_per_token"].get<double>(), 2 * 2 * (32 + 4 * 8) * 4.0);  // layers x 2 (d_h + H r) x 4
  const std::string dir = o.out_dir + "/arms/" + conv.key;
  EXPECT_TRUE(fs::exists(dir + "/report.json"));
  EXPECT_TRUE(fs::exists(dir + "/converted/config.json"));
  EXPECT_FALSE(train::latest_checkpoint(dir + "/heal").empty());
  const auto report_time = fs::last_write_time(dir + "/report.json");
  auto second = compare::run_experiment(e, o);  // nothing redone
  EXPECT_EQ(fs::last_write_time(dir + "/report.json"), report_time);
  EXPECT_EQ(second.arms[2].metrics, conv.metrics);
  EXPECT_THROW(compare::select_arms(e, {"nope"}), Error);
  fs::remove_all(o.out_dir);
}

TEST(Compare, ResumesWithoutRedoingFinishedArmsAndReportsEveryArm) {
  SyntheticData d;
  auto e = micro();
  auto o = d.options("resume");
  auto first = compare::run_experiment(e, o);
  ASSERT_EQ(first.arms.size(), 6u);
  for (const auto& a : first.arms) {
    EXPECT_TRUE(a.metrics.contains("test_ce")) << a.name;
    EXPECT_TRUE(a.metrics.contains("mqar@4")) << a.name;
    EXPECT_EQ(a.metrics.contains("kl_vs_reference"), a.kind == "posthoc") << a.name;
  }
  // The f32 fused cache reproduces the uncached model.
  EXPECT_NEAR(first.arms[1].metrics["kl_vs_reference"].get<double>(), 0.0, 1e-6);

  const std::string mha_dir = o.out_dir + "/arms/" + first.arms[0].key;
  const std::string mqa_dir = o.out_dir + "/arms/" + first.arms[4].key;
  ASSERT_NE(first.arms[0].key, first.arms[4].key);
  const auto mha_time = fs::last_write_time(train::latest_checkpoint(mha_dir) + "/model.safetensors");
  // As if killed while the MQA arm trained: it lost its last checkpoint and metrics.
  for (const auto& f : fs::directory_iterator(mqa_dir))
    if (f.path().filename().string().rfind("metrics-", 0) == 0) fs::remove(f.path());
  fs::remove_all(mqa_dir + "/ckpt-00000006");
  io::write_file_atomic(mqa_dir + "/LATEST", "ckpt-00000003\n");

  auto second = compare::run_experiment(e, o);
  EXPECT_EQ(fs::last_write_time(train::latest_checkpoint(mha_dir) + "/model.safetensors"), mha_time);
  EXPECT_TRUE(fs::exists(mqa_dir + "/ckpt-00000006"));
  for (size_t i = 0; i < first.arms.size(); ++i)
    if (i != 4) EXPECT_EQ(second.arms[i].metrics, first.arms[i].metrics) << first.arms[i].name;
  // Resumed training is exact, so even the redone arm agrees.
  EXPECT_NEAR(second.arms[4].metrics["test_ce"].get<double>(), first.arms[4].metrics["test_ce"].get<double>(), 1e-9);

  auto table = compare::write_report(second);
  const std::string report = io::read_file(second.dir + "/report.md");
  for (const auto& a : second.arms) {
    EXPECT_NE(table.find("| " + a.name + " |"), std::string::npos) << a.name;
    EXPECT_NE(report.find("| " + a.name + " |"), std::string::npos) << a.name;
  }
  auto results = nlohmann::json::parse(io::read_file(second.dir + "/results.json"));
  EXPECT_EQ(results["arms"].size(), second.arms.size());
  fs::remove_all(o.out_dir);
}

TEST(Compare, NatslArmReportsTheRoutesItTookAndTheirHeatMap) {
  SyntheticData d;
  auto e = micro();
  e.arms = {{"natsl", "train",
             {{"model", {{"layout", "natsl"}, {"linear_num_heads", 2}, {"linear_key_head_dim", 16},
                         {"linear_value_head_dim", 16}, {"nats_attention_heads", 4}, {"nats_block_size", 8}}}}}};
  e.groups = {"quality"};
  auto o = d.options("natsl_arm");
  auto r = compare::run_experiment(e, o);
  ASSERT_EQ(r.arms.size(), 1u);
  const auto& a = r.arms[0];
  ASSERT_FALSE(a.routing.is_null());
  EXPECT_EQ(a.routing["layers"].size(), 2u);
  EXPECT_EQ(a.routing["softmax_fraction"][0].size(), 2u);  // two head groups
  const double f = a.metrics["softmax_fraction"].get<double>();
  EXPECT_GE(f, 0.0);
  EXPECT_LE(f, 1.0);
  // Kept KV per token at the measured fractions: per layer HA (KA + VA) x 4 bytes x its fraction.
  double want = 0;
  for (const auto& layer : a.routing["softmax_fraction"]) {
    double mean = 0;
    for (double x : layer) mean += x / layer.size();
    want += 4 * (8 + 8) * 4 * mean;
  }
  EXPECT_NEAR(a.metrics["kv_bytes_per_token"].get<double>(), want, 1e-9);
  compare::write_report(r);
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) EXPECT_TRUE(fs::exists(r.dir + "/routing-natsl.png"));
  fs::remove_all(o.out_dir);
}

TEST(Compare, DocumentExperimentFitsServesAndReportsEveryArm) {
  SyntheticData d;
  auto e = compare::builtin_experiment("doc", "tiny");
  EXPECT_EQ(e.arms.size(), 1u + 2 * (2 + 2 * 3 * 3));  // mha; per document: full, none, 2 archs x 3 rho x 3 losses
  EXPECT_EQ(e.base.train.seq_len, e.base.model.max_position_embeddings);
  auto& m = e.base.model;
  m.vocab_size = 256, m.hidden_size = 32, m.num_hidden_layers = 2, m.num_attention_heads = 4, m.num_key_value_heads = 2;
  m.head_dim = 16, m.intermediate_size = 48, m.max_position_embeddings = 128;
  e.arms[0].spec["model"]["num_key_value_heads"] = 2;  // GQA: modules shared by query-head pairs
  auto& t = e.base.train;
  t.steps = 4, t.batch_size = 2, t.seq_len = 64, t.eval_every = 4, t.eval_batches = 1, t.checkpoint_every = 4;
  e.base.data.mqar_max_pairs = 4;
  auto& s = e.document;
  s.queries = 16, s.query_length = 16, s.steps = 3, s.batch = 4, s.prompt_tokens = 4, s.new_tokens = 2, s.repeats = 1;
  auto o = d.options("doc");
  const std::string file = o.out_dir + "/story.txt";
  io::write_file_atomic(file, "the cat sat on a mat and the dog ran far. a dog sat on the mat and the cat ran far away.\n");
  {  // a missing document is reported before the base model trains
    auto missing = e;
    compare::use_document(missing, o.out_dir + "/no-such.txt");
    compare::select_arms(missing, {"no-such/full-document"});
    try {
      compare::run_experiment(missing, o);
      ADD_FAILURE() << "a missing document was accepted";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("no-such.txt"), std::string::npos) << err.what();
    }
    EXPECT_FALSE(fs::exists(o.out_dir + "/arms/" + compare::train_arm_key(compare::arm_run_config(missing, missing.arms[0])) +
                            "/LATEST"));
  }
  compare::use_document(e, file);
  compare::select_arms(e, {"story/full-document", "story/no-document", "story/mlp-10%-mixed", "story/quadrature-10%-kl"});
  ASSERT_EQ(e.arms.size(), 5u);
  const auto r = compare::run_experiment(e, o);
  std::map<std::string, nlohmann::json> by;
  for (const auto& a : r.arms) by[a.name] = a.metrics;
  EXPECT_NEAR(by["story/full-document"]["kl"].get<double>(), 0.0, 1e-6);
  EXPECT_GT(by["story/no-document"]["kl"].get<double>(), 1e-4);
  const double doc_kv = by["story/full-document"]["document_kv_bytes"].get<double>();
  EXPECT_DOUBLE_EQ(doc_kv, 2.0 * by["story/full-document"]["document_tokens"].get<double>() * 2 * 2 * 16 * 4);
  for (const std::string arm : {"story/mlp-10%-mixed", "story/quadrature-10%-kl"}) {
    const auto& a = by[arm];
    for (const auto* k : {"kl", "kl_challenge", "accuracy_gap", "content_mse", "ttft_ms", "ttft_ms_prefill", "ttft_ms_prefix",
                          "decode_tok_s", "state_bytes", "fit_s", "module_bytes"})
      EXPECT_TRUE(a.contains(k)) << arm << " " << k;
    EXPECT_LE(a["module_bytes"].get<double>(), 0.1 * doc_kv * 1.0001) << arm;
    // The module's request holds its weights and the request's own KV, not the document's.
    EXPECT_LT(a["state_bytes_module"].get<double>(), a["state_bytes_prefix"].get<double>()) << arm;
  }
  // Quadrature at 10%: p = floor(0.1 n) pairs of 2 d_h f32 each, per layer and KV head.
  const double n = by["story/full-document"]["document_tokens"].get<double>();
  EXPECT_DOUBLE_EQ(by["story/quadrature-10%-kl"]["module_bytes"].get<double>(), std::floor(0.1 * n) * 2 * 16 * 2 * 2 * 4);
  const auto again = compare::run_experiment(e, o);  // cached: nothing refitted, same numbers
  for (size_t i = 0; i < r.arms.size(); ++i) EXPECT_EQ(again.arms[i].metrics, r.arms[i].metrics) << r.arms[i].name;
  compare::write_report(again);
  const std::string report = io::read_file(again.dir + "/report.md");
  for (const auto& a : again.arms) EXPECT_NE(report.find("| " + a.name + " |"), std::string::npos) << a.name;
  if (std::system("command -v gnuplot >/dev/null 2>&1") == 0) EXPECT_TRUE(fs::exists(again.dir + "/doc-budget-story.png"));
  fs::remove_all(o.out_dir);
}

// Experiments change by JSON merge patches on their to_json() form (kvx.compare's patch).
TEST(Compare, PatchesChangeWhatTheyNameAndRefuseUnknownKeys) {
  for (const auto& name : compare::experiment_names()) {
    auto e = compare::builtin_experiment(name, "tiny");
    const auto before = e.to_json();
    const auto prefill = e.eval.prefill_contexts;
    compare::apply_patch(e, nlohmann::json::object());
    EXPECT_EQ(e.to_json(), before) << name;
    EXPECT_EQ(e.eval.prefill_contexts, prefill) << name;  // not in to_json: kept
  }
  auto e = compare::builtin_experiment("posthoc", "tiny");
  compare::apply_patch(e, {{"base", {{"train", {{"steps", 7}}}}}, {"eval", {{"capacity", {2048, 8}}}},
                           {"arms", {{{"name", "a"}, {"kind", "train"}, {"spec", {{"model", nlohmann::json::object()}}}}}}});
  EXPECT_EQ(e.base.train.steps, 7);
  EXPECT_EQ(e.eval.capacity_tokens, 2048);
  EXPECT_EQ(e.eval.capacity_mib, 8);
  ASSERT_EQ(e.arms.size(), 1u);
  EXPECT_EQ(e.arms[0].spec, (nlohmann::json{{"model", nlohmann::json::object()}}));
  EXPECT_EQ(e.base.model.hidden_size, compare::builtin_experiment("posthoc", "tiny").base.model.hidden_size);
  for (const auto& bad : {nlohmann::json{{"no_such_key", 1}}, nlohmann::json{{"eval", {{"test_windowz", 3}}}},
                          nlohmann::json{{"arms", {{{"kind", "train"}}}}}, nlohmann::json{{"base", {{"train", {{"steps", -1}}}}}},
                          nlohmann::json::array()})
    EXPECT_THROW(compare::apply_patch(e, bad), Error) << bad.dump();
  // Declarations that failed only after earlier arms had trained, or ran and reported nonsense,
  // are refused up front, naming the setting.
  const auto train_arm = nlohmann::json{{"name", "a"}, {"kind", "train"}, {"spec", {{"model", nlohmann::json::object()}}}};
  const std::vector<std::pair<nlohmann::json, std::string>> refused = {
      {{{"eval", {{"context_multiples", {0}}}}}, "context_multiples"},  // divided by zero
      {{{"eval", {{"test_windows", 0}}}}, "test_windows"},              // reported CE 0
      {{{"eval", {{"decode_contexts", {512, 768}}}}}, "multiples of 1024"},  // both named decode_tok_s@0K
      {{{"arms", nlohmann::json::array()}}, "no arms"},
      {{{"arms", {{{"name", "a"}, {"kind", "train"}}}}}, "needs \"model\""},
      {{{"arms", {train_arm, {{"name", "b"}, {"kind", "posthok"}, {"spec", {{"base", "a"}}}}}}}, "unknown kind 'posthok'"},
      {{{"arms", {train_arm, {{"name", "b"}, {"kind", "posthoc"}, {"spec", {{"base", "z"}}}}}}}, "no arm 'z'"},
      {{{"arms", {train_arm, train_arm}}}, "declared twice"},
      {{{"arms", {train_arm, {{"name", "c"}, {"kind", "lla"}, {"spec", {{"base", "a"}, {"budget", "4x"}, {"ranks", {16, 16}}}}}}}},
       "not both"},
      {{{"groups", {"qualty"}}}, "unknown metric group"}};
  for (const auto& [bad, words] : refused) {
    auto copy = e;
    try {
      compare::apply_patch(copy, bad);
      ADD_FAILURE() << "accepted " << bad.dump();
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(words), std::string::npos) << bad.dump() << ": " << err.what();
    }
  }
}
