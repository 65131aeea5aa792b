#include "compare/runner.h"

#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>

#include "compress/lla_codec.h"
#include "compress/lrkv_convert.h"
#include "compress/nectar.h"
#include "eval/analyze.h"
#include "eval/bench.h"
#include "eval/evaluate.h"
#include "eval/serving.h"
#include "io/atomic_file.h"
#include "io/json_config.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "util/error.h"

namespace kvx::compare {

namespace {

using Batches = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

struct Runner {
  const Experiment& e;
  const CompareOptions& o;
  std::string arms_dir;
  std::optional<train::TrainingData> data;
  std::optional<train::TokenizedText> test;

  void say(const std::string& s) const {
    if (o.verbose) std::cerr << "[compare " << e.name << "] " << s << "\n";
  }

  train::RunConfig with_data_dir(train::RunConfig c) const {
    if (!o.data_dir.empty()) c.data.data_dir = o.data_dir;
    return c;
  }

  const train::TrainingData& training_data() {
    if (o.data) return *o.data;
    if (!data) data = train::prepare_training_data(with_data_dir(e.base));
    return *data;
  }
  const train::TokenizedText& test_tokens() {
    if (o.test) return *o.test;
    if (!test) {
      auto c = with_data_dir(e.base);
      const std::string dir = c.data.data_dir.empty() ? text::default_data_dir() : c.data.data_dir;
      test = train::load_split_tokens(dir, c.data.sources, training_data().tokenizer, text::Split::Test);
    }
    return *test;
  }

  // Trains the arm's model unless a finished checkpoint exists; resumes an interrupted one.
  std::string ensure_trained(const train::RunConfig& cfg, const std::string& label) {
    const std::string dir = arms_dir + "/" + train_arm_key(cfg);
    const std::string latest = train::latest_checkpoint(dir);
    if (!latest.empty()) {
      auto st = io::parse_json_file(latest + "/trainer_state.json");
      if (st.value("step", 0) >= cfg.train.steps) return dir;
      say(label + ": resuming training at step " + std::to_string(st.value("step", 0)));
    } else {
      say(label + ": training " + std::to_string(cfg.train.steps) + " steps into " + dir);
    }
    train::TrainArgs args;
    args.config = with_data_dir(cfg);
    args.run_dir = dir;
    args.resume = !latest.empty();
    args.verbose = o.verbose;
    train::run_training(args, training_data());
    io::write_file_atomic(dir + "/arm.json", cfg.to_json().dump(2) + "\n");
    return dir;
  }

  // A metric group computed once per content key and stored as JSON.
  nlohmann::json cached(const std::string& path, const std::function<nlohmann::json()>& compute) {
    if (io::file_exists(path)) {
      auto j = nlohmann::json::parse(io::read_file(path), nullptr, false);
      if (!j.is_discarded()) return j;
    }
    nlohmann::json j = compute();
    io::write_file_atomic(path, j.dump(2) + "\n");
    return j;
  }

  Batches windows(int multiple) {
    const int len = e.base.train.seq_len * multiple;
    const int count = multiple == 1 ? e.eval.test_windows : std::max(1, e.eval.long_context_tokens / len);
    return train::evaluation_batches(test_tokens().tokens, count, std::max(1, 16 / multiple), len);
  }

  // An lla arm's codec: fitted once per (base model, fit settings) under arms/<key>/codec.
  std::string ensure_codec(const Arm& arm, const train::RunConfig& base_cfg, const std::string& base_dir, const std::string& dir,
                           const std::string& label) {
    const std::string codec_dir = dir + "/codec";
    if (io::file_exists(codec_dir + "/report.json")) return codec_dir;
    ensure_trained(base_cfg, label + " base");
    const auto& spec = arm.spec;
    compress::FitLlaRun run;
    run.teacher = base_dir;
    run.out = codec_dir;
    run.variant = spec.value("variant", "head");
    run.budget = spec.value("budget", "");
    if (spec.contains("ranks")) run.rank_k = spec["ranks"][0], run.rank_v = spec["ranks"][1];
    run.distill_steps = spec.value("steps", 0);
    run.init = spec.value("init", "svd");
    run.on_policy = spec.value("on_policy", false);
    run.attention_weight = spec.value("attention_weight", 1.0);
    run.seq_len = e.base.train.seq_len;
    run.sources = e.base.data.sources;
    run.data_dir = o.data_dir;
    run.verbose = o.verbose;
    run.data = o.data ? o.data : &training_data();
    say(label + ": fitting the LLA codec into " + codec_dir);
    compress::fit_lla_run(run);  // report.json last: its presence marks a finished fit
    return codec_dir;
  }

