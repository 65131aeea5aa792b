#include "eval/bench.h"

#include <map>
#include <chrono>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <filesystem>
#include <unistd.h>

#include "attention/dense.h"
#include "attention/gdn.h"
#include "kernels/gdn_decode.h"
#include "kernels/lla_decode.h"
#include "kernels/decode_attention.h"
#include "kernels/lrkv_decode.h"
#include "kernels/compute_peak.h"
#include "kernels/memory_bandwidth.h"
#include "io/atomic_file.h"
#include "model/transformer.h"
#include "text/bpe.h"
#include "text/corpus.h"
#include "train/adamw.h"
#include "train/distributed.h"
#include "util/error.h"
#include "util/strings.h"
#include "util/threads.h"

namespace kvx::eval {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

double measure_sgemm_gflops(int n, double seconds) {
  torch::NoGradGuard ng;
  auto a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
  torch::mm_out(c, a, b);  // warm-up
  double best = 0;
  auto t_end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < t_end) {
    auto t0 = Clock::now();
    torch::mm_out(c, a, b);
    best = std::max(best, 2.0 * n * n * n / since(t0) / 1e9);
  }
  return best;
}

double training_flops_per_step(const model::ModelConfig& m, int batch, int seq_len) {
  const double d = m.hidden_size, H = m.num_attention_heads, Hkv = m.num_key_value_heads, dh = m.head_dim;
  const double per_layer = 2 * d * H * dh + 2 * 2 * d * Hkv * dh + 2 * H * dh * d + 3 * 2 * d * m.intermediate_size +
                           2 * 2 * static_cast<double>(seq_len) * H * dh;
  const double per_token = m.num_hidden_layers * per_layer + 2 * d * m.vocab_size;
  return 3.0 * per_token * batch * seq_len;
}

nlohmann::json bench_train(const train::RunConfig& cfg, int steps, bool verbose) {
  const auto& t = cfg.train;
  torch::manual_seed(0);
  model::Transformer model(cfg.model);
  model->train();
  train::AdamW opt(model->named_parameters().pairs(), train::AdamWOptions{});
  auto x = torch::randint(cfg.model.vocab_size, {t.batch_size, t.seq_len}, torch::kLong);
  auto y = torch::randint(cfg.model.vocab_size, {t.batch_size, t.seq_len}, torch::kLong);
  double fwd = 0, bwd = 0, upd = 0;
  auto one_step = [&](bool timed) {
    auto t0 = Clock::now();
    opt.zero_grad();
    auto logits = model->forward(x);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
    auto t1 = Clock::now();
    loss.backward();
    auto t2 = Clock::now();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    opt.step(1e-4);
    if (timed) {
      fwd += std::chrono::duration<double>(t1 - t0).count();
      bwd += std::chrono::duration<double>(t2 - t1).count();
      upd += since(t2);
    }
  };
  for (int i = 0; i < 2; ++i) one_step(false);
  auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) {
    one_step(true);
    if (verbose) std::cerr << "\rbench train: step " << i + 1 << "/" << steps << std::flush;
  }
  const double secs = since(t0);
  if (verbose) std::cerr << "\n";
  const double flops = training_flops_per_step(cfg.model, t.batch_size, t.seq_len);
  const double achieved = flops * steps / secs / 1e9;
  const double sgemm = measure_sgemm_gflops(1024, 1.5);
  return {{"preset", cfg.name},
          {"threads", torch::get_num_threads()},
          {"batch_size", t.batch_size},
          {"seq_len", t.seq_len},
          {"parameters", model->num_parameters()},
          {"steps", steps},
          {"seconds_per_step", secs / steps},
          {"forward_share", fwd / secs},
          {"backward_share", bwd / secs},
          {"optimizer_share", upd / secs},
          {"tokens_per_second", static_cast<double>(t.batch_size) * t.seq_len * steps / secs},
          {"model_gflop_per_step", flops / 1e9},
          {"achieved_gflops", achieved},
          {"sgemm_gflops_1024", sgemm},
          {"ratio_to_sgemm", achieved / sgemm}};
}

nlohmann::json bench_train_worker(const train::RunConfig& cfg, int steps) {
  const auto opts = train::DistributedOptions::from_env();
  train::ProcessGroup group(opts);
  const auto& t = cfg.train;
  torch::manual_seed(0);
  model::Transformer model(cfg.model);
  model->train();
  train::AdamW opt(model->named_parameters().pairs(), train::AdamWOptions{});
  std::vector<torch::Tensor> params = model->parameters();
  group.broadcast(params);
  train::GradientBuckets buckets(group, params);
  torch::manual_seed(1 + group.rank());  // each worker its own batch
  auto x = torch::randint(cfg.model.vocab_size, {t.batch_size, t.seq_len}, torch::kLong);
  auto y = torch::randint(cfg.model.vocab_size, {t.batch_size, t.seq_len}, torch::kLong);
  auto one_step = [&] {
    opt.zero_grad();
    auto logits = model->forward(x);
    torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1})).backward();
    buckets.finish();
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    opt.step(1e-4);
  };
  for (int i = 0; i < 2; ++i) one_step();
  group.barrier();
  const double waited_before = buckets.seconds_waiting();
  auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) one_step();
  const double secs = since(t0);
  const double waited = buckets.seconds_waiting() - waited_before;
  // The whole gradient in one blocking all-reduce (the cost without any overlap).
  auto flat = torch::zeros({static_cast<int64_t>(buckets.bytes_per_step() / 4)});
  double allreduce = 1e30;
  for (int i = 0; i < 5; ++i) {
    group.barrier();
    auto a0 = Clock::now();
    group.sum(flat);
    allreduce = std::min(allreduce, since(a0));
  }
  const double mean_secs = group.mean(secs), mean_wait = group.mean(waited);
  if (!group.is_root()) return nullptr;
  const int N = group.world_size();
  return {{"workers", N},
          {"threads_per_worker", torch::get_num_threads()},
          {"seconds_per_step", mean_secs / steps},
          {"tokens_per_second", static_cast<double>(t.batch_size) * t.seq_len * N * steps / mean_secs},
          {"allreduce_wait_share", mean_wait / mean_secs},
          {"gradient_bytes", buckets.bytes_per_step()},
          {"blocking_allreduce_seconds", allreduce}};
}

