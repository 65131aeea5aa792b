#include "train/trainer.h"

#include <chrono>
#include <csignal>
#include <functional>
#include <memory>
#include <optional>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "eval/evaluate.h"
#include "eval/plot.h"
#include "io/atomic_file.h"
#include "io/dir_lock.h"
#include "model/memory.h"
#include "model/transformer.h"
#include "train/adamw.h"
#include "train/checkpoint.h"
#include "text/corpus.h"
#include "train/distributed.h"
#include "util/error.h"
#include "util/fault.h"

namespace kvx::train {

std::string format_duration(double s) {
  char buf[32];
  int m = static_cast<int>(s) / 60, sec = static_cast<int>(s) % 60;
  if (m >= 60)
    std::snprintf(buf, sizeof buf, "%dh%02dm", m / 60, m % 60);
  else
    std::snprintf(buf, sizeof buf, "%dm%02ds", m, sec);
  return buf;
}

namespace {

constexpr int kMaxBadSteps = 3, kMaxRollbacks = 3;

struct LossLog {
  std::string path;
  eval::Series train{"train loss", {}, {}}, val{"validation CE", {}, {}}, unigram{"unigram CE (validation)", {}, {}};

  // Reads an existing log, dropping rows after `keep_until` (steps a resumed run will redo).
  void load(int64_t keep_until) {
    std::string kept;
    if (io::file_exists(path)) {
      std::istringstream in(io::read_file(path));
      std::string line;
      while (std::getline(in, line)) {
        if (line.empty()) continue;
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.contains("step") || j["step"].get<int64_t>() > keep_until) continue;
        kept += line + "\n";
        add(j);
      }
    }
    io::write_file_atomic(path, kept);
  }
  void add(const nlohmann::json& j) {
    double s = j["step"].get<double>();
    if (j.contains("loss")) train.x.push_back(s), train.y.push_back(j["loss"].get<double>());
    if (j.contains("val_ce")) {
      val.x.push_back(s), val.y.push_back(j["val_ce"].get<double>());
      unigram.x.push_back(s), unigram.y.push_back(j["unigram_ce"].get<double>());
    }
  }
  void append(const nlohmann::json& j) {
    std::ofstream out(path, std::ios::app);
    out << j.dump() << "\n";
    out.flush();
    if (!out) throw Error("cannot append to '" + path + "' (disk full or not writable?); the last checkpoint is intact, --resume once fixed");
    add(j);
  }
  void plot(const std::string& png, const std::string& name) {
    eval::plot_lines(png, "kvx train: " + name, "step", "cross-entropy (nats/token)", {train, val, unigram});
  }
};

// The settings that fix the order of the training data (what a resumed sampler replays), the
// first one changed between the checkpoint's run config and this one ("" if none). Steps,
// learning rate and evaluation settings may change on resume; these may not.
std::string data_order_change(const RunConfig& saved, const RunConfig& now) {
  auto changed = [](const std::string& name, const auto& a, const auto& b) {
    return nlohmann::json(a) == nlohmann::json(b) ? std::string()
                                                  : name + " (" + nlohmann::json(a).dump() + " -> " + nlohmann::json(b).dump() + ")";
  };
  for (const std::string& c : {changed("train.batch_size", saved.train.batch_size, now.train.batch_size),
                               changed("train.seq_len", saved.train.seq_len, now.train.seq_len),
                               changed("data.sources", saved.data.sources, now.data.sources),
                               changed("data.mqar_fraction", saved.data.mqar_fraction, now.data.mqar_fraction),
                               changed("data.mqar_max_pairs", saved.data.mqar_max_pairs, now.data.mqar_max_pairs),
                               changed("data.mqar_symbols", saved.data.mqar_symbols, now.data.mqar_symbols)})
    if (!c.empty()) return c;
  return "";
}

}  // namespace

