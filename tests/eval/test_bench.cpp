// Whole-model decode speed runs for every mixer family and cache kind (random history).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "eval/bench.h"
#include "kernels/decode_attention.h"
#include "kernels/lrkv_decode.h"
#include "util/error.h"

using namespace kvx;

TEST(DecodeSpeed, EveryFamilyCanBeFilledAndTimed) {
  model::ModelConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.intermediate_size = 48;
  c.max_position_embeddings = 64;
  c.lrkv_rank = 32;
  c.kv_lora_rank = 48;
  c.qk_rope_head_dim = 16;
  for (const char* rope : {"expand", "pair_aligned"}) {
    c.layout = "dense,lrkv,mla";
    c.lrkv_rope = rope;
    for (const char* type : {"f32", "q8"}) {
      if (std::string(rope) == "expand" && std::string(type) != "f32") continue;  // expand decodes on the f32 reference cache
      const double tps = eval::decode_tokens_per_second(c, attention::CacheOptions::parse(type, "", false), 200, 0.01);
      EXPECT_TRUE(std::isfinite(tps) && tps > 0) << rope << " " << type;
    }
  }
  c.layout = "gdn,natsl,dense";
  c.linear_num_heads = 2;
  c.nats_attention_heads = 4;
  c.linear_key_head_dim = c.linear_value_head_dim = 64;
  c.nats_block_size = 16;
  for (const char* type : {"f32", "q8"}) {
    const double tps = eval::decode_tokens_per_second(c, attention::CacheOptions::parse(type, "", false), 200, 0.01);
    EXPECT_TRUE(std::isfinite(tps) && tps > 0) << "gdn/natsl " << type;
  }
}

TEST(DecodeBench, GdnAndNatslRowsAreMeasuredBesideTheDenseKernel) {
  eval::DecodeBenchOptions o;
  o.contexts = {256, 512};
  o.types = {"f32"};
  o.kv_heads = {4};
  o.heads = 4;
  o.head_dim = 32;
  o.lrkv_ranks = {};
  o.natsl_kept = {0.5};
  o.seconds_per_point = 0.01;
  o.whole_model = false;
  const auto rows = eval::bench_decode(o, false);
  int gdn = 0, natsl = 0;
  for (const auto& r : rows) {
    if (r.value("family", "") == "gdn") {
      ++gdn;
      EXPECT_GT(r["us_per_step"].get<double>(), 0);
      EXPECT_EQ(r["state_bytes"].get<int64_t>(), 4 * (2 * 64 * 64 + 3 * 2 * (3 * 64)));  // H = 2 heads of 64 x 64
    }
    if (r.value("family", "") == "natsl") {
      ++natsl;
      EXPECT_DOUBLE_EQ(r["kept_fraction"].get<double>(), 0.5);
      EXPECT_GT(r["speedup_vs_dense"].get<double>(), 0);  // the dense MHA kernel at the same shape was timed
      EXPECT_DOUBLE_EQ(r["target_speedup_vs_dense"].get<double>(), 1.6);
    }
  }
  EXPECT_EQ(gdn, 2);
  EXPECT_EQ(natsl, 2);
}

