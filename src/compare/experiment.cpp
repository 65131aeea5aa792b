#include "compare/experiment.h"

#include <cmath>
#include <algorithm>
#include <filesystem>
#include <set>

#include "io/json_config.h"
#include "text/corpus.h"
#include "util/error.h"

namespace kvx::compare {

// Bump when a change to kvx alters what an arm's training produces (kHarnessVersion) or what
// its metrics measure (kMetricsVersion; 2: q8/q4 decode may quantise the query, LRKV/MLA arms).
constexpr int kHarnessVersion = 1;
constexpr int kMetricsVersion = 2;

nlohmann::json EvalSettings::to_json() const {
  nlohmann::json j = {{"test_windows", test_windows},     {"context_multiples", context_multiples},
          {"long_context_tokens", long_context_tokens}, {"mqar_pairs", mqar_pairs},
          {"mqar_sequences", mqar_sequences}, {"decode_contexts", decode_contexts},
          {"decode_seconds", decode_seconds}};
  if (capacity_tokens > 0) j["capacity"] = {capacity_tokens, capacity_mib};  // absent when off: older keys stay valid
  return j;
}

nlohmann::json Experiment::to_json() const {
  nlohmann::json arms_json = nlohmann::json::array();
  for (const auto& a : arms) arms_json.push_back({{"name", a.name}, {"kind", a.kind}, {"spec", a.spec}});
  nlohmann::json j = {{"name", name},           {"preset", preset}, {"base", base.to_json()},
                      {"eval", eval.to_json()}, {"groups", groups}, {"arms", arms_json}};
  if (name == "doc") j["document"] = document.to_json();
  return j;
}

nlohmann::json DocumentSettings::to_json() const {
  return {{"queries", queries},       {"query_length", query_length}, {"steps", steps},
          {"batch", batch},           {"lr", lr},                     {"max_tokens", max_tokens},
          {"prompt_tokens", prompt_tokens}, {"new_tokens", new_tokens}, {"repeats", repeats}};
}

std::vector<std::string> experiment_names() { return {"arch", "posthoc", "decode", "doc"}; }
std::vector<std::string> preset_names() { return {"tiny", "small"}; }

namespace {

train::RunConfig base_config(const std::string& preset) {
  train::RunConfig c;
  auto& m = c.model;
  auto& t = c.train;
  m.vocab_size = 4096;
  m.layout = "dense";
  c.data.mqar_fraction = 0.25;
  c.data.mqar_max_pairs = 16;
  t.seq_len = 128;
  t.batch_size = 16;
  t.warmup = 20;
  t.lr = 2e-3;
  t.log_every = 10;
  if (preset == "tiny") {
    // A few minutes per arm on 2 cores; H = 8 so GQA can take H/2 and H/4.
    c.name = "compare-tiny";
    m.hidden_size = 256;
    m.num_hidden_layers = 4;
    m.num_attention_heads = 8;
    m.num_key_value_heads = 8;
    m.head_dim = 32;
    m.intermediate_size = 768;
    m.max_position_embeddings = 512;  // 4x the training context, for the long-context metric
    t.steps = 400;
    t.eval_every = 100;
    t.checkpoint_every = 100;
  } else if (preset == "small") {
    c.name = "compare-small";
    m.hidden_size = 384;
    m.num_hidden_layers = 6;
    m.num_attention_heads = 8;
    m.num_key_value_heads = 8;
    m.head_dim = 64;
    m.intermediate_size = 1024;
    m.max_position_embeddings = 1024;
    t.seq_len = 256;
    t.steps = 1500;
    t.eval_every = 250;
    t.checkpoint_every = 100;
  } else {
    throw Error("unknown compare preset '" + preset + "' (valid: tiny, small)");
  }
  c.validate();
  return c;
}

}  // namespace

Experiment builtin_experiment(const std::string& name, const std::string& preset) {
  Experiment e;
  e.name = name;
  e.preset = preset;
  e.base = base_config(preset);
  if (preset == "small") {
    e.eval.test_windows = 128;
    e.eval.long_context_tokens = 8192;
    e.eval.mqar_pairs = {1, 2, 4, 8, 16, 32, 48};
  }
  e.groups = {"quality", "mqar", "decode"};
  if (name == "arch") e.eval.prefill_contexts = {1024, 4096, 16384};
  const int H = e.base.model.num_attention_heads;
  auto dense = [&](const std::string& arm, int kv_heads) {
    return Arm{arm, "train", {{"model", {{"num_key_value_heads", kv_heads}}}}};
  };
  const int dh = e.base.model.head_dim;
  // MLA at about 25% of MHA's cache: d_c + d_R = H d_h / 2, d_R = d_h / 2.
  const Arm mla{"mla", "train",
                {{"model", {{"layout", "mla"}, {"kv_lora_rank", H * dh / 2 - dh / 2}, {"qk_rope_head_dim", dh / 2}}}}};
  auto lrkv = [&](int rank, const std::string& rope) {
    const std::string label = rope == "shared_rope" ? "shared" : rope == "pair_aligned" ? "pair" : rope;
    return Arm{"lrkv-r" + std::to_string(rank) + "-" + label, "train",
               {{"model", {{"layout", "lrkv"}, {"lrkv_rank", rank}, {"lrkv_rope", rope}}}}};
  };
  // GDN and NAtS-L at about MHA's mixer parameters: H/2 GDN heads of K = V = 3 d_h / 2 (q, k, v,
  // gate and output projections of width 3 H d_h / 4 each, vs MHA's four of H d_h); NAtS-L splits
  // each GDN head into 2 softmax heads (H in all, as the seed's 380M model) and routes blocks of
  // seq_len / 8 tokens (the seed's 64-token blocks are 1/64 of its 4K context).
  auto linear = [&](const std::string& arm, const std::string& layout) {
    return Arm{arm, "train",
               {{"model", {{"layout", layout}, {"linear_num_heads", H / 2}, {"linear_key_head_dim", 3 * dh / 2},
                           {"linear_value_head_dim", 3 * dh / 2}, {"nats_attention_heads", H},
                           {"nats_block_size", std::max(1, e.base.train.seq_len / 8)}}}}};
  };
  const int L = e.base.model.num_hidden_layers;
  const std::string every_fourth = "gdn*" + std::to_string(L - 1) + ",";  // hybrids: the last of 4 layers differs
  if (name == "arch") {
    e.arms = {dense("mha", H), dense("gqa-h2", H / 2), dense("gqa-h4", H / 4), dense("mqa", 1), mla};
    for (const char* rope : {"expand", "shared_rope", "pair_aligned"})  // ranks d_h/16 .. d_h/2 in each RoPE mode
      for (int div : {16, 8, 4, 2}) e.arms.push_back(lrkv(dh / div, rope));
    e.arms.push_back(linear("gdn", "gdn"));
    e.arms.push_back(linear("gdn-hybrid", every_fourth + "dense"));
    e.arms.push_back(linear("natsl", "natsl"));
    e.arms.push_back(linear("natsl-hybrid", every_fourth + "natsl"));
  } else if (name == "posthoc") {
    e.arms.push_back(dense("mha", H));
    for (const char* t : {"f32", "bf16", "q8", "q4"})
      e.arms.push_back({std::string("mha+") + t, "posthoc", {{"base", "mha"}, {"kv_cache", t}, {"evict", ""}}});
    const int L = e.base.train.seq_len;
    for (int window : {L / 4 - 4, L / 2 - 4})
      e.arms.push_back({"mha+sink4-w" + std::to_string(window), "posthoc",
                        {{"base", "mha"}, {"kv_cache", "f32"}, {"evict", "sink=4,window=" + std::to_string(window)}}});
    e.arms.push_back({"mha+q8+sink4-w" + std::to_string(L / 2 - 4), "posthoc",
                      {{"base", "mha"}, {"kv_cache", "q8"}, {"evict", "sink=4,window=" + std::to_string(L / 2 - 4)}}});
    // The trained MHA model converted to LRKV (d_h/4, expand) and healed (kvx convert lrkv).
    e.arms.push_back({"mha->lrkv-r" + std::to_string(dh / 4), "convert",
                      {{"base", "mha"}, {"rank", dh / 4}, {"rope", "expand"}, {"heal_steps", e.base.train.steps / 4}}});
    // Looped models (SPEC 1.3, experiment 2): a looped teacher (half the layers, run 4 times, sandwich
    // norms) and its cache at matched persistent budgets: LLA per-head codes at 1.33x..16x, LLA-2D,
    // the head codec (one code per loop across heads), final-loop reuse, KV quantization, LLA with
    // eviction and the absorbed read; ablations of the distilled 16x codec.
    const int T = 4;
    // The teacher: the tiny-looped preset's shape (2 layers x 4 loops of d 384, 6 heads of d_h 64,
    // sandwich norms) for 1.5x the base steps. In the base shape (d 256, 8 heads of 32) looped models
    // stayed near the unigram plateau here (validation CE 6.27 after 1000 steps, unigram 6.50), and
    // a teacher that barely uses attention would make every codec look lossless.
    Arm looped{"looped", "train", {{"model", {{"num_hidden_layers", 2}, {"loops", T}, {"sandwich_norm", true},
                                              {"hidden_size", 384}, {"num_attention_heads", 6}, {"num_key_value_heads", 6},
                                              {"head_dim", 64}, {"intermediate_size", 1024}}}}};
    looped.spec["train"] = {{"steps", e.base.train.steps * 3 / 2}};
    e.arms.push_back(looped);
    for (const char* t : {"q8", "q4"})
      e.arms.push_back({std::string("looped+") + t, "posthoc", {{"base", "looped"}, {"kv_cache", t}, {"evict", ""}}});
    e.arms.push_back({"looped+cla-2x", "posthoc", {{"base", "looped"}, {"kv_cache", "f32"}, {"evict", ""}, {"share_kv_layers", 2}}});
    auto lla = [&](const std::string& name, const std::string& variant, const std::string& budget, nlohmann::json extra = {}) {
      nlohmann::json spec = {{"base", "looped"}, {"variant", variant}, {"budget", budget}, {"steps", 0}};
      if (variant == "final_loop") spec.erase("budget");
      if (!extra.is_null()) spec.update(extra);
      e.arms.push_back({name, "lla", spec});
    };
    for (const char* b : {"1.33x", "2x", "4x", "8x", "16x"}) lla(std::string("lla-") + b, "head", b);
    for (const char* b : {"4x", "16x"}) {
      lla(std::string("lla2d-") + b, "2d", b);
      lla(std::string("head-codec-") + b, "loop_head", b);
    }
    lla("final-loop-4x", "final_loop", "");
    lla("lla-4x+sink4-w" + std::to_string(L / 2 - 4), "head", "4x", {{"evict", "sink=4,window=" + std::to_string(L / 2 - 4)}});
    lla("lla-4x-absorbed", "head", "4x", {{"absorbed", true}});
    const int distill = e.base.train.steps / 4;
    lla("lla-16x-distilled", "head", "16x", {{"steps", distill}});
    lla("lla-16x-distilled-random-init", "head", "16x", {{"steps", distill}, {"init", "random"}});
    lla("lla-16x-distilled-kl-only", "head", "16x", {{"steps", distill}, {"attention_weight", 0.0}});
    lla("lla-16x-distilled-on-policy", "head", "16x", {{"steps", distill}, {"on_policy", true}});
    const int equal = 2 * T * 64 / 16 / 2;  // r_k = r_v at 16x (the teacher's d_h = 64)
    lla("lla-16x-distilled-equal-ranks", "head", "", {{"steps", distill}, {"ranks", {equal, equal}}});
    e.arms.back().spec.erase("budget");
    e.eval.capacity_tokens = 4096;
    e.groups.push_back("capacity");
  } else if (name == "decode") {
    e.arms = {dense("mha", H), dense("gqa-h2", H / 2), dense("gqa-h4", H / 4), dense("mqa", 1), mla, lrkv(dh / 4, "pair_aligned"),
              linear("gdn", "gdn")};
    // NAtS-L with random weights keeps what its budget allows: a 25% KV budget.
    Arm natsl = linear("natsl-kv25", "natsl");
    natsl.spec["model"]["nats_max_softmax_fraction"] = 0.25;
    e.arms.push_back(natsl);
    for (const char* t : {"bf16", "q8", "q4"})
      e.arms.push_back({std::string("mha+") + t, "posthoc", {{"base", "mha"}, {"kv_cache", t}, {"evict", ""}}});
    e.eval.decode_contexts = {1024, 4096, 16384, 65536};
    e.groups = {"decode"};  // speed only: random weights of each arm's shapes, nothing to train
  } else if (name == "doc") {
    // Nectar (SPEC 1.4, experiment 3): one MHA model trained on windows as long as its context, so
    // a document plus queries sits at trained positions; per document, MLP and Quadrature modules
    // at rho 2/5/10% with three objectives, between the exact document and none.
    auto& t = e.base.train;
    const int tokens_per_step = t.batch_size * t.seq_len;  // kept, in windows as long as the context
    t.seq_len = e.base.model.max_position_embeddings = preset == "tiny" ? 1024 : 2048;
    t.batch_size = std::max(1, tokens_per_step / t.seq_len);
    e.arms = {dense("mha", H)};
    for (const std::string doc : {"kjv", "brown"}) {
      for (const std::string mode : {"full", "none"})
        e.arms.push_back({doc + "/" + (mode == "full" ? "full-document" : "no-document"), "document",
                          {{"base", "mha"}, {"document", doc}, {"mode", mode}}});
      for (const std::string arch : {"mlp", "quadrature"})
        for (const double rho : {0.02, 0.05, 0.10})
          for (const std::string loss : {"reg", "mixed", "kl"})
            e.arms.push_back({doc + "/" + arch + "-" + std::to_string(static_cast<int>(std::lround(rho * 100))) + "%-" + loss,
                              "nectar", {{"base", "mha"}, {"document", doc}, {"arch", arch}, {"rho", rho}, {"loss", loss}}});
    }
    if (preset == "small") e.document.max_tokens = 1800, e.document.steps = 400;
    e.groups = {"document"};
  } else {
    std::string valid;
    for (const auto& n : experiment_names()) valid += (valid.empty() ? "" : ", ") + n;
    throw Error("unknown experiment '" + name + "' (valid: " + valid + ")");
  }
  return e;
}

train::RunConfig arm_run_config(const Experiment& e, const Arm& arm) {
  if (arm.kind != "train") throw Error("arm '" + arm.name + "' is not a train arm");
  nlohmann::json j = e.base.to_json();
  j["name"] = e.base.name + "-" + arm.name;
  for (auto it = arm.spec.at("model").begin(); it != arm.spec.at("model").end(); ++it) j["model"][it.key()] = it.value();
  if (arm.spec.contains("train"))  // per-arm training overrides (e.g. more steps)
    for (auto it = arm.spec.at("train").begin(); it != arm.spec.at("train").end(); ++it) j["train"][it.key()] = it.value();
  return train::RunConfig::from_json(j);
}

std::vector<std::string> demo_arms(const std::string& experiment) {
  if (experiment == "arch") return {"mha", "gqa-h2", "gqa-h4", "mqa", "mla", "lrkv-r8-pair"};
  if (experiment == "doc")  // one document, the mixed objective at 5%, and the two ends
    return {"kjv/full-document", "kjv/no-document", "kjv/mlp-5%-mixed", "kjv/quadrature-5%-mixed"};
  if (experiment == "posthoc") {  // the MHA transforms; the looped-model arms take another half hour
    std::vector<std::string> names;
    for (const auto& a : builtin_experiment(experiment, "tiny").arms)
      if (a.name != "looped" && a.spec.value("base", "") != "looped") names.push_back(a.name);
    return names;
  }
  return {};  // every arm
}

void select_arms(Experiment& e, const std::vector<std::string>& names) {
  if (names.empty()) return;
  std::vector<Arm> kept;
  auto keep = [&](const std::string& n) {
    for (const auto& a : kept)
      if (a.name == n) return;
    kept.push_back(find_arm(e, n));
  };
  for (const auto& n : names) {
    const Arm& a = find_arm(e, n);  // unknown names: a clear error listing nothing silently
    if (a.spec.contains("base")) keep(a.spec.at("base").get<std::string>());  // what it is derived from
    keep(n);
  }
  e.arms = kept;
}

attention::CacheOptions arm_cache(const Arm& arm) {
  if (arm.kind == "lla") {
    auto o = attention::CacheOptions::parse("f32", arm.spec.value("evict", ""), false);
    o.lla_absorbed = arm.spec.value("absorbed", false);
    return o;
  }
  if (arm.kind != "posthoc") return {};
  auto o = attention::CacheOptions::parse(arm.spec.value("kv_cache", "f32"), arm.spec.value("evict", ""), false);
  o.share_kv_layers = arm.spec.value("share_kv_layers", 1);
  return o;
}

nlohmann::json lla_fit_spec(const Arm& arm) {
  if (arm.kind != "lla") throw Error("arm '" + arm.name + "' is not an lla arm");
  nlohmann::json j = arm.spec;
  j.erase("evict");
  j.erase("absorbed");
  return j;
}

void apply_patch(Experiment& e, const nlohmann::json& patch) {
  if (!patch.is_object()) throw Error("an experiment patch must be a JSON object (got " + patch.dump().substr(0, 80) + ")");
  nlohmann::json j = e.to_json();
  j.merge_patch(patch);
  io::JsonReader r(j, "experiment patch");
  Experiment out = e;
  out.name = r.get<std::string>("name", e.name);
  out.preset = r.get<std::string>("preset", e.preset);
  out.base = train::RunConfig::from_json(r.sub("base"));
  {
    io::JsonReader v(r.sub("eval"), "experiment patch: eval");
    auto& s = out.eval;
    s.test_windows = v.get("test_windows", s.test_windows);
    s.context_multiples = v.get("context_multiples", s.context_multiples);
    s.long_context_tokens = v.get("long_context_tokens", s.long_context_tokens);
    s.mqar_pairs = v.get("mqar_pairs", s.mqar_pairs);
    s.mqar_sequences = v.get("mqar_sequences", s.mqar_sequences);
    s.decode_contexts = v.get("decode_contexts", s.decode_contexts);
    s.decode_seconds = v.get("decode_seconds", s.decode_seconds);
    s.prefill_contexts = v.get("prefill_contexts", s.prefill_contexts);
    const auto capacity = v.get<std::vector<int64_t>>("capacity", {0, s.capacity_mib});
    if (capacity.size() != 2) throw Error("experiment patch: eval.capacity is [tokens, MiB]");
    s.capacity_tokens = capacity[0], s.capacity_mib = capacity[1];
    v.finish();
  }
  if (r.has("document")) {
    io::JsonReader d(r.sub("document"), "experiment patch: document");
    auto& s = out.document;
    s.queries = d.get("queries", s.queries);
    s.query_length = d.get("query_length", s.query_length);
    s.steps = d.get("steps", s.steps);
    s.batch = d.get("batch", s.batch);
    s.lr = d.get("lr", s.lr);
    s.max_tokens = d.get("max_tokens", s.max_tokens);
    s.prompt_tokens = d.get("prompt_tokens", s.prompt_tokens);
    s.new_tokens = d.get("new_tokens", s.new_tokens);
    s.repeats = d.get("repeats", s.repeats);
    d.finish();
  }
  out.groups = r.get("groups", e.groups);
  out.arms.clear();
  for (const auto& a : r.require<nlohmann::json>("arms")) {
    io::JsonReader ar(a, "experiment patch: arm");
    Arm arm{ar.require<std::string>("name"), ar.require<std::string>("kind"), ar.get("spec", nlohmann::json::object())};
    ar.finish();
    out.arms.push_back(std::move(arm));
  }
  r.finish();
  out.base.validate();
  validate_experiment(out);
  e = std::move(out);
}

void validate_experiment(const Experiment& e) {
  const std::string what = "experiment '" + e.name + "'";
  if (e.arms.empty()) throw Error(what + " has no arms; declare at least one (see experiment.json of a built-in one)");
  const std::vector<std::string> kinds = {"train", "posthoc", "convert", "lla", "nectar", "document"};
  std::set<std::string> names;
  for (const auto& a : e.arms) {
    const std::string arm = what + ", arm '" + a.name + "'";
    if (a.name.empty()) throw Error(what + ": an arm has no name");
    if (!names.insert(a.name).second) throw Error(arm + " is declared twice; give each arm its own name");
    if (std::find(kinds.begin(), kinds.end(), a.kind) == kinds.end())
      throw Error(arm + ": unknown kind '" + a.kind + "' (known: train, posthoc, convert, lla, nectar, document)");
    if (!a.spec.is_object()) throw Error(arm + ": spec must be a JSON object");
    if (a.kind == "train") {
      if (!a.spec.contains("model") || !a.spec.at("model").is_object())
        throw Error(arm + ": a train arm's spec needs \"model\": {overrides of the base model} ({} for none)");
      continue;
    }
    if (!a.spec.contains("base") || !a.spec.at("base").is_string())
      throw Error(arm + ": a " + a.kind + " arm's spec needs \"base\": the name of the train arm it starts from");
    if (find_arm(e, a.spec.at("base").get<std::string>()).kind != "train")
      throw Error(arm + ": its base '" + a.spec.at("base").get<std::string>() + "' is not a train arm");
    if (a.kind == "lla" && a.spec.contains("budget") && a.spec.contains("ranks"))
      throw Error(arm + ": give \"budget\" or \"ranks\", not both");
    if ((a.kind == "nectar" || a.kind == "document") && !a.spec.contains("document"))
      throw Error(arm + ": a " + a.kind + " arm's spec needs \"document\" (kjv, brown or a file)");
  }
  for (const auto& g : e.groups)
    if (g != "quality" && g != "mqar" && g != "decode" && g != "capacity" && g != "document")
      throw Error(what + ": unknown metric group '" + g + "' (known: quality, mqar, decode, capacity, document)");
  const auto& s = e.eval;
  auto at_least = [&](const std::string& key, int64_t v, int64_t lo) {
    if (v < lo) throw Error(what + ": eval." + key + " must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
  };
  at_least("test_windows", s.test_windows, 1);
  at_least("long_context_tokens", s.long_context_tokens, 1);
  at_least("mqar_sequences", s.mqar_sequences, 1);
  at_least("capacity tokens", s.capacity_tokens, 0);
  at_least("capacity MiB", s.capacity_mib, 1);
  for (int m : s.context_multiples) at_least("context_multiples", m, 1);
  for (int p : s.mqar_pairs) at_least("mqar_pairs", p, 1);
  // Metric names count contexts in K tokens (decode_tok_s@4K): other contexts would share names.
  for (const auto* list : {&s.decode_contexts, &s.prefill_contexts})
    for (int64_t c : *list)
      if (c < 1024 || c % 1024 != 0)
        throw Error(what + ": decode and prefill contexts must be positive multiples of 1024 (their metrics are named in K "
                    "tokens), got " + std::to_string(c));
  if (s.capacity_tokens % 1024 != 0)
    throw Error(what + ": eval.capacity tokens must be a multiple of 1024 (its metric is named in K tokens), got " +
                std::to_string(s.capacity_tokens));
  if (!(std::isfinite(s.decode_seconds) && s.decode_seconds > 0))
    throw Error(what + ": eval.decode_seconds must be a positive number of seconds");
  const auto& d = e.document;
  for (auto [key, v] : std::vector<std::pair<std::string, int>>{{"queries", d.queries}, {"query_length", d.query_length},
                                                                {"batch", d.batch}, {"max_tokens", d.max_tokens},
                                                                {"prompt_tokens", d.prompt_tokens}, {"new_tokens", d.new_tokens},
                                                                {"repeats", d.repeats}})
    if (v < 1) throw Error(what + ": document." + key + " must be >= 1, got " + std::to_string(v));
  if (d.steps < 0) throw Error(what + ": document.steps must be >= 0, got " + std::to_string(d.steps));
  if (!(std::isfinite(d.lr) && d.lr > 0)) throw Error(what + ": document.lr must be a positive number");
}

void use_document(Experiment& e, const std::string& path) {
  if (e.name != "doc") throw Error("--document applies to the doc experiment only");
  const std::string stem = std::filesystem::path(path).stem().string();
  std::vector<Arm> kept;
  for (auto a : e.arms) {
    if (!a.spec.contains("document")) {
      kept.push_back(a);
      continue;
    }
    if (a.spec["document"] != "kjv") continue;  // one set of arms, now for the given file
    a.spec["document"] = path;
    a.name = stem + a.name.substr(a.name.find('/'));
    kept.push_back(a);
  }
  e.arms = kept;
}

const Arm& find_arm(const Experiment& e, const std::string& name) {
  std::string valid;
  for (const auto& a : e.arms) {
    if (a.name == name) return a;
    valid += (valid.empty() ? "" : ", ") + a.name;
  }
  throw Error("experiment '" + e.name + "' has no arm '" + name + "' (arms: " + valid + ")");
}

std::string train_arm_key(const train::RunConfig& config) {
  nlohmann::json j = config.to_json();
  j["data"].erase("data_dir");
  j.erase("name");
  j["harness_version"] = kHarnessVersion;
  return text::sha256_hex(j.dump()).substr(0, 16);
}

std::string metrics_key(const std::string& arm_key, const nlohmann::json& what) {
  return text::sha256_hex(arm_key + "|" + what.dump() + "|" + std::to_string(kHarnessVersion) + "." +
                          std::to_string(kMetricsVersion)).substr(0, 16);
}

}  // namespace kvx::compare