  nlohmann::json quality(model::Transformer& m, const attention::CacheOptions* cache) {
    nlohmann::json q;
    const auto& tok = training_data().tokenizer;
    for (int mult : e.eval.context_multiples) {
      if (cache && cache->lla && mult != 1) continue;  // LLA decodes one token per step: the training context only
      auto b = windows(mult);
      eval::LmQuality lq;
      if (cache) {
        // LLA: one token per step, so the history is read from codes (a chunk's own K/V are exact).
        auto c = eval::evaluate_lm_cached(m, b, tok, *cache, cache->lla ? 1 : 0);
        lq = c.quality;
        if (mult == 1) {
          q["kl_vs_reference"] = c.kl_vs_full;
          q["top1_agreement"] = c.top1_agreement;
        }
      } else {
        lq = eval::evaluate_lm(m, b, tok);
      }
      if (mult == 1) {
        q["test_ce"] = lq.cross_entropy;
        q["test_bpb"] = lq.bits_per_byte;
      }
      q["ppl@" + std::to_string(mult) + "x"] = lq.perplexity;
    }
    return q;
  }

  nlohmann::json mqar(model::Transformer& m, const attention::CacheOptions* cache) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& p : eval::mqar_accuracy(m, e.eval.mqar_pairs, e.eval.mqar_sequences, e.base.train.seq_len,
                                                  e.base.data.mqar_symbols, 1234, cache))
      out["mqar@" + std::to_string(p.pairs)] = p.accuracy;
    return out;
  }

  nlohmann::json decode(const model::ModelConfig& cfg, const attention::CacheOptions& cache) {
    nlohmann::json out = nlohmann::json::object();
    for (int64_t ctx : e.eval.decode_contexts) {
      const double tps = eval::decode_tokens_per_second(cfg, cache, ctx, e.eval.decode_seconds);
      out["decode_tok_s@" + std::to_string(ctx / 1024) + "K"] = tps;
    }
    for (int64_t ctx : e.eval.prefill_contexts)
      out["prefill_s@" + std::to_string(ctx / 1024) + "K"] = eval::prefill_seconds(cfg, ctx);
    return out;
  }