// Dense and LRKV kernels are timed in the same rounds, each judged against the probes either side of its calls in the
// round of its fastest call.
TEST(DecodeBench, LrkvRowsCompareWithTheDenseKernelOfTheirRounds) {
  eval::DecodeBenchOptions o;
  o.contexts = {256, 512};
  o.types = {"f32", "q8"};
  o.kv_heads = {4, 2};
  o.heads = 4;
  o.head_dim = 32;
  o.lrkv_ranks = {32, 8};  // r = 8: q8 blocks straddle heads, on the dense rows' back end
  o.gdn_rows = false;
  o.natsl_kept = {};
  o.lla_budgets = {};
  o.seconds_per_point = 0.01;
  o.whole_model = false;
  const auto rows = eval::bench_decode(o, false);
  double best_probe = 0;
  std::vector<double> probes;
  for (const auto& r : rows)
    if (r.contains("stream_probes_gbps")) {
      for (const auto& p : r["stream_probes_gbps"]) probes.push_back(p.get<double>());
      best_probe = *std::max_element(probes.begin(), probes.end());
      EXPECT_DOUBLE_EQ(r["stream_gbps"].get<double>(), best_probe);
      for (const char* key : {"thread_scalar_rates_start", "thread_scalar_rates_end"}) {  // one rate per thread
        ASSERT_TRUE(r.contains(key)) << key;
        EXPECT_EQ(r[key].size(), static_cast<size_t>(r["threads"].get<int>())) << key;
      }
      for (const char* key : {"thread_wake_us", "thread_wake_after_1ms_us"}) {  // 0 with one thread, else a positive time
        ASSERT_TRUE(r.contains(key)) << key;
        const double us = r[key].get<double>();
        EXPECT_TRUE(r["threads"].get<int>() == 1 ? us == 0.0 : std::isfinite(us) && us > 0.0) << key << " " << us;
      }
      EXPECT_TRUE(r.contains("omp_wait_policy"));
    }
  // One at the start; per context, one before its rounds and one after each kernel's calls in
  // each of 5 rounds (2 types x 2 Hkv dense kernels, 2 types x 2 ranks LRKV); a compute probe beside each.
  constexpr size_t kPerContext = 1 + 5 * 8;
  EXPECT_EQ(probes.size(), 1 + kPerContext * o.contexts.size());
  std::vector<double> compute;
  double compute_peak = 0;
  for (const auto& r : rows)
    if (r.contains("compute_probes_gmacs")) {
      for (const auto& p : r["compute_probes_gmacs"]) compute.push_back(p.get<double>());
      compute_peak = r["compute_peak_gmacs"].get<double>();
    }
  ASSERT_EQ(compute.size(), probes.size());
  ASSERT_GT(compute_peak, 0);
  // A row's probe is the better of the two around its calls: adjacent probes of its context.
  auto around_calls = [&](double probe, int64_t context, const std::vector<double>& of = {}) {
    const std::vector<double>& v = of.empty() ? probes : of;
    const size_t c = std::find(o.contexts.begin(), o.contexts.end(), context) - o.contexts.begin();
    for (size_t i = 1 + kPerContext * c; i + 1 < 1 + kPerContext * (c + 1); ++i)
      if (probe == std::max(v[i], v[i + 1])) return true;
    return false;
  };
  // Roofline: q8 scores count against the int8 dot-product peak, bf16 scores against the bf16
  // one (the f32 peak where the back end widens bf16), q8 values against the int16 one where the
  // back end weighs them in int16, the rest against the f32 one.
  struct Peaks {
    double f32, int8, int16;
  };
  std::map<std::string, Peaks> peaks;  // isa -> G MAC/s
  for (const auto& r : rows)
    if (r.contains("fma_peak_gmacs")) {
      peaks[r["isa"].get<std::string>()] = {r["fma_peak_gmacs"].get<double>(), r["int8_dot_peak_gmacs"].get<double>(),
                                            r["int16_dot_peak_gmacs"].get<double>()};
      EXPECT_GT(r["int8_dot_peak_gmacs"].get<double>(), 0);
      const auto isa = kernels::parse_decode_isa(r["isa"].get<std::string>());
      if (kernels::decode_dots_bf16(isa))
        EXPECT_GT(r["bf16_dot_peak_gmacs"].get<double>(), 0);
      else
        EXPECT_EQ(r["bf16_dot_peak_gmacs"].get<double>(), r["fma_peak_gmacs"].get<double>());
      if (kernels::decode_weighs_values_in_int16(isa, kernels::KVType::Q8))
        EXPECT_GT(r["int16_dot_peak_gmacs"].get<double>(), 0);
      else
        EXPECT_EQ(r["int16_dot_peak_gmacs"].get<double>(), r["fma_peak_gmacs"].get<double>());
    }
  auto roof_us = [](const nlohmann::json& r) { return std::max(r["bw_floor_us"].get<double>(), r["fma_floor_us"].get<double>()); };
  int lrkv = 0, dense = 0;
  for (const auto& r : rows) {
    if (!r.contains("us_per_step") || (r.contains("family") && r["family"] != "lrkv")) continue;
    const Peaks peak = peaks.at(r["isa"].get<std::string>());
    const double macs = r["macs"].get<double>(), rows_scored = 4.0 * r["context"].get<int64_t>();  // heads x rows
    // q8: K_s (d_h 32) in int8, the latents too where the kernel scores them so (else f32)
    const int rank = r.value("rank", 0);
    const bool int8_latents = rank > 0 && kernels::lrkv_latent_scores_in_int8(kernels::parse_decode_isa(r["isa"].get<std::string>()),
                                                                              kernels::KVType::Q8, rank);
    const double int8_macs = r["cache"] == "q8" ? rows_scored * (32 + (int8_latents ? rank : 0)) : 0.0;
    // q8/q4 values (V_s for LRKV) in int16 where the back end weighs them so
    const bool int16_values = kernels::decode_weighs_values_in_int16(kernels::parse_decode_isa(r["isa"].get<std::string>()),
                                                                     kernels::parse_kv_type(r["cache"].get<std::string>()));
    const double int16_macs = int16_values ? rows_scored * 32 : 0.0;
    EXPECT_EQ(macs, 2 * rows_scored * (32 + rank));
    // the peaks scaled by the compute probe around the row's fastest call
    const double cpu = r["compute_ratio"].get<double>();
    EXPECT_TRUE(around_calls(r["compute_probe_gmacs"].get<double>(), r["context"].get<int64_t>(), compute)) << r.dump();
    EXPECT_DOUBLE_EQ(cpu, std::min(1.0, r["compute_probe_gmacs"].get<double>() / compute_peak));
    EXPECT_GT(cpu, 0);
    const double fma_us =
        (int8_macs / peak.int8 + int16_macs / peak.int16 + (macs - int8_macs - int16_macs) / peak.f32) / 1e3 / cpu;
    EXPECT_NEAR(r["fma_floor_us"].get<double>(), fma_us, 1e-9 * fma_us) << r.dump();
    EXPECT_NEAR(r["of_roofline"].get<double>(), roof_us(r) / r["us_per_step"].get<double>(), 1e-9) << r.dump();
    const double probe = r["probe_gbps"].get<double>();
    EXPECT_GT(probe, 0);
    EXPECT_TRUE(around_calls(probe, r["context"].get<int64_t>())) << r.dump();
    EXPECT_NEAR(r["bw_ratio"].get<double>(), r["gbps"].get<double>() / probe, 1e-9);
    if (r.value("family", "") != "lrkv") {
      ++dense;
      continue;
    }
    ++lrkv;
    double mha_us = 0;
    std::string mha_isa;
    for (const auto& d : rows)
      if (!d.contains("family") && d.contains("hkv") && d["hkv"] == 4 && d["cache"] == r["cache"] && d["context"] == r["context"]) {
        mha_us = d["us_per_step"].get<double>();
        mha_isa = d["isa"].get<std::string>();
      }
    ASSERT_GT(mha_us, 0) << r.dump();
    EXPECT_NEAR(r["speedup_vs_mha"].get<double>(), mha_us / r["us_per_step"].get<double>(), 1e-9);
    EXPECT_NEAR(r["roofline_speedup_vs_mha"].get<double>(), mha_us / roof_us(r), 1e-9 * mha_us / roof_us(r));
    EXPECT_EQ(r["isa"], mha_isa) << r.dump();
  }
  EXPECT_EQ(dense, 2 * 2 * 2);  // types x Hkv x contexts
  EXPECT_EQ(lrkv, 2 * 2 * 2);   // types x contexts x ranks
}