nlohmann::json bench_train_data_parallel(const train::RunConfig& cfg, int steps, int nproc,
                                         const std::vector<std::string>& worker_argv, bool verbose) {
  nlohmann::json single = bench_train(cfg, steps, verbose);
  const std::string out = std::filesystem::temp_directory_path().string() + "/kvx_bench_train_" + std::to_string(::getpid()) + ".json";
  setenv("KVX_BENCH_OUT", out.c_str(), 1);
  if (verbose) std::cerr << "bench train: " << nproc << " data-parallel workers ...\n";
  const int rc = train::launch_workers(worker_argv, nproc, "127.0.0.1", train::choose_port("127.0.0.1", 0), "");
  unsetenv("KVX_BENCH_OUT");
  if (rc != 0) throw Error("bench train: a data-parallel worker failed (status " + std::to_string(rc) + ")");
  nlohmann::json multi = nlohmann::json::parse(io::read_file(out));
  std::remove(out.c_str());

  // N machines of C cores, each one worker whose step takes this machine's measured time scaled
  // by its cores / C (ideal scaling within a machine), joined by a network: a ring all-reduce
  // sends and receives 2 (N - 1) / N of the gradient per worker. Without overlap a step costs
  // compute + all-reduce, with full overlap the larger of the two.
  const double bytes = multi["gradient_bytes"].get<double>();
  const int here = hardware_threads();
  nlohmann::json projection = nlohmann::json::array();
  for (int cores : {here, 16, 64}) {
    const double compute = single["seconds_per_step"].get<double>() * here / cores;
    for (int machines : {2, 8, 32})
      for (double gbit : {1.0, 10.0, 100.0}) {
        const double comm = 2.0 * (machines - 1) / machines * bytes / (gbit * 1e9 / 8);
        projection.push_back({{"cores_per_machine", cores},
                              {"machines", machines},
                              {"network_gbit_s", gbit},
                              {"compute_seconds", compute},
                              {"allreduce_seconds", comm},
                              {"speedup_no_overlap", machines * compute / (compute + comm)},
                              {"speedup_full_overlap", machines * compute / std::max(compute, comm)}});
      }
  }
  const double ring_bytes = 2.0 * (nproc - 1) / nproc * bytes;
  return {{"single", single},
          {"data_parallel", multi},
          {"speedup_measured", multi["tokens_per_second"].get<double>() / single["tokens_per_second"].get<double>()},
          {"loopback_allreduce_gbytes_s", ring_bytes / multi["blocking_allreduce_seconds"].get<double>() / 1e9},
          {"projection", projection}};
}

namespace {

// Seconds per call of f over at least 3 calls and about `seconds` in all, after one warm-up.
// The mean: a sustained rate (whole-model decode).
template <class F>
double mean_seconds_per_call(F&& f, double seconds) {
  f();
  int n = 0;
  const auto t0 = Clock::now();
  do {
    f();
    ++n;
  } while (n < 3 || since(t0) < seconds);
  return since(t0) / n;
}

// The fastest call, each after evict() (untimed) empties the caches: a kernel's cost when what
// it reads comes from memory, judged against the read-bandwidth probe's fastest pass (on this
// shared VM single calls run up to 1.3x slower while a neighbour is busy).
template <class F, class E>
double cold_seconds_per_call(F&& f, double seconds, E&& evict) {
  f();
  int n = 0;
  double fastest = 1e30;
  const auto t0 = Clock::now();  // the budget counts the evictions too
  do {
    evict();
    const auto t = Clock::now();
    f();
    fastest = std::min(fastest, since(t));
    ++n;
  } while (n < 3 || since(t0) < seconds);
  return fastest;
}

}  // namespace

double decode_tokens_per_second(model::ModelConfig config, const attention::CacheOptions& cache, int64_t context,
                                double seconds) {
  torch::NoGradGuard ng;
  // Random weights and random cache rows (speed does not depend on the values), with the
  // context limit raised to the context measured.
  config.max_position_embeddings = static_cast<int>(context) + 16384;
  torch::manual_seed(0);
  model::Transformer m(config);
  m->eval();
  auto state = m->new_state(1, cache);
  uint32_t seed = 0;
  for (auto& layer : state.layers) layer->append_random_history(context, seed++);
  auto tok = torch::zeros({1, 1}, torch::kLong);
  // Each call appends one token (the margin above covers thousands of calls).
  return 1.0 / mean_seconds_per_call([&] { m->step(tok, state); }, seconds);
}

int64_t capacity_sequences(model::ModelConfig config, const attention::CacheOptions& cache, int64_t length,
                           int64_t budget_bytes, int64_t limit) {
  torch::NoGradGuard ng;
  if (length < 1 || budget_bytes < 1) throw Error("capacity: the length and the memory budget must be positive");
  config.max_position_embeddings = static_cast<int>(std::max<int64_t>(config.max_position_embeddings, length));
  torch::manual_seed(0);
  model::Transformer m(config);
  std::vector<model::DecodeState> held;
  int64_t used = 0;
  uint32_t seed = 0;
  while (static_cast<int64_t>(held.size()) < limit) {
    auto state = m->new_state(1, cache);
    for (auto& layer : state.layers) layer->append_random_history(length, seed++);
    const int64_t bytes = state.bytes();
    if (bytes <= 0) throw Error("capacity: a decode state of " + std::to_string(length) + " tokens holds no bytes");
    if (used + bytes > budget_bytes) break;
    used += bytes;
    held.push_back(std::move(state));
  }
  return static_cast<int64_t>(held.size());
}

double prefill_seconds(model::ModelConfig config, int64_t context, int64_t chunk) {
  torch::NoGradGuard ng;
  config.max_position_embeddings = static_cast<int>(std::max<int64_t>(config.max_position_embeddings, context));
  torch::manual_seed(0);
  model::Transformer m(config);
  m->eval();
  attention::CacheOptions reference;
  reference.reference = true;
  auto state = m->new_state(1, reference);
  const auto ids = torch::randint(config.vocab_size, {1, context}, torch::kLong);
  const auto t0 = Clock::now();
  for (int64_t at = 0; at < context; at += chunk) m->step(ids.narrow(1, at, std::min(chunk, context - at)), state);
  return since(t0);
}