  static nlohmann::json curve_of(const std::string& run_dir) {
    nlohmann::json c = {{"step", nlohmann::json::array()}, {"train_loss", nlohmann::json::array()},
                        {"val_step", nlohmann::json::array()}, {"val_ce", nlohmann::json::array()}};
    if (!io::file_exists(run_dir + "/log.jsonl")) return c;
    std::istringstream in(io::read_file(run_dir + "/log.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("loss")) c["step"].push_back(j["step"]), c["train_loss"].push_back(j["loss"]);
      if (j.contains("val_ce")) c["val_step"].push_back(j["step"]), c["val_ce"].push_back(j["val_ce"]);
    }
    return c;
  }

  bool wants(const std::string& group) const {
    return std::find(e.groups.begin(), e.groups.end(), group) != e.groups.end();
  }

  // A document of the doc experiment as a file: the built-in "kjv" (the book of Jude) and "brown"
  // (the start of Brown ca32), both in the corpora's validation split so that the model has not
  // trained on them, are cut at a line to at most DocumentSettings::max_tokens tokens and written
  // under <out>/documents/; anything else is a file path, used as it is.
  std::string document_file(const std::string& name) {
    if (name != "kjv" && name != "brown") return name;
    auto c = with_data_dir(e.base);
    const std::string data = c.data.data_dir.empty() ? text::default_data_dir() : c.data.data_dir;
    const std::string source = data + (name == "kjv" ? "/kjv/65_Jude.txt" : "/brown/ca32.txt");
    std::istringstream in(io::read_file(source));
    std::string text, line;
    const auto& tok = training_data().tokenizer;
    while (std::getline(in, line)) {
      const std::string more = text + line + "\n";
      if (static_cast<int>(tok.encode(more).size()) > e.document.max_tokens) break;
      text = more;
    }
    const std::string path = arms_dir + "/../documents/" + name + ".txt";
    io::make_dirs(arms_dir + "/../documents");
    if (!io::file_exists(path) || io::read_file(path) != text) io::write_file_atomic(path, text);
    return path;
  }

  ArmResult run_document_arm(const Arm& arm, size_t index) {
    ArmResult r;
    r.name = arm.name;
    r.kind = arm.kind;
    const auto& spec = arm.spec;
    const Arm& trained = find_arm(e, spec.at("base").get<std::string>());
    const train::RunConfig cfg = arm_run_config(e, trained);
    r.key = train_arm_key(cfg);
    const std::string label = arm.name + " (" + std::to_string(index + 1) + "/" + std::to_string(e.arms.size()) + ")";
    const auto& d = e.document;
    // The document, read and checked against the context before the base model trains (the
    // model's tokenizer is the training data's).
    const std::string path = document_file(spec.at("document").get<std::string>());
    std::vector<int32_t> ids;
    try {
      ids = compress::read_document(training_data().tokenizer, path);
    } catch (const Error& err) {
      throw Error(arm.name + ": document '" + spec.at("document").get<std::string>() + "': " + err.what());
    }
    // after the document: a query, or a served request's prompt and answer
    const int64_t after = std::max<int64_t>(d.query_length, std::min(d.prompt_tokens, d.query_length) + d.new_tokens);
    if (static_cast<int64_t>(ids.size()) + after > cfg.model.max_position_embeddings)
      throw Error(arm.name + ": the document " + path + " (" + std::to_string(ids.size()) + " tokens) and the " +
                  std::to_string(after) + " tokens of a query or request after it exceed the model's context of " +
                  std::to_string(cfg.model.max_position_embeddings) + " tokens; give a shorter document");
    const std::string base_dir = ensure_trained(cfg, label + " base");
    auto loaded = train::load_model(base_dir);
    // Keys: the base, the document's tokens (not its path), the arm's settings.
    nlohmann::json what = spec;
    what["document"] = compress::tokens_fingerprint(ids);
    what["settings"] = d.to_json();
    const std::string doc_dir = arms_dir + "/" + r.key + "/doc-" + what["document"].get<std::string>();
    compress::QueryOptions qo;
    qo.count = d.queries;
    qo.length = d.query_length;
    // one file per query setting: a changed setting makes new queries (the file checks it too)
    const std::string queries_file = doc_dir + "/queries-" + std::to_string(qo.count) + "x" + std::to_string(qo.length) +
                                     "-seed" + std::to_string(qo.seed) + ".json";
    // The document's KV and its queries only when a metric has to be computed (not for cached ones).
    std::optional<compress::DocumentKV> document_kv;
    const auto document = [&]() -> const compress::DocumentKV& {
      if (!document_kv) document_kv = compress::prefill_document(loaded.model, ids, d.query_length);
      return *document_kv;
    };
    std::optional<compress::NectarQueries> shared_queries;
    const auto queries = [&]() -> const compress::NectarQueries& {
      io::make_dirs(doc_dir);
      if (!shared_queries)
        shared_queries = compress::load_or_make_queries(queries_file, loaded.model, loaded.tokenizer, document(), qo);
      return *shared_queries;
    };
    const auto& mc = cfg.model;
    r.metrics["document_tokens"] = static_cast<double>(ids.size());
    r.metrics["document_kv_bytes"] = 2.0 * ids.size() * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4;
    const auto serving_metrics = [&](const std::vector<eval::ServingRow>& rows) {
      nlohmann::json m;
      for (const auto& row : rows) {
        m["ttft_ms_" + row.mode] = 1e3 * row.ttft_seconds;
        m["decode_tok_s_" + row.mode] = row.decode_tokens_per_second;
        m["state_bytes_" + row.mode] = static_cast<double>(row.state_bytes);
        if (row.mode == "prefix") m["prefix_prefill_s"] = row.setup_seconds;
      }
      return m;
    };
    // A request: the first prompt_tokens of the first test query, then new_tokens greedy tokens.
    const auto request_prompt = [&] {
      const auto& test = queries().test;
      const auto p = test[0].narrow(0, 0, std::min<int64_t>(d.prompt_tokens, test.size(1)));
      return std::vector<int32_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
    };
    // NectarQuality::to_json of the test and challenge splits -> the arm's metrics.
    const auto add_quality = [](nlohmann::json& m, const nlohmann::json& q, const std::string& suffix) {
      for (const char* k : {"kl", "accuracy_gap", "teacher_accuracy", "alpha_mse", "content_mse"})
        if (!q[k].is_null()) m[k + suffix] = q[k];  // no document has no alpha error
    };
    const auto quality_metrics = [&](const attention::NectarDocument& student) {
      nlohmann::json m;
      add_quality(m, compress::evaluate_document_module(loaded.model, document(), student, queries().test).to_json(), "");
      add_quality(m, compress::evaluate_document_module(loaded.model, document(), student, queries().challenge).to_json(), "_challenge");
      return m;
    };
    if (arm.kind == "document") {
      const std::string mode = spec.at("mode").get<std::string>();
      if (mode != "full" && mode != "none") throw Error("document arm '" + arm.name + "': mode must be full or none");
      auto m = cached(doc_dir + "/metrics-document-" + metrics_key(r.key, what) + ".json", [&] {
        say(label + ": " + (mode == "full" ? "the exact document: quality and serving" : "no document: quality"));
        auto q = quality_metrics(mode == "full" ? *document().exact(cfg.model) : *compress::no_document(cfg.model, document().tokens()));
        if (mode == "full") {
          q.update(serving_metrics(eval::measure_document_serving(loaded.model, ids, nullptr, 0, request_prompt(), d.new_tokens, d.repeats)));
          q["state_bytes"] = q["state_bytes_prefix"];
          q["ttft_ms"] = q["ttft_ms_prefill"];
          q["decode_tok_s"] = q["decode_tok_s_prefix"];
        }
        return q;
      });
      r.metrics.update(m);
      return r;
    }
    // nectar: fitted once per (base, document, settings) under arms/<key>/module
    const std::string dir = arms_dir + "/" + metrics_key(r.key, what);
    const std::string module_dir = dir + "/module";
    if (!io::file_exists(module_dir + "/report.json")) {
      compress::FitNectarRun run;
      run.model = base_dir;
      run.document = path;
      run.out = module_dir;
      run.arch = attention::NectarArch::parse(spec.at("arch").get<std::string>(), "");
      run.rho = spec.at("rho").get<double>();
      const std::string loss = spec.at("loss").get<std::string>();
      if (loss == "reg") run.kl_weight = 0;
      else if (loss == "kl") run.alpha_weight = run.content_weight = 0, run.kl_weight = 1;
      else if (loss != "mixed") throw Error("nectar arm '" + arm.name + "': loss must be reg, mixed or kl");
      run.steps = d.steps;
      run.batch = d.batch;
      run.lr = d.lr;
      run.queries = qo;
      run.queries_file = queries_file;
      run.verbose = o.verbose;
      io::make_dirs(doc_dir);
      say(label + ": fitting the Nectar module into " + module_dir);
      compress::fit_nectar_run(run);  // report.json last: its presence marks a finished fit
    }
    const auto report = io::parse_json_file(module_dir + "/report.json");
    add_quality(r.metrics, report["splits"]["test"], "");
    add_quality(r.metrics, report["splits"]["challenge"], "_challenge");
    r.metrics["module_bytes"] = report["module_bytes"];
    r.metrics["budget_fraction"] = report["budget_fraction"];
    const double fit_s = report["query_seconds"].get<double>() + report["fit_seconds"].get<double>();
    r.metrics["fit_s"] = fit_s;
    auto m = cached(dir + "/metrics-serving-" + metrics_key(r.key, what) + ".json", [&] {
      say(label + ": serving after the document three ways");
      const auto module = compress::DocumentModule::load(module_dir, loaded.model);
      return serving_metrics(eval::measure_document_serving(loaded.model, ids, module.decode_set(), module.bytes(), request_prompt(),
                                                            d.new_tokens, d.repeats));
    });
    r.metrics.update(m);
    r.metrics["state_bytes"] = m["state_bytes_module"];
    r.metrics["ttft_ms"] = m["ttft_ms_module"];
    r.metrics["decode_tok_s"] = m["decode_tok_s_module"];
    // Requests after which fitting has paid for itself against prefilling the document each time.
    const double saved_s = (m["ttft_ms_prefill"].get<double>() - m["ttft_ms_module"].get<double>()) / 1e3;
    if (saved_s > 0) r.metrics["amortise_requests"] = std::ceil(fit_s / saved_s);
    return r;
  }

  ArmResult run_arm(const Arm& arm, size_t index) {
    if (arm.kind == "nectar" || arm.kind == "document") return run_document_arm(arm, index);
    ArmResult r;
    r.name = arm.name;
    r.kind = arm.kind;
    const bool derived = arm.kind == "posthoc" || arm.kind == "convert" || arm.kind == "lla";
    const Arm& trained = derived ? find_arm(e, arm.spec.at("base").get<std::string>()) : arm;
    train::RunConfig cfg = arm_run_config(e, trained);
    attention::CacheOptions cache = arm_cache(arm);
    r.key = train_arm_key(cfg);
    const std::string label = arm.name + " (" + std::to_string(index + 1) + "/" + std::to_string(e.arms.size()) + ")";
    std::string dir = arms_dir + "/" + r.key;
    const nlohmann::json what = {{"arm", derived ? arm.spec : nlohmann::json("trained")}};
    // A convert arm's model lives in its own directory, keyed by its base and the conversion.
    std::function<std::string()> model_dir = [&] { return ensure_trained(cfg, label); };
    if (arm.kind == "convert") {
      const std::string base_dir = dir;
      const std::string base_key = r.key;
      r.key = metrics_key(base_key, arm.spec);
      dir = arms_dir + "/" + r.key;
      compress::LrkvConversion conv{arm.spec.at("rank").get<int>(), arm.spec.value("rope", "expand")};
      model::Transformer base_shape(cfg.model);
      cfg.model = compress::convert_to_lrkv(base_shape, conv)->config();
      model_dir = [&, base_dir, conv] {
        const int heal = arm.spec.value("heal_steps", 0);
        const std::string done = heal > 0 ? train::latest_checkpoint(dir + "/heal") : dir + "/converted";
        const bool finished = io::file_exists(dir + "/report.json");
        if (!finished || done.empty()) {
          ensure_trained(arm_run_config(e, trained), label + " base");
          say(label + ": converting " + trained.name + " and healing " + std::to_string(heal) + " steps into " + dir);
          compress::ConvertRun run;
          run.from = base_dir;
          run.out = dir;
          run.data_dir = o.data_dir;
          run.sources = e.base.data.sources;
          run.conversion = conv;
          run.heal_steps = heal;
          run.seq_len = e.base.train.seq_len;
          run.verbose = o.verbose;
          run.data = o.data ? o.data : &training_data();
          compress::convert_lrkv_run(run);
        }
        return heal > 0 ? dir + "/heal" : dir + "/converted";
      };
    }

    std::function<void()> need_codec = [] {};
    if (arm.kind == "lla") {
      const std::string base_dir = dir;
      dir = arms_dir + "/" + metrics_key(r.key, lla_fit_spec(arm));
      need_codec = [&, base_dir] {
        if (cache.lla) return;
        const auto codec_dir = ensure_codec(arm, cfg, base_dir, dir, label);
        cache.lla = compress::LlaCodec::load(codec_dir, cfg.model).decode_set();
      };
    }

    // Accounting from the config alone.
    if (arm.kind == "lla") {
      const auto& spec = arm.spec;
      const std::string variant = spec.value("variant", "head");
      auto [rk, rv] = spec.contains("ranks") ? std::pair<int, int>{spec["ranks"][0], spec["ranks"][1]}
                      : variant == "final_loop"
                          ? std::pair<int, int>{cfg.model.head_dim, cfg.model.head_dim}
                          : compress::ranks_for_budget(spec.value("budget", ""), variant, cfg.model);
      const auto shape = compress::LlaShape::of_teacher(cfg.model, variant, rk, rv);
      const int64_t context = cfg.train.seq_len;
      const double held = cache.evict.enabled() ? std::min<double>(context, cache.evict.sink + cache.evict.window) : context;
      r.metrics["kv_bytes_per_token"] = shape.bytes_per_token() * held / context;
      r.metrics["compression"] = shape.teacher_bytes_per_token() / (shape.bytes_per_token() * held / context);
      r.metrics["rank_k"] = rk;
      r.metrics["rank_v"] = rv;
      model::Transformer teacher_shape(cfg.model);
      r.metrics["params"] = teacher_shape->num_parameters();
    } else {
      model::Transformer shape(cfg.model);
      const double per_token = shape->kv_bytes_per_token(cache.type);
      const int64_t context = cfg.train.seq_len;
      const double held = cache.evict.enabled() ? std::min<double>(context, cache.evict.sink + cache.evict.window) : context;
      const int D = cfg.model.num_hidden_layers, share = std::max(1, cache.share_kv_layers);
      const double kept_layers = static_cast<double>((D + share - 1) / share) / D;  // CLA: the layers that keep K/V
      r.metrics["kv_bytes_per_token"] = per_token * held / context * kept_layers;  // at the training context
      r.metrics["params"] = shape->num_parameters();
      if (shape->state_bytes() > 0) r.metrics["state_bytes"] = shape->state_bytes();
      if (cfg.model.loops > 1)  // vs the looped model's own full f32 KV
        r.metrics["compression"] = shape->kv_bytes_per_token(kernels::KVType::F32) / r.metrics["kv_bytes_per_token"].get<double>();
    }
    const bool needs_model = wants("quality") || wants("mqar");
    std::optional<train::LoadedModel> loaded;
    auto model = [&]() -> model::Transformer& {
      if (!loaded) loaded = train::load_model(model_dir());
      return loaded->model;
    };
    const attention::CacheOptions* cache_ptr = arm.kind == "posthoc" || arm.kind == "lla" ? &cache : nullptr;
    if (wants("quality")) {
      auto q = cached(dir + "/metrics-quality-" + metrics_key(r.key, {what, e.eval.to_json()}) + ".json", [&] {
        need_codec();
        say(label + ": held-out quality");
        return quality(model(), cache_ptr);
      });
      r.metrics.update(q);
      if (cfg.model.uses("natsl")) {  // the routes the router actually takes, and what the kept KV costs
        auto routing = cached(dir + "/metrics-routing-" + metrics_key(r.key, {what, e.eval.to_json()}) + ".json", [&] {
          say(label + ": NAtS-L routing");
          return eval::routing_fractions(model(), windows(1)).to_json();
        });
        r.routing = routing;
        r.metrics["softmax_fraction"] = routing["overall"];
        r.metrics["kv_bytes_per_token"] = routing["kv_bytes_per_token"];
      }
    }
    // KV + constant state per token at long contexts (GDN / NAtS-L state amortised).
    for (int64_t ctx : {4096, 16384})
      r.metrics["kv_state_bytes_per_token@" + std::to_string(ctx / 1024) + "K"] =
          r.metrics["kv_bytes_per_token"].get<double>() + r.metrics.value("state_bytes", 0.0) / static_cast<double>(ctx);
    if (wants("mqar") && arm.kind != "lla") {  // (MQAR prefills whole sequences: an LLA arm would read no codes)
      auto q = cached(dir + "/metrics-mqar-" + metrics_key(r.key, {what, e.eval.to_json()}) + ".json", [&] {
        say(label + ": MQAR recall");
        return mqar(model(), cache_ptr);
      });
      r.metrics.update(q);
      for (int p : e.eval.mqar_pairs) r.mqar.emplace_back(p, q.value("mqar@" + std::to_string(p), 0.0));
    }
    if (wants("decode")) {
      // NAtS-L random history keeps the fraction of blocks the trained router kept (measured with
      // the quality group), else the layer's budget.
      attention::CacheOptions decode_cache = cache;
      decode_cache.history_softmax_fraction = r.metrics.value("softmax_fraction", -1.0);
      nlohmann::json key_parts = {what, e.eval.to_json(), "decode", e.eval.prefill_contexts};
      if (cfg.model.uses("natsl")) key_parts.push_back(decode_cache.history_softmax_fraction);
      auto q = cached(dir + "/metrics-decode-" + metrics_key(r.key, key_parts) + ".json", [&] {
        need_codec();
        decode_cache.lla = cache.lla;
        say(label + ": decode speed");
        return decode(cfg.model, decode_cache);
      });
      r.metrics.update(q);
    }
    if (wants("capacity") && e.eval.capacity_tokens > 0) {  // allocation only: quick, not cached
      need_codec();
      constexpr int64_t kLimit = 256;  // evicting caches hold so little that more would only take time
      const int64_t n = eval::capacity_sequences(cfg.model, cache, e.eval.capacity_tokens, e.eval.capacity_mib << 20, kLimit);
      r.metrics["capacity@" + std::to_string(e.eval.capacity_tokens / 1024) + "K"] = static_cast<double>(n);
      if (n == kLimit) r.metrics["capacity_at_least"] = true;  // stopped counting at the limit
    }
    if (needs_model && arm.kind == "train") r.curve = curve_of(dir);
    return r;
  }
};

}  // namespace