namespace {
// The rows of a quick bench decode run (64 tokens, H = 16, d_h = 32, LRKV r = 8) of one cache type
// that carry a store layout, with `set` applied to the options.
std::vector<nlohmann::json> layout_rows(const std::string& type, std::vector<int> kv_heads,
                                        const std::function<void(eval::DecodeBenchOptions&)>& set) {
  eval::DecodeBenchOptions o;
  o.contexts = {64};
  o.types = {type};
  o.kv_heads = std::move(kv_heads);
  o.heads = 16;
  o.head_dim = 32;
  o.lrkv_ranks = {8};
  o.gdn_rows = false;
  o.natsl_kept = {};
  o.lla_budgets = {};
  o.seconds_per_point = 0.005;
  o.whole_model = false;
  set(o);
  std::vector<nlohmann::json> rows;
  for (const auto& r : eval::bench_decode(o, false))
    if (r.contains("layout") && r.contains("hkv")) rows.push_back(r);
  return rows;
}
}  // namespace

// Each row names its store layout: bf16 dense stores as decode_kv_layout picks for their group
// (Tiled16 for 1 query a KV head where AVX-512 dots bf16, rows for 16), --bf16-layout forcing rows
// or (where the back end reads it) tiled16, LRKV's K_s / V_s always rows; q4 stores (as q8's), LRKV's
// K_s / V_s too, as decode_kv_layout picks, or rows with --q4-layout rows.
TEST(DecodeBench, RowsNameTheirStoreLayout) {
  const auto isa = kernels::resolve_decode_isa(kernels::DecodeIsa::Auto, 32);
  for (const std::string forced : {"auto", "rows", "tiled16"}) {
    const auto rows = layout_rows("bf16", {16, 1}, [&](eval::DecodeBenchOptions& o) { o.bf16_layout = forced; });
    for (const auto& r : rows) {
      const int group = 16 / r["hkv"].get<int>();
      const auto want = r.contains("rank") || forced == "rows" ? kernels::KVLayout::Rows
                        : forced == "tiled16" ? (kernels::decode_reads_tiled16(isa, kernels::KVType::BF16, group) ? kernels::KVLayout::Tiled16
                                                                                                                  : kernels::KVLayout::Rows)
                                              : kernels::decode_kv_layout(kernels::KVType::BF16, 32, false, kernels::DecodeIsa::Auto, group);
      EXPECT_EQ(r["layout"].get<std::string>(), kernels::kv_layout_name(want)) << r.dump();
    }
    EXPECT_EQ(rows.size(), 3u) << forced;  // Hkv 16 and 1, LRKV r = 8
  }
  for (const std::string forced : {"auto", "rows"}) {
    const auto rows = layout_rows("q4", {4}, [&](eval::DecodeBenchOptions& o) { o.q4_layout = forced; });
    const auto want = forced == "rows" ? kernels::KVLayout::Rows : kernels::decode_kv_layout(kernels::KVType::Q4, 32);
    for (const auto& r : rows) EXPECT_EQ(r["layout"].get<std::string>(), kernels::kv_layout_name(want)) << r.dump();
    EXPECT_EQ(rows.size(), 2u) << forced;  // Hkv 4, LRKV r = 8
  }
}