nlohmann::json bench_decode(const DecodeBenchOptions& o, bool verbose) {
  // Every option is checked here, before the probes and timings (minutes) run.
  if (o.heads < 1 || o.head_dim < 1) throw Error("bench decode: heads and head_dim must be positive");
  if (o.contexts.empty()) throw Error("bench decode: --contexts is empty; give increasing contexts, e.g. 1024,4096");
  if (o.types.empty()) throw Error("bench decode: --types is empty; give cache types, e.g. f32,q8");
  if (o.kv_heads.empty()) throw Error("bench decode: --hkv is empty; give KV head counts, e.g. 16,4");
  if (o.isas.empty()) throw Error("bench decode: --isa is empty; give auto, avx2 or avx512");
  if (!(o.seconds_per_point > 0 && o.seconds_per_point <= 60))
    throw Error("bench decode: --seconds must be in (0, 60] per measurement, got " + format_number(o.seconds_per_point));
  for (size_t i = 0; i < o.contexts.size(); ++i) {
    if (o.contexts[i] < 1) throw Error("bench decode: --contexts must be >= 1 tokens each, got " + std::to_string(o.contexts[i]));
    if (i > 0 && o.contexts[i] <= o.contexts[i - 1])  // the stores grow from one context to the next
      throw Error("bench decode: --contexts must be increasing, got " + std::to_string(o.contexts[i - 1]) + " then " +
                  std::to_string(o.contexts[i]) + "; list them in order, e.g. 1024,4096");
  }
  for (const auto& name : o.types) {
    const kernels::KVType type = kernels::parse_kv_type(name);  // unknown names: an error listing the valid ones
    if (type != kernels::KVType::Q8 && type != kernels::KVType::Q4) continue;
    if (o.head_dim % kernels::kQBlock != 0)
      throw Error("bench decode: a " + name + " cache needs d_h a multiple of " + std::to_string(kernels::kQBlock) + ", got " +
                  std::to_string(o.head_dim));
    for (int r : o.lrkv_ranks)
      if ((static_cast<int64_t>(o.heads) * r) % kernels::kQBlock != 0)
        throw Error("bench decode: --lrkv rank " + std::to_string(r) + " with a " + name + " cache: the latent row of H r = " +
                    std::to_string(o.heads * r) + " values must be a multiple of " + std::to_string(kernels::kQBlock) +
                    " (its blocks); give ranks with H r % " + std::to_string(kernels::kQBlock) + " == 0 or leave " + name +
                    " out of --types");
  }
  for (const auto& name : o.isas) kernels::parse_decode_isa(name);
  if (o.q8_layout != "auto") kernels::parse_kv_layout(o.q8_layout);
  if (o.q4_layout != "auto") kernels::parse_kv_layout(o.q4_layout);
  if (o.bf16_layout != "auto") kernels::parse_kv_layout(o.bf16_layout);
  // An LLA row's key and value ranks at a compression: 2 T d_h / budget in all, 3/8 of it for keys.
  auto lla_ranks = [&](double budget) {
    const int total = static_cast<int>(std::lround(2.0 * o.lla_loops * o.head_dim / budget)), rk = total * 3 / 8;
    return std::pair<int, int>{rk, total - rk};
  };
  for (double budget : o.lla_budgets) {
    const auto [rk, rv] = lla_ranks(budget);
    if (rk < 1 || rv < 1)
      throw Error("bench decode: --lla " + format_number(budget) + "x leaves no rank at d_h " + std::to_string(o.head_dim) +
                  " and " + std::to_string(o.lla_loops) + " loops; give compressions up to " +
                  std::to_string(2 * o.lla_loops * o.head_dim / 3));
  }
  for (int h : o.kv_heads)
    if (h < 1 || o.heads % h != 0)
      throw Error("bench decode: --hkv " + std::to_string(h) + " does not divide the " + std::to_string(o.heads) +
                  " query heads; give divisors of " + std::to_string(o.heads));
  for (int r : o.lrkv_ranks)
    if (r < 1 || r > o.head_dim)
      throw Error("bench decode: --lrkv rank " + std::to_string(r) + " is outside [1, d_h = " + std::to_string(o.head_dim) +
                  "] (a rank above the head width adds cache without adding rank; r = 0 is one shared K/V, the --hkv 1 row)");
  torch::NoGradGuard ng;
  const int threads = torch::get_num_threads();
  nlohmann::json rows = nlohmann::json::array();
  std::mt19937 rng(0);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.head_dim)));
  std::vector<float> q(static_cast<size_t>(o.heads) * o.head_dim), out(q.size());
  for (auto& x : q) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);

  // Roofline inputs, measured in this run: the multiply-add peak per back end (its vector
  // width) and the read bandwidth, probed before, between and after the timings (this VM's
  // bandwidth drifts between phases minutes long).
  // q8/q4 scores are int8 dot products (the query quantised too), and bf16 scores bf16 dot
  // products where the back end has them (decode_dots_bf16), so their multiply-adds count against
  // that instruction's own peak; so do q8/q4 values where the back end weighs them in int16
  // (decode_weighs_values_in_int16).
  std::map<kernels::DecodeIsa, double> peak_gmacs, int8_peak_gmacs, bf16_peak_gmacs, int16_peak_gmacs;
  auto lanes_of = [](kernels::DecodeIsa isa) { return isa == kernels::DecodeIsa::Avx512 ? 16 : 8; };
  auto measure_peak = [&](kernels::DecodeIsa isa) {
    if (peak_gmacs.count(isa)) return;
    const int lanes = lanes_of(isa);
    peak_gmacs[isa] = kernels::measure_fma_peak_gmacs(lanes, threads, 0.5);
    int8_peak_gmacs[isa] = kernels::measure_int8_dot_peak_gmacs(lanes, threads, 0.5);
    bf16_peak_gmacs[isa] = kernels::decode_dots_bf16(isa) ? kernels::measure_bf16_dot_peak_gmacs(threads, 0.5) : peak_gmacs[isa];
    int16_peak_gmacs[isa] = kernels::decode_weighs_values_in_int16(isa, kernels::KVType::Q8)
                                ? kernels::measure_int16_dot_peak_gmacs(threads, 0.5)
                                : peak_gmacs[isa];
    rows.push_back({{"fma_peak_gmacs", peak_gmacs[isa]},
                    {"int8_dot_peak_gmacs", int8_peak_gmacs[isa]},
                    {"bf16_dot_peak_gmacs", bf16_peak_gmacs[isa]},
                    {"int16_dot_peak_gmacs", int16_peak_gmacs[isa]},
                    {"isa", kernels::decode_isa_name(isa)},
                    {"lanes", lanes},
                    {"threads", threads}});
    if (verbose)
      std::fprintf(stderr,
                   "bench decode: %s multiply-add peak %.1f G MAC/s (f32), %.1f (int8 dot products), %.1f (bf16 scores), "
                   "%.1f (int16 dot products: q8/q4 values)\n",
                   kernels::decode_isa_name(isa).c_str(), peak_gmacs[isa], int8_peak_gmacs[isa], bf16_peak_gmacs[isa],
                   int16_peak_gmacs[isa]);
  };
  // The back ends asked for, as requested (auto) and as the dense kernel resolves them.
  std::vector<kernels::DecodeIsa> requested, isas;
  for (const auto& name : o.isas) {
    const auto want = kernels::parse_decode_isa(name);
    const auto isa = kernels::resolve_decode_isa(want, o.head_dim);
    if (std::find(isas.begin(), isas.end(), isa) != isas.end()) continue;
    requested.push_back(want);
    isas.push_back(isa);
    measure_peak(isa);
  }
  // Each thread's scalar rate at the start and the end (measure_thread_scalar_rates: a vCPU whose core
  // is shared slows the compute-bound rows while the multiply-add probe reads its full peak).
  const std::vector<double> scalar_start = kernels::measure_thread_scalar_rates(threads, 0.1);
  // What starting a call's threads costs (measure_thread_wake_us): right after a region, as each
  // timed call here follows the cache eviction's, and after 1 ms alone; every row's time includes it.
  const double wake_us = kernels::measure_thread_wake_us(threads, 0.0), wake_idle_us = kernels::measure_thread_wake_us(threads, 1000.0, 50);
  if (verbose) std::cerr << "bench decode: measuring read bandwidth ...\n";
  const kernels::ReadBandwidthProbe probe(size_t{1} << 30, threads);
  std::vector<double> probes = {probe.measure(1.0)};
  // The compute the machine had, probed beside each bandwidth probe: this VM's multiply-add rate
  // also drifts (its f32 peak read 204-264 G MAC/s across runs). A short f32 multiply-add probe
  // (three passes, ~30 ms) at the widest back end's lanes; a row's compute floor is scaled by the
  // better of the two around its fastest call, as a share of the peak measured at the start
  // (compute_ratio). (Compute-bound calls have also run 1.5-1.8x slower for minutes with this probe
  // at 98-100%: README.)
  const kernels::DecodeIsa probe_isa =
      std::find(isas.begin(), isas.end(), kernels::DecodeIsa::Avx512) != isas.end() ? kernels::DecodeIsa::Avx512 : isas.front();
  auto compute_probe = [&] { return kernels::measure_fma_peak_gmacs(lanes_of(probe_isa), threads, 0.0); };
  std::vector<double> compute_probes = {compute_probe()};
  auto cold = [&](auto&& f, double seconds) { return cold_seconds_per_call(f, seconds, [&] { probe.evict_caches(); }); };

  // Per context, every timed kernel (back end, cache type, Hkv; LRKV ranks) runs in interleaved
  // rounds, best round each, with a bandwidth probe between every two kernels: ratios between
  // kernels (vs f32, LRKV vs the dense MHA kernel) compare like with like, and each kernel is
  // judged against the probes around its best calls (this VM's read bandwidth moves between
  // phases minutes long, by up to 1.9x).
  constexpr int kRounds = 5;
  struct Timing {
    kernels::DecodeIsa isa;
    size_t type;
    int hkv;
    int64_t ctx;
    double seconds, bytes, torch_seconds;
    int rank = -1;        // LRKV rows: the residual rank (hkv = heads); dense rows: -1
    kernels::DecodeIsa dense_isa = kernels::DecodeIsa::Auto;  // LRKV rows: the dense rows' back end of the same request
    double stream = 0.0;  // GB/s, the better probe either side of this kernel's calls in the round of its fastest
    double compute = 0.0;  // G MAC/s, the same for the compute probe
  };
  std::vector<Timing> timings;
  // Store layouts (DecodeBenchOptions::q8_layout, q4_layout, bf16_layout), one for every back end timed: the
  // dense stores' per KV head count and type, LRKV's K_s / V_s per type (bf16: rows).
  const bool avx2 = std::find(isas.begin(), isas.end(), kernels::DecodeIsa::Avx2) != isas.end();
  auto layout_of = [&](kernels::KVType type, int group) {
    if (type == kernels::KVType::Q8 && o.q8_layout != "auto") return kernels::parse_kv_layout(o.q8_layout);
    if (type == kernels::KVType::Q4 && o.q4_layout != "auto") return kernels::parse_kv_layout(o.q4_layout);
    const bool readable = std::all_of(isas.begin(), isas.end(), [&](kernels::DecodeIsa isa) { return kernels::decode_reads_tiled16(isa, type, group); });
    if (type == kernels::KVType::BF16 && o.bf16_layout != "auto" && group >= 1 && readable)
      return kernels::parse_kv_layout(o.bf16_layout);  // (groups read with heads in lanes, from rows, stay rows)
    return kernels::decode_kv_layout(type, o.head_dim, false, avx2 ? kernels::DecodeIsa::Avx2 : kernels::DecodeIsa::Auto, group);
  };
  std::vector<std::vector<kernels::KVLayout>> dense_layouts(o.kv_heads.size());  // [hkv][type]
  std::vector<kernels::KVLayout> shared_layouts;                               // [type]
  for (const auto& name : o.types) shared_layouts.push_back(layout_of(kernels::parse_kv_type(name), 0));
  std::vector<std::vector<kernels::KVStore>> dense(o.kv_heads.size());  // [hkv][type]
  for (size_t h = 0; h < o.kv_heads.size(); ++h)
    for (size_t type = 0; type < o.types.size(); ++type) {
      const auto t = kernels::parse_kv_type(o.types[type]);
      dense_layouts[h].push_back(layout_of(t, o.heads / o.kv_heads[h]));
      dense[h].emplace_back(t, o.kv_heads[h], o.head_dim, kernels::Eviction{}, 256, false, dense_layouts[h][type]);
    }
  // LRKV factored decode (SPEC 1.1) at the same H and d_h: K_s/V_s plus per-head latents of rank r.
  std::vector<std::vector<kernels::KVStore>> shared(o.lrkv_ranks.size()), residual(o.lrkv_ranks.size());  // [rank][type]
  for (size_t k = 0; k < o.lrkv_ranks.size(); ++k)
    for (size_t type = 0; type < o.types.size(); ++type) {
      const auto& name = o.types[type];
      shared[k].emplace_back(kernels::parse_kv_type(name), 1, o.head_dim, kernels::Eviction{}, 256, false, shared_layouts[type]);
      residual[k].emplace_back(kernels::parse_kv_type(name), 1, o.heads * o.lrkv_ranks[k]);
    }
  std::vector<float> qb(static_cast<size_t>(o.heads) * 256), out_s(q.size()), out_r(qb.size());
  for (auto& x : qb) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  for (int64_t ctx : o.contexts) {
    auto grow = [&](kernels::KVStore& s) { kernels::append_random_rows(s, ctx - s.length(), static_cast<uint32_t>(rng())); };
    const size_t first = timings.size();
    for (size_t h = 0; h < dense.size(); ++h)
      for (size_t i = 0; i < dense[h].size(); ++i) {
        grow(dense[h][i]);
        for (auto isa : isas)
          timings.push_back({isa, i, o.kv_heads[h], ctx, 1e30, static_cast<double>(kernels::decode_bytes_read(dense[h][i])), 0.0});
      }
    for (size_t k = 0; k < shared.size(); ++k)
      for (size_t i = 0; i < shared[k].size(); ++i) {
        grow(shared[k][i]);
        grow(residual[k][i]);
        for (size_t b = 0; b < isas.size(); ++b) {
          // auto picks AVX2 where AVX-512 cannot run (lrkv_decode.h)
          const auto isa = kernels::lrkv_decode_isa(requested[b], kernels::parse_kv_type(o.types[i]), o.head_dim, o.lrkv_ranks[k]);
          measure_peak(isa);
          timings.push_back({isa, i, o.heads, ctx, 1e30, static_cast<double>(shared[k][i].bytes() + residual[k][i].bytes()), 0.0,
                             o.lrkv_ranks[k], isas[b]});
        }
      }
    auto run = [&](const Timing& t) {
      if (t.rank < 0) {
        const size_t h = std::find(o.kv_heads.begin(), o.kv_heads.end(), t.hkv) - o.kv_heads.begin();
        kernels::decode_attention(q.data(), o.heads, dense[h][t.type], scale, out.data(), threads, t.isa);
      } else {
        const size_t k = std::find(o.lrkv_ranks.begin(), o.lrkv_ranks.end(), t.rank) - o.lrkv_ranks.begin();
        kernels::lrkv_decode_attention(q.data(), qb.data(), o.heads, shared[k][t.type], &residual[k][t.type], scale,
                                       out_s.data(), out_r.data(), threads, t.isa);
      }
    };
    // A kernel's fastest call is judged against the probes on either side of its calls in that
    // round (the better of the two): the bandwidth the machine had while it ran. A probe between
    // every two kernels, not only between rounds: a round whose bandwidth switched phase midway
    // judged its slow-phase calls against the fast phase's probe (76.7 GB/s against 41 GB/s of
    // a bf16 call that ran as fast as in slow-phase runs, on this project's Zen 5 VM).
    // Short probes (3 passes over 256 MiB, ~20 ms) keep them from costing more than the calls.
    auto short_probe = [&] { return probe.measure(0.0, size_t{256} << 20); };
    probes.push_back(short_probe());
    compute_probes.push_back(compute_probe());
    for (int round = 0; round < kRounds; ++round)
      for (size_t k = first; k < timings.size(); ++k) {
        const double before = probes.back(), compute_before = compute_probes.back();
        const double seconds = cold([&] { run(timings[k]); }, o.seconds_per_point / kRounds);
        probes.push_back(short_probe());
        compute_probes.push_back(compute_probe());
        if (seconds < timings[k].seconds) {
          timings[k].seconds = seconds;
          timings[k].stream = std::max(before, probes.back());
          timings[k].compute = std::max(compute_before, compute_probes.back());
        }
      }
    // The libtorch reference path on each dense f32 shape: scores, softmax, weighted sum.
    for (int hkv : o.kv_heads) {
      auto K = torch::randn({hkv, ctx, o.head_dim}), V = torch::randn({hkv, ctx, o.head_dim});
      auto Q = torch::randn({hkv, o.heads / hkv, o.head_dim});
      const double ts = cold([&] { torch::matmul(torch::softmax(torch::matmul(Q, K.transpose(1, 2)) * scale, -1), V); },
                             o.seconds_per_point);
      for (size_t k = first; k < timings.size(); ++k)
        if (timings[k].rank < 0 && timings[k].hkv == hkv) timings[k].torch_seconds = ts;
    }
    if (verbose)
      for (size_t k = first; k < timings.size(); ++k) {
        const Timing& t = timings[k];
        const std::string shape = t.rank < 0 ? "hkv " + std::to_string(t.hkv) : "lrkv r=" + std::to_string(t.rank);
        std::fprintf(stderr, "  %-6s %-4s %-9s context %6lld: %9.1f us/step %6.1f GB/s (probe %.1f GB/s)\n",
                     kernels::decode_isa_name(t.isa).c_str(), o.types[t.type].c_str(), shape.c_str(), static_cast<long long>(ctx),
                     t.seconds * 1e6, t.bytes / t.seconds / 1e9, t.stream);
      }
  }
  dense.clear();
  shared.clear();
  residual.clear();
  const double stream = *std::max_element(probes.begin(), probes.end());
  rows.push_back({{"stream_gbps", stream}, {"stream_probes_gbps", probes}, {"threads", threads}, {"evict_bytes", probe.evict_bytes()},
                  {"compute_probes_gmacs", compute_probes}, {"compute_probe_isa", kernels::decode_isa_name(probe_isa)},
                  {"compute_peak_gmacs", peak_gmacs[probe_isa]}, {"thread_scalar_rates_start", scalar_start},
                  {"thread_scalar_rates_end", kernels::measure_thread_scalar_rates(threads, 0.1)}, {"thread_wake_us", wake_us},
                  {"thread_wake_after_1ms_us", wake_idle_us},
                  {"omp_wait_policy", std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "unset"}});

  // GDN: a whole layer's decode step (projections, convolutions, state update) at each context.
  if (o.gdn_rows) {
    model::ModelConfig lc = train::preset("tiny").model;
    lc.hidden_size = 1024;
    lc.num_hidden_layers = 1;
    lc.layout = "gdn";
    lc.linear_num_heads = o.heads / 2;
    lc.linear_key_head_dim = lc.linear_value_head_dim = 2 * o.head_dim;
    lc.validate();
    torch::manual_seed(0);
    attention::GdnAttention layer(lc, 0);
    const auto x = torch::randn({1, 1, lc.hidden_size});
    double first = 0;
    for (int64_t ctx : o.contexts) {
      auto cache = layer.new_cache(1, attention::CacheOptions{});
      cache->append_random_history(ctx, static_cast<uint32_t>(rng()));
      double best = 1e30;
      for (int round = 0; round < kRounds; ++round)
        best = std::min(best, cold([&] { layer.step(x, *cache); }, o.seconds_per_point / kRounds));
      if (first == 0) first = best;
      rows.push_back({{"family", "gdn"}, {"context", ctx}, {"heads", lc.linear_num_heads},
                      {"key_dim", lc.linear_key_head_dim}, {"value_dim", lc.linear_value_head_dim},
                      {"hidden", lc.hidden_size}, {"us_per_step", best * 1e6}, {"vs_first_context", best / first},
                      {"state_bytes", cache->bytes()}});
      if (verbose)
        std::fprintf(stderr, "  gdn layer (d %d, %d heads of %dx%d) context %6lld: %9.1f us/step\n", lc.hidden_size,
                     lc.linear_num_heads, lc.linear_key_head_dim, lc.linear_value_head_dim, static_cast<long long>(ctx),
                     best * 1e6);
    }
  }

  // NAtS-L: the GDN state step plus attention over the kept blocks, per head group.
  if (!o.natsl_kept.empty()) {
    const int groups = o.heads / 2, GA = 2, K = GA * o.head_dim, block = 64;
    std::vector<float> state(static_cast<size_t>(groups) * K * K), qk(static_cast<size_t>(groups) * K),
        vk(qk.size()), g(groups, -0.01f), beta(groups, 0.5f), gdn_out(qk.size()), attn_out(q.size());
    for (auto* buf : {&state, &qk, &vk}) for (auto& x : *buf) x = std::normal_distribution<float>(0.0f, 0.05f)(rng);
    for (double f : o.natsl_kept)
      for (size_t type = 0; type < o.types.size(); ++type)
        for (int64_t ctx : o.contexts) {
          const int64_t kept = static_cast<int64_t>(std::floor(f * static_cast<double>(ctx / block) + 1e-9)) * block;
          if (kept < 1) continue;
          std::vector<kernels::KVStore> stores;
          for (int j = 0; j < groups; ++j) {
            stores.emplace_back(kernels::parse_kv_type(o.types[type]), GA, o.head_dim);
            kernels::append_random_rows(stores.back(), kept, static_cast<uint32_t>(rng()));
          }
          double best = 1e30;
          for (int round = 0; round < kRounds; ++round)
            best = std::min(best, cold([&] {
                              kernels::gdn_decode_step(state.data(), qk.data(), qk.data(), vk.data(), g.data(), beta.data(),
                                                       groups, K, K, scale, gdn_out.data(), threads);
                              at::parallel_for(0, groups, 1, [&](int64_t j0, int64_t j1) {  // as NatslAttention's fused step
                                for (int64_t j = j0; j < j1; ++j)
                                  kernels::decode_attention(q.data() + static_cast<size_t>(j) * GA * o.head_dim, GA, stores[j],
                                                            scale, attn_out.data() + static_cast<size_t>(j) * GA * o.head_dim, 1);
                              });
                            }, o.seconds_per_point / kRounds));
          double dense = 0;  // the dense MHA kernel, same context and type, first back end
          for (const Timing& t : timings)
            if (t.rank < 0 && t.hkv == o.heads && t.type == type && t.ctx == ctx && t.isa == isas.front()) dense = t.seconds;
          const double fraction = static_cast<double>(kept) / static_cast<double>(ctx);
          nlohmann::json row = {{"family", "natsl"}, {"cache", o.types[type]}, {"context", ctx}, {"heads", o.heads},
                                {"head_dim", o.head_dim}, {"kept_fraction", fraction}, {"us_per_step", best * 1e6}};
          if (dense > 0) {
            row["dense_us_per_step"] = dense * 1e6;
            row["speedup_vs_dense"] = dense / best;
            row["target_speedup_vs_dense"] = 0.8 / fraction;
          }
          rows.push_back(row);
          if (verbose)
            std::fprintf(stderr, "  natsl %-4s kept %.2f context %6lld: %9.1f us/step%s\n", o.types[type].c_str(), fraction,
                         static_cast<long long>(ctx), best * 1e6,
                         dense > 0 ? (" (" + std::to_string(dense / best).substr(0, 4) + "x dense)").c_str() : "");
        }
  }

  // LLA: reconstruct-on-read over per-head codes (SPEC 1.3), one loop's read of one layer.
  for (double budget : o.lla_budgets) {
    const int T = o.lla_loops;
    const auto [rk, rv] = lla_ranks(budget);
    const int H = o.heads, d = o.head_dim;
    auto panel = [&](int rank) { return torch::randn({H, rank, d}) * (1.0 / std::sqrt(static_cast<double>(rank))); };
    const auto up_k = panel(rk), up_v = panel(rv), mu_k = torch::randn({H, d}) * 0.1, mu_v = torch::randn({H, d}) * 0.1;
    std::vector<double> inv_freq;
    for (int m = 0; m < d / 2; ++m) inv_freq.push_back(std::pow(10000.0, -2.0 * m / d));
    std::vector<float> tail_k(static_cast<size_t>(H) * d), tail_v(tail_k.size());
    for (auto* buf : {&tail_k, &tail_v}) for (auto& x : *buf) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    for (int64_t ctx : o.contexts) {
      const auto codes_k = torch::randn({H, ctx, rk}), codes_v = torch::randn({H, ctx, rv});
      kernels::LlaDecodeArgs a;
      a.heads = a.kv_heads = a.groups = H;
      a.head_dim = d;
      a.key_codes = codes_k.data_ptr<float>(), a.value_codes = codes_v.data_ptr<float>();
      a.key_group_stride = ctx * rk, a.value_group_stride = ctx * rv;
      a.history = {{0, ctx - 1, 0}};  // the query's own token is the exact tail
      a.keys = {up_k.data_ptr<float>(), mu_k.data_ptr<float>(), rk};
      a.values = {up_v.data_ptr<float>(), mu_v.data_ptr<float>(), rv};
      a.inv_freq = inv_freq.data();
      a.tail_keys = tail_k.data(), a.tail_values = tail_v.data(), a.tail = 1;
      a.scale = scale;
      auto absorbed = a;
      absorbed.mode = kernels::LlaReadMode::Absorbed;
      double read = 1e30, rebuild = 1e30, absorbed_s = 1e30;
      volatile double sink = 0;
      for (int round = 0; round < kRounds; ++round) {
        read = std::min(read, cold([&] { kernels::lla_decode_attention(a, q.data(), nullptr, out.data(), threads); },
                                            o.seconds_per_point / kRounds));
        rebuild = std::min(rebuild, cold([&] { sink = sink + kernels::lla_reconstruct_keys_only(a, threads); },
                                                  o.seconds_per_point / kRounds));
        absorbed_s = std::min(absorbed_s, cold([&] {
                                kernels::lla_decode_attention(absorbed, q.data(), q.data(), out.data(), threads);
                              }, o.seconds_per_point / kRounds));
      }
      double dense = 0;  // the f32 MHA kernel at the same context, first back end
      for (const Timing& t : timings)
        if (t.rank < 0 && t.hkv == H && kernels::parse_kv_type(o.types[t.type]) == kernels::KVType::F32 && t.ctx == ctx &&
            t.isa == isas.front())
          dense = t.seconds;
      const double bytes = static_cast<double>(kernels::lla_decode_bytes_read(a));
      const double macs = static_cast<double>(ctx) * H * (static_cast<double>(rk) * d + d + rv);  // rebuild, score, value codes
      nlohmann::json row = {{"family", "lla"}, {"budget", budget}, {"loops", T}, {"rank_k", rk}, {"rank_v", rv},
                            {"context", ctx}, {"heads", H}, {"head_dim", d}, {"us_per_step", read * 1e6},
                            {"bytes_read", bytes}, {"full_kv_bytes_read", 2.0 * ctx * H * d * 4},
                            {"persistent_bytes_vs_full", 1.0 / budget}, {"gbps", bytes / read / 1e9},
                            {"macs", macs}, {"gmacs", macs / read / 1e9},
                            {"reconstruct_us", rebuild * 1e6}, {"reconstruct_share", std::min(1.0, rebuild / read)},
                            {"absorbed_us_per_step", absorbed_s * 1e6}};
      if (dense > 0) {
        row["dense_f32_us_per_step"] = dense * 1e6;
        row["speedup_vs_dense_f32"] = dense / read;
        row["absorbed_speedup_vs_dense_f32"] = dense / absorbed_s;
      }
      rows.push_back(row);
      if (verbose)
        std::fprintf(stderr, "  lla %gx (r %d,%d) context %6lld: %9.1f us/step (%.0f%% rebuilding keys), absorbed %9.1f us%s\n",
                     budget, rk, rv, static_cast<long long>(ctx), read * 1e6, 100 * std::min(1.0, rebuild / read),
                     absorbed_s * 1e6, dense > 0 ? (", f32 MHA " + std::to_string(dense * 1e6).substr(0, 7) + " us").c_str() : "");
    }
  }

  for (const Timing& t : timings) {
    double f32_s = 0.0, mha_s = 0.0;
    for (const Timing& u : timings) {
      if (u.ctx != t.ctx) continue;
      if (u.isa == t.isa && u.rank == t.rank && u.hkv == t.hkv && kernels::parse_kv_type(o.types[u.type]) == kernels::KVType::F32)
        f32_s = u.seconds;
      if (t.rank >= 0 && u.rank < 0 && u.isa == t.dense_isa && u.hkv == o.heads && u.type == t.type) mha_s = u.seconds;
    }
    // Multiply-adds per step: scores and values, every query head, every cached row (LRKV: the
    // shared width plus the latent's); q8/q4 scores at the int8 dot-product peak, bf16 scores at
    // the bf16 one (the f32 peak where the back end widens them, and for the LRKV latents it
    // widens: lrkv_latent_scores_in_bf16), and the values there too where the kernel rounds their
    // weights to bf16 (LRKV's V_s and the latents it dots in bf16: lrkv_rounds_value_weights; dense
    // from 8 queries a KV head: decode_rounds_value_weights), q8/q4
    // values (dense, and LRKV's V_s) at the int16 one where the back end weighs them in int16
    // (decode_weighs_values_in_int16), the rest at the f32 multiply-add peak.
    const int width = o.head_dim + std::max(t.rank, 0);
    const double macs = 2.0 * o.heads * static_cast<double>(t.ctx) * width;
    // (LRKV latents of q8/q4 that the kernel dequantises count as f32)
    const kernels::KVType type = kernels::parse_kv_type(o.types[t.type]);
    const bool quant = type == kernels::KVType::Q8 || type == kernels::KVType::Q4;
    const double scored_rows = static_cast<double>(o.heads) * t.ctx;  // query heads x cached rows
    const double int8_macs = !quant ? 0.0
                             : scored_rows * (o.head_dim + (t.rank > 0 && kernels::lrkv_latent_scores_in_int8(t.isa, type, t.rank) ? t.rank : 0));
    const double bf16_row = type != kernels::KVType::BF16 ? 0.0
                            : o.head_dim + (t.rank > 0 && kernels::lrkv_latent_scores_in_bf16(t.isa, type, o.heads, t.rank) ? t.rank : 0);
    const bool bf16_values = t.rank >= 0 ? kernels::lrkv_rounds_value_weights(t.isa, type)
                                         : kernels::decode_rounds_value_weights(t.isa, type, o.heads / t.hkv);
    const double bf16_macs = scored_rows * bf16_row * (bf16_values ? 2 : 1);
    const double int16_macs = kernels::decode_weighs_values_in_int16(t.isa, type) ? scored_rows * o.head_dim : 0.0;
    // every peak scaled by the compute the machine had around the row's fastest call (at most the start's)
    const double compute_ratio = std::min(1.0, t.compute / peak_gmacs[probe_isa]);
    const double fma_floor = (int8_macs / (int8_peak_gmacs[t.isa] * 1e9) + bf16_macs / (bf16_peak_gmacs[t.isa] * 1e9) +
                              int16_macs / (int16_peak_gmacs[t.isa] * 1e9) +
                              (macs - int8_macs - bf16_macs - int16_macs) / (peak_gmacs[t.isa] * 1e9)) /
                             compute_ratio;
    const double bw_floor = t.bytes / (t.stream * 1e9);
    const double floor = std::max(bw_floor, fma_floor), s = t.seconds;
    nlohmann::json row = {{"cache", o.types[t.type]},
                          {"context", t.ctx},
                          {"hkv", t.hkv},
                          {"heads", o.heads},
                          {"head_dim", o.head_dim},
                          {"isa", kernels::decode_isa_name(t.isa)},
                          {"layout", kernels::kv_layout_name(t.rank >= 0 ? shared_layouts[t.type]
                                                                         : dense_layouts[std::find(o.kv_heads.begin(), o.kv_heads.end(), t.hkv) -
                                                                                         o.kv_heads.begin()][t.type])},
                          {"us_per_step", s * 1e6},
                          {"bytes_read", t.bytes},
                          {"gbps", t.bytes / s / 1e9},
                          {"bw_ratio", t.bytes / s / 1e9 / t.stream},
                          {"probe_gbps", t.stream},
                          {"compute_probe_gmacs", t.compute},
                          {"compute_ratio", compute_ratio},
                          {"macs", macs},
                          {"bw_floor_us", bw_floor * 1e6},
                          {"fma_floor_us", fma_floor * 1e6},
                          {"bound", bw_floor >= fma_floor ? "memory" : "compute"},
                          {"of_roofline", floor / s},
                          {"torch_us_per_step", t.torch_seconds * 1e6},
                          {"fused_speedup_vs_torch", t.torch_seconds / s}};
    if (t.rank >= 0) {
      const double ratio = (o.head_dim + static_cast<double>(o.heads) * t.rank) / (static_cast<double>(o.heads) * o.head_dim);
      row["family"] = "lrkv";
      row["rank"] = t.rank;
      row["cache_vs_mha"] = ratio;
      row.erase("torch_us_per_step");
      row.erase("fused_speedup_vs_torch");
      if (mha_s > 0) {
        row["speedup_vs_mha"] = mha_s / s;             // the dense MHA kernel, same H, d_h, element type
        row["target_speedup_vs_mha"] = 0.8 / ratio;    // issue target: 0.8 x the inverse cache ratio
        row["roofline_speedup_vs_mha"] = mha_s / floor;  // what a kernel at this row's roofline would reach
      }
    }
    if (f32_s > 0) {
      row["speedup_vs_f32"] = f32_s / s;
      row["roofline_speedup_vs_f32"] = f32_s / floor;  // what a kernel at this type's roofline would reach
    }
    rows.push_back(row);
  }

  if (o.whole_model) {
    const auto cfg = train::preset("tiny").model;
    for (const auto& name : o.types) {
      attention::CacheOptions co;
      co.type = kernels::parse_kv_type(name);
      for (int64_t ctx : o.contexts) {
        const double tps = decode_tokens_per_second(cfg, co, ctx, o.seconds_per_point);
        rows.push_back({{"model", "tiny"}, {"cache", name}, {"context", ctx}, {"tokens_per_s", tps}});
        if (verbose)
          std::fprintf(stderr, "  tiny model, %-4s context %6lld: %7.1f tokens/s\n", name.c_str(), static_cast<long long>(ctx), tps);
      }
    }
  }
  return rows;
}