TrainingData prepare_training_data(const RunConfig& config) {
  const std::string dir = config.data.data_dir.empty() ? text::default_data_dir() : config.data.data_dir;
  TrainingData d;
  d.tokenizer = load_or_train_tokenizer(dir, config.data.sources, config.model.vocab_size);
  if (d.tokenizer.vocab_size() != config.model.vocab_size)
    std::cerr << "note: the tokenizer reached " << d.tokenizer.vocab_size() << " tokens (asked " << config.model.vocab_size << ")\n";
  d.train = load_split_tokens(dir, config.data.sources, d.tokenizer, text::Split::Train);
  d.validation = load_split_tokens(dir, config.data.sources, d.tokenizer, text::Split::Validation);
  return d;
}

TrainingData training_data_for(const text::BpeTokenizer& tokenizer, const std::string& data_dir,
                               const std::vector<std::string>& sources) {
  const std::string dir = data_dir.empty() ? text::default_data_dir() : data_dir;
  TrainingData d;
  d.tokenizer = tokenizer;
  d.train = load_split_tokens(dir, sources, d.tokenizer, text::Split::Train);
  d.validation = load_split_tokens(dir, sources, d.tokenizer, text::Split::Validation);
  return d;
}

TrainSummary run_training(const TrainArgs& args, const TrainingData& data) {
  const RunConfig& cfg = args.config;
  const TrainOptions& opt = cfg.train;
  cfg.validate();
  if (data.tokenizer.vocab_size() > cfg.model.vocab_size)
    throw Error("the tokenizer has " + std::to_string(data.tokenizer.vocab_size()) + " tokens but model.vocab_size is " +
                std::to_string(cfg.model.vocab_size));
  // Refuse what cannot fit before building anything (memory here, disk space below).
  const std::string job = "training '" + cfg.name + "'";
  model::MemoryEstimate need = model::training_memory(cfg.model, opt.batch_size, opt.seq_len);
  for (double* part : {&need.weights, &need.gradients, &need.optimizer, &need.activations})
    *part *= args.distributed.local_workers;  // the workers on this machine share its memory
  model::require_memory(need, model::available_memory_bytes(), job,
                        "lower train.batch_size or train.seq_len, or train a smaller model");

  // Data-parallel workers (distributed.h): rank 0 alone reads and writes the run directory and
  // sends what the others need (weights, optimizer state, sampler states, decisions).
  std::unique_ptr<ProcessGroup> group;
  if (args.distributed.enabled()) group = std::make_unique<ProcessGroup>(args.distributed);
  const bool root = !group || group->is_root();
  const int rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  const bool verbose = args.verbose && root;
  // Runs `decide` on rank 0 and gives every rank its result, or its error.
  auto agree = [&](const std::function<std::string()>& decide) {
    std::string value, error;
    if (root) try {
        value = decide();
      } catch (const std::exception& e) {
        error = e.what();
      }
    if (group) {
      const auto j = nlohmann::json::parse(group->broadcast_string(nlohmann::json{{"value", value}, {"error", error}}.dump()));
      value = j["value"].get<std::string>();
      error = j["error"].get<std::string>();
    }
    if (!error.empty()) throw Error(error);
    return value;
  };
  if (group) {  // every worker must train the same thing on the same tokens
    // The whole run config (learning rate, clipping, optimizer, data and MQAR settings too: a worker
    // with another lr applied another update to the same averaged gradient), less its name and the
    // data path, which may differ by machine.
    nlohmann::json same = cfg.to_json();
    same.erase("name");
    if (same.contains("data")) same["data"].erase("data_dir");
    const std::string mine = text::sha256_hex(same.dump() + std::to_string(args.stop_after) + std::to_string(args.data_shards) +
                                              data.tokenizer.to_json());
    const auto all = group->gather_strings(mine);
    for (int r = 0; r < static_cast<int>(all.size()); ++r)
      if (all[r] != all[0])
        throw Error("worker " + std::to_string(r) + "'s run config (model, training, data settings), run length or tokenizer "
                    "differs from worker 0's; start every worker with the same --config/--preset, options and data");
  }
  std::optional<io::DirLock> run_dir_lock;  // rank 0's, for the whole run
  const std::string latest = agree([&] {
    // Room for a checkpoint being written besides the `keep` (2) kept (weights and AdamW's two
    // moments), less those a resumed run already has on disk.
    const int on_disk = args.resume ? static_cast<int>(checkpoint_names(args.run_dir).size()) : 0;
    const int to_write = 3 - std::min(on_disk, 2);
    io::check_output_dir(args.run_dir, to_write * (12.0 * model::parameter_count(cfg.model) + (1 << 20)), job);
    run_dir_lock.emplace(args.run_dir, job);
    const std::string l = latest_checkpoint(args.run_dir);
    if (!l.empty() && !args.resume)
      throw Error("run directory '" + args.run_dir + "' already has a checkpoint (" + l +
                  "); pass --resume to continue it or --out to start a new run elsewhere");
    return l;
  });

  torch::manual_seed(opt.seed);
  model::Transformer model(cfg.model);
  if (!args.init_from.empty() && latest.empty() && root) {  // fine-tuning: start from given weights (a resumed run has its own)
    const std::string dir = resolve_model_dir(args.init_from);
    model->load_state_dict_hf(nn::load_safetensors(dir + "/model.safetensors"), dir + "/model.safetensors");
    if (verbose) std::cerr << "initialised from " << dir << "\n";
  }
  model->train();
  AdamW optimizer(model->named_parameters().pairs(),
                  AdamWOptions{opt.beta1, opt.beta2, opt.eps, opt.weight_decay});
  const int shards = args.data_shards > 0 ? args.data_shards : world;
  if (shards % world != 0)
    throw Error("data shards (" + std::to_string(shards) + ") must be a multiple of the number of workers (" +
                std::to_string(world) + ")");
  BatchSampler sampler(&data.train.tokens, opt.batch_size, opt.seq_len, opt.seed,
                       MqarMix{cfg.data.mqar_fraction, cfg.data.mqar_max_pairs, cfg.model.vocab_size, cfg.data.mqar_symbols},
                       DataShards{rank * shards / world, shards / world, shards});
  std::vector<torch::Tensor> params = model->parameters();
  std::unique_ptr<GradientBuckets> buckets;
  if (group) buckets = std::make_unique<GradientBuckets>(*group, params);
  int64_t step = 0;

  // Loads checkpoint `ckpt` (read by rank 0, sent to the others); returns its step and leaves
  // every rank's sampler where its worker was.
  auto restore = [&](const std::string& ckpt) {
    TrainerState st;
    std::string err;
    if (root) try {  // any failure here is every rank's (agree below)
        st = read_trainer_state(ckpt);
        const RunConfig saved = RunConfig::from_json(st.run_config);
        const std::string order = data_order_change(saved, cfg);
        if (saved.model.to_json() != cfg.model.to_json())
          err = ckpt + ": the checkpoint's model config differs from the given config; resume with the same config (see " +
                ckpt + "/trainer_state.json) or train into a new --out directory";
        else if (text::BpeTokenizer::load(ckpt + "/tokenizer.json").to_json() != data.tokenizer.to_json())
          err = ckpt + ": the checkpoint's tokenizer.json differs from the training data's tokenizer, so token ids would change "
                "meaning; resume with the data.sources, data.data_dir and model.vocab_size the run started with, or train into "
                "a new --out directory";
        else if (!order.empty())
          err = ckpt + ": " + order + " differs from the checkpoint's, so the data would not continue where it stopped; "
                "resume with the checkpoint's setting (see " + ckpt + "/trainer_state.json) or train into a new --out directory";
        else if (static_cast<int>(st.sampler_states.size()) != world)
          err = ckpt + " was written by " + std::to_string(st.sampler_states.size()) +
                " data-parallel workers; resume it with --nproc " + std::to_string(st.sampler_states.size());
        else {
          load_optimizer_state(ckpt, optimizer);
          model->load_state_dict_hf(nn::load_safetensors(ckpt + "/model.safetensors"), ckpt + "/model.safetensors");
        }
      } catch (const std::exception& e) {
        err = e.what();
      }
    const auto j = nlohmann::json::parse(agree([&] {
      if (!err.empty()) throw Error(err);
      return nlohmann::json{{"step", st.step}, {"samplers", st.sampler_states}}.dump();
    }));
    if (group) {
      group->broadcast(params);
      auto state = optimizer.state();
      std::vector<torch::Tensor> tensors;
      for (auto& [name, t] : state) tensors.push_back(t);
      group->broadcast(tensors);
      optimizer.load_state(state, "optimizer state from rank 0");
    }
    sampler.set_state(j["samplers"][rank].get<std::string>());
    return j["step"].get<int64_t>();
  };

  LossLog log;
  log.path = args.run_dir + "/log.jsonl";
  if (args.resume && !latest.empty()) {
    step = restore(latest);
    if (verbose) std::cerr << "resuming " << args.run_dir << " from step " << step << "\n";
  } else if (group) {
    group->broadcast(params);  // identical initial weights everywhere
  }
  if (root) {
    log.load(step);
    io::write_file_atomic(args.run_dir + "/run_config.json", cfg.to_json().dump(2) + "\n");
  }

  auto val_batches = evaluation_batches(data.validation.tokens, opt.eval_batches * opt.batch_size, opt.batch_size, opt.seq_len);
  const eval::LmQuality unigram = eval::unigram_quality(data.train.tokens, cfg.model.vocab_size, val_batches, data.tokenizer);
  if (verbose)
    std::cerr << "model: " << model->num_parameters() << " parameters (" << model->num_parameters(false)
              << " without embeddings), KV cache " << model->kv_bytes_per_token() << " bytes/token; "
              << data.train.tokens.size() << " training tokens"
              << (group ? ", " + std::to_string(world) + " data-parallel workers" : std::string()) << "\n";

  TrainSummary sum;
  sum.run_dir = args.run_dir;
  sum.unigram_cross_entropy = unigram.cross_entropy;
  const int64_t end = args.stop_after >= 0 ? std::min<int64_t>(args.stop_after, opt.steps) : opt.steps;
  const int64_t tokens_per_step = static_cast<int64_t>(opt.batch_size) * opt.seq_len * world;
  auto t_start = std::chrono::steady_clock::now();
  auto t_window = t_start;
  double window_loss = 0;
  int window_steps = 0;
  int64_t first_step = step;
  int bad_in_a_row = 0, rollbacks = 0;

  auto checkpoint = [&] {
    std::vector<std::string> samplers = group ? group->gather_strings(sampler.state()) : std::vector<std::string>{sampler.state()};
    if (root) save_checkpoint(args.run_dir, model, data.tokenizer, optimizer, TrainerState{step, samplers, cfg.to_json()});
  };
  auto evaluate = [&] {
    if (!root) return;
    auto q = eval::evaluate_lm(model, val_batches, data.tokenizer);
    sum.val_cross_entropy = q.cross_entropy;
    sum.val_bits_per_byte = q.bits_per_byte;
    log.append({{"step", step}, {"val_ce", q.cross_entropy}, {"val_bpb", q.bits_per_byte}, {"unigram_ce", unigram.cross_entropy}});
    if (verbose) {
      std::fprintf(stderr, "eval  step %lld | validation CE %.4f (ppl %.1f, %.3f bits/byte) | unigram CE %.4f\n",
                   static_cast<long long>(step), q.cross_entropy, q.perplexity, q.bits_per_byte, unigram.cross_entropy);
    }
    log.plot(args.run_dir + "/loss.png", cfg.name);
  };

  // After kMaxBadSteps non-finite steps in a row: back to the last checkpoint, skipping the
  // batches that led here (as PaLM does after a loss spike); after kMaxRollbacks, give up.
  auto roll_back = [&] {
    const int64_t failed = step;
    const std::string ckpt = agree([&] {
      const std::string c = latest_checkpoint(args.run_dir);
      const std::string fix = "; lower train.lr (now " + std::to_string(opt.lr) + ") or raise train.warmup";
      if (c.empty())
        throw Error("training diverged: non-finite loss or gradients for " + std::to_string(kMaxBadSteps) +
                    " steps in a row (up to step " + std::to_string(failed) + ") before the first checkpoint" + fix);
      if (rollbacks + 1 > kMaxRollbacks)
        throw Error("training diverged: non-finite loss or gradients again at step " + std::to_string(failed) + " after " +
                    std::to_string(kMaxRollbacks) + " roll-backs to the last checkpoint" + fix + ", then --resume");
      return c;
    });
    ++rollbacks;
    step = first_step = restore(ckpt);
    for (int64_t i = step; i < failed; ++i) sampler.next();
    t_start = t_window = std::chrono::steady_clock::now();
    window_loss = 0;
    window_steps = bad_in_a_row = 0;
    if (root) {
      log.load(step);
      log.append({{"step", step}, {"rolled_back_from", failed}, {"skipped_batches", failed - step}});
      std::fprintf(stderr, "rolled back from step %lld to the checkpoint at step %lld; its %lld batches are skipped\n",
                   static_cast<long long>(failed), static_cast<long long>(step), static_cast<long long>(failed - step));
    }
  };

  while (step < end) {
    const double lr = learning_rate(opt, static_cast<int>(step));
    auto [x, y] = sampler.next();
    optimizer.zero_grad();
    auto loss = model->lm_loss(x, y);  // cross-entropy (with an exit gate: expected over the exit loop)
    if (fault_at("train.nan_loss")) loss = loss * std::numeric_limits<double>::quiet_NaN();
    double l = loss.item<double>();
    if (group) {  // weigh each worker by its targets (MQAR rows ignore some): the mean over all of them
      const double mine = (y != kIgnoreTarget).sum().item<double>();
      auto sums = torch::tensor({mine, l * mine}, torch::kDouble);  // one all-reduce: targets, loss sums
      group->sum(sums);
      const double all = std::max(sums[0].item<double>(), 1.0);
      l = sums[1].item<double>() / all;
      loss = loss * (mine * world / all);
    }
    loss.backward();  // also when not finite: every worker's hooks must run (the step is then skipped)
    if (buckets) buckets->finish();
    const double grad_norm = torch::nn::utils::clip_grad_norm_(params, opt.grad_clip);
    ++step;
    if (!std::isfinite(l) || !std::isfinite(grad_norm)) {  // never applied: one NaN update poisons every weight
      const std::string what = std::isfinite(l) ? "non-finite gradient norm" : "non-finite loss";
      ++bad_in_a_row;
      if (root) {
        log.append({{"step", step}, {"skipped", what}});
        std::fprintf(stderr, "step %lld: %s; update skipped (%d in a row)\n", static_cast<long long>(step), what.c_str(),
                     bad_in_a_row);
      }
      if (bad_in_a_row >= kMaxBadSteps) {
        roll_back();
        continue;
      }
    } else {
      optimizer.step(lr);
      bad_in_a_row = 0;
      window_loss += l;
      ++window_steps;
    }
    if (fault_at("train.kill")) ::raise(SIGKILL);
    if ((step % opt.log_every == 0 || step == end) && window_steps > 0) {
      auto now = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(now - t_window).count();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double tps = window_steps * tokens_per_step / std::max(dt, 1e-9);
      const double eta = elapsed / std::max<int64_t>(step - first_step, 1) * (end - step);
      sum.train_loss = window_loss / window_steps;
      if (root) {
        nlohmann::json row = {{"step", step}, {"loss", sum.train_loss}, {"lr", lr}, {"grad_norm", grad_norm}, {"tokens_per_s", tps}};
        if (buckets) row["allreduce_wait_s"] = buckets->seconds_waiting();
        log.append(row);
      }
      if (verbose)
        std::fprintf(stderr, "step %5lld/%d | loss %.4f | lr %.2e | grad %.2f | %.0f tok/s | %s elapsed, ETA %s\n",
                     static_cast<long long>(step), opt.steps, sum.train_loss, lr, grad_norm, tps,
                     format_duration(elapsed).c_str(), format_duration(eta).c_str());
      t_window = now;
      window_loss = 0;
      window_steps = 0;
    }
    if (step % opt.eval_every == 0 || step == opt.steps) evaluate();
    if (step % opt.checkpoint_every == 0 || step == end) checkpoint();
  }
  if (step == first_step && sum.val_cross_entropy == 0) evaluate();
  sum.step = step;
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  sum.tokens_per_second = (step - first_step) * tokens_per_step / std::max(sum.seconds, 1e-9);
  if (buckets) sum.allreduce_wait_seconds = buckets->seconds_waiting();
  if (group) group->barrier();  // rank 0 hosts the store: nobody leaves while another still needs it
  return sum;
}

}  // namespace kvx::train