// Options that name no measurement are refused before anything runs, naming the option.
TEST(DecodeBench, RefusesOptionsThatNameNoMeasurement) {
  auto refuses = [](auto edit, const std::string& what) {
    eval::DecodeBenchOptions o;
    edit(o);
    try {
      eval::bench_decode(o, false);
      ADD_FAILURE() << "accepted " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refuses([](eval::DecodeBenchOptions& o) { o.contexts = {1024, 0}; }, "--contexts");
  refuses([](eval::DecodeBenchOptions& o) { o.kv_heads = {3}; }, "--hkv 3");
  refuses([](eval::DecodeBenchOptions& o) { o.kv_heads = {0}; }, "--hkv 0");
  refuses([](eval::DecodeBenchOptions& o) { o.lrkv_ranks = {0}; }, "--lrkv rank 0");
  refuses([](eval::DecodeBenchOptions& o) { o.lrkv_ranks = {129}; }, "--lrkv rank 129");
  // checked before any probe or timing runs
  refuses([](eval::DecodeBenchOptions& o) { o.contexts.clear(); }, "--contexts is empty");
  refuses([](eval::DecodeBenchOptions& o) { o.contexts = {4096, 1024}; }, "must be increasing");
  refuses([](eval::DecodeBenchOptions& o) { o.types.clear(); }, "--types is empty");
  refuses([](eval::DecodeBenchOptions& o) { o.types = {"f32", "q9"}; }, "unknown KV cache type 'q9'");
  refuses([](eval::DecodeBenchOptions& o) { o.seconds_per_point = std::numeric_limits<double>::infinity(); }, "--seconds");
  refuses([](eval::DecodeBenchOptions& o) { o.seconds_per_point = 0; }, "--seconds");
  refuses([](eval::DecodeBenchOptions& o) { o.lla_budgets = {1000}; }, "--lla 1000x");
  refuses([](eval::DecodeBenchOptions& o) { o.lrkv_ranks = {1}; }, "--lrkv rank 1 with a q8 cache");
  refuses([](eval::DecodeBenchOptions& o) { o.isas = {"neon"}; }, "neon");
  refuses([](eval::DecodeBenchOptions& o) { o.q8_layout = "tiled8"; }, "unknown KV store layout 'tiled8'; valid: rows, tiled16");
  refuses([](eval::DecodeBenchOptions& o) { o.q4_layout = "tiles"; }, "unknown KV store layout 'tiles'; valid: rows, tiled16");
  refuses([](eval::DecodeBenchOptions& o) { o.bf16_layout = "tiled"; }, "unknown KV store layout 'tiled'; valid: rows, tiled16");
}