nlohmann::json bench_tokenizer(const std::string& data_dir, int vocab_size, bool verbose) {
  std::vector<text::Document> brown;
  for (auto& d : text::load_documents(data_dir))
    if (d.source == "brown") brown.push_back(std::move(d));
  if (brown.empty()) throw Error("no Brown corpus under " + data_dir + "; run `kvx data fetch`");
  std::string corpus;
  for (const auto& d : brown) corpus += d.text + "\n\n";
  const double mb = corpus.size() / 1e6;
  if (verbose) std::cerr << "bench tokenizer: training " << vocab_size << " tokens on " << mb << " MB of Brown text\n";
  auto t0 = Clock::now();
  text::BpeTrainOptions o;
  o.vocab_size = vocab_size;
  auto tok = text::BpeTokenizer::train(corpus, o);
  const double train_s = since(t0);
  t0 = Clock::now();
  auto ids = tok.encode(corpus);
  const double enc_s = since(t0);
  t0 = Clock::now();
  auto back = tok.decode(ids);
  const double dec_s = since(t0);
  if (back != corpus) throw Error("bench tokenizer: decode(encode(brown)) differs from the input: tokenizer bug");
  return {{"corpus_mb", mb},
          {"vocab_size", tok.vocab_size()},
          {"tokens", ids.size()},
          {"bytes_per_token", corpus.size() / static_cast<double>(ids.size())},
          {"train_seconds", train_s},
          {"train_mb_per_s", mb / train_s},
          {"encode_mb_per_s", mb / enc_s},
          {"decode_mb_per_s", mb / dec_s},
          {"round_trip_exact", true}};
}

}  // namespace kvx::eval