ExperimentResult run_experiment(const Experiment& e, const CompareOptions& o) {
  validate_experiment(e);
  auto t0 = std::chrono::steady_clock::now();
  ExperimentResult res;
  res.experiment = e;
  res.dir = o.out_dir + "/" + e.name + "-" + e.preset;
  io::make_dirs(res.dir);
  Runner runner{e, o, o.out_dir + "/arms", std::nullopt, std::nullopt};
  io::make_dirs(runner.arms_dir);
  io::write_file_atomic(res.dir + "/experiment.json", e.to_json().dump(2) + "\n");
  for (size_t i = 0; i < e.arms.size(); ++i) res.arms.push_back(runner.run_arm(e.arms[i], i));
  // Budget relative to f32 MHA of the arm's own model (a derived arm's: its base's), every layer
  // and loop: 2 x layers x loops x H x d_h x 4 bytes (the looped teacher is 100%, its codecs a share of it).
  for (auto& a : res.arms)
    if (a.metrics.contains("kv_bytes_per_token")) {
      const Arm& arm = find_arm(e, a.name);
      const Arm& trained = arm.kind == "train" ? arm : find_arm(e, arm.spec.at("base").get<std::string>());
      const auto m = arm_run_config(e, trained).model;
      const double mha = 2.0 * m.num_hidden_layers * m.loops * m.num_attention_heads * m.head_dim * 4;
      a.metrics["kv_pct_of_mha"] = 100.0 * a.metrics["kv_bytes_per_token"].get<double>() / mha;
    }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

nlohmann::json results_json(const ExperimentResult& r) {
  nlohmann::json rows = nlohmann::json::array(), arms = nlohmann::json::array();
  for (const auto& a : r.arms) {
    nlohmann::json spec;
    for (const auto& arm : r.experiment.arms)
      if (arm.name == a.name) spec = arm.spec;
    arms.push_back({{"name", a.name}, {"kind", a.kind}, {"model_key", a.key}, {"spec", spec}, {"curve", a.curve}});
    if (!a.routing.is_null()) arms.back()["routing"] = a.routing;
    for (auto it = a.metrics.begin(); it != a.metrics.end(); ++it)
      rows.push_back({{"arm", a.name}, {"kind", a.kind}, {"metric", it.key()}, {"value", it.value()}});
  }
  return {{"experiment", r.experiment.name}, {"preset", r.experiment.preset}, {"config", r.experiment.to_json()},
          {"arms", arms}, {"rows", rows}};
}

}  // namespace kvx::compare
