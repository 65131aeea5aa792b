// Reliability of training (issue 9): a run killed at any moment (SIGKILL, also inside checkpoint
// writes) resumes from its last complete checkpoint and reproduces the uninterrupted loss trace;
// a full disk fails the write without touching the previous checkpoint; non-finite steps are
// skipped and, repeated, rolled back; runs that cannot fit are refused up front; same seed,
// config and threads give the same trace.
//
// The kill tests re-execute this binary as a child process running CrashSafety.Worker.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "io/atomic_file.h"
#include "io/safetensors_format.h"
#include "model/memory.h"
#include "nn/tensor_io.h"
#include "support/child_process.h"
#include "support/fixtures.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "util/error.h"

using namespace kvx;
namespace fs = std::filesystem;

namespace {

using kvx::testing::temp_dir;

// The training tests' run, logging every step and evaluating rarely (long runs: random kills
// land during training).
train::RunConfig reliability_run(int steps) {
  train::RunConfig c = kvx::testing::small_run(steps);
  c.train.warmup = 4;
  c.train.eval_every = 20;
  c.train.log_every = 1;
  return c;
}
constexpr int kWorkerSteps = 400;

train::TrainArgs args_for(const train::RunConfig& config, const std::string& dir) {
  train::TrainArgs a;
  a.config = config;
  a.run_dir = dir;
  a.verbose = false;
  return a;
}

// step -> the logged value of `key` (loss rows, or evaluation rows with val_ce).
std::map<int64_t, double> logged(const std::string& run_dir, const std::string& key) {
  std::map<int64_t, double> out;
  std::istringstream in(io::read_file(run_dir + "/log.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out[j["step"].get<int64_t>()] = j[key].get<double>();
  }
  return out;
}

std::vector<nlohmann::json> log_rows_with(const std::string& run_dir, const std::string& key) {
  std::vector<nlohmann::json> rows;
  std::istringstream in(io::read_file(run_dir + "/log.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) rows.push_back(j);
  }
  return rows;
}

std::string latest_file(const std::string& run_dir, const std::string& file) {
  return io::read_file(train::latest_checkpoint(run_dir) + "/" + file);
}

// Every checkpoint directory is complete and readable, and LATEST (if any) names one.
void expect_consistent(const std::string& run_dir) {
  for (const auto& e : fs::directory_iterator(run_dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("ckpt-", 0) != 0) continue;
    for (const char* f : {"config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"})
      ASSERT_TRUE(fs::exists(e.path() / f)) << name << " lacks " << f;
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_NO_THROW(io::parse_safetensors(io::read_file((e.path() / f).string()), f)) << name;
    EXPECT_NO_THROW(nlohmann::json::parse(io::read_file((e.path() / "trainer_state.json").string()))) << name;
  }
  if (fs::exists(run_dir + "/LATEST")) EXPECT_NO_THROW(train::load_model(run_dir)) << "LATEST names a damaged checkpoint";
}

// The worker process: this binary again, running CrashSafety.Worker on `run_dir`; KVX_FAULT is
// the given one (or none).
pid_t spawn_worker(const std::string& run_dir, const std::string& fault, rlim_t file_size_limit = 0) {
  return kvx::testing::spawn_test_process("CrashSafety.Worker",
                                          {"KVX_RELIABILITY_WORKER_DIR=" + run_dir, "KVX_FAULT=" + fault}, "",
                                          file_size_limit);
}

// Waits up to `seconds` for the child; returns true with its status if it ended.
bool wait_for(pid_t pid, double seconds, int* status) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (waitpid(pid, status, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

int kill_and_reap(pid_t pid) {
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

bool killed(int status) { return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL; }
bool succeeded(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

class ScopedFault {
 public:
  explicit ScopedFault(const char* spec) { setenv("KVX_FAULT", spec, 1); }
  ~ScopedFault() { unsetenv("KVX_FAULT"); }
};

}  // namespace

TEST(CrashSafety, Worker) {
  const char* dir = std::getenv("KVX_RELIABILITY_WORKER_DIR");
  if (!dir) GTEST_SKIP() << "the kill tests' child process";
  auto args = args_for(reliability_run(kWorkerSteps), dir);
  args.resume = true;  // continue whatever is there (a fresh directory starts from step 0)
  train::run_training(args, kvx::testing::small_training_data());
}

TEST(CrashSafety, KilledTrainingResumesFromTheLastCheckpointWithTheSameLossTrace) {
  // The uninterrupted run, in a worker process like the killed ones; it also times one.
  const std::string straight = temp_dir("straight_run");
  int status = 0;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_for(spawn_worker(straight, ""), 300, &status));
  ASSERT_TRUE(succeeded(status)) << "the uninterrupted run failed (status " << status << ")";
  const double run_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const std::string dir = temp_dir("killed_run");
  // Deterministic kills inside a checkpoint save: with the new checkpoint half-written, and
  // with it complete but LATEST still naming the previous one, and while an old one is removed.
  for (const char* fault : {"checkpoint.mid_write@3", "checkpoint.before_latest@2", "checkpoint.mid_prune@1"}) {
    const pid_t pid = spawn_worker(dir, fault);
    ASSERT_TRUE(wait_for(pid, 300, &status)) << fault;
    EXPECT_TRUE(killed(status)) << fault << ": the fault site was not reached";
    expect_consistent(dir);
  }
  // Kills at random moments (startup, training steps, evaluation, checkpoint writes).
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("kill-time seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> delay(0.05 * run_seconds, 0.6 * run_seconds);
  int kills = 0;
  std::set<std::string> resumed_from;
  for (int i = 0; i < 10; ++i) {
    resumed_from.insert(train::latest_checkpoint(dir));
    const pid_t pid = spawn_worker(dir, "");
    if (wait_for(pid, delay(rng), &status)) break;  // finished first
    kill_and_reap(pid);
    ++kills;
    expect_consistent(dir);
  }
  const pid_t pid = spawn_worker(dir, "");
  ASSERT_TRUE(wait_for(pid, 300, &status));
  ASSERT_TRUE(succeeded(status)) << "the final resumed run failed (status " << status << ")";
  EXPECT_GE(resumed_from.size(), 2u) << "no kill landed after a checkpoint; the test did not exercise resuming";
  std::fprintf(stderr, "%d random kills within %.2f s runs, resumed from %zu distinct checkpoints\n", kills, run_seconds,
               resumed_from.size());

  // The same trace, step by step, and the same final weights and optimizer state.
  EXPECT_EQ(logged(dir, "loss"), logged(straight, "loss"));
  EXPECT_EQ(logged(dir, "val_ce"), logged(straight, "val_ce"));
  EXPECT_EQ(latest_file(dir, "model.safetensors"), latest_file(straight, "model.safetensors"));
  EXPECT_EQ(latest_file(dir, "optimizer.safetensors"), latest_file(straight, "optimizer.safetensors"));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_NE(e.path().filename().string().rfind(".ckpt-", 0), 0u) << "unfinished save left behind: " << e.path();
  fs::remove_all(straight);
  fs::remove_all(dir);
}

TEST(CrashSafety, FullDiskFailsTheWriteAndKeepsTheLastCheckpoint) {
  const std::string dir = temp_dir("full_disk");
  auto args = args_for(reliability_run(kWorkerSteps), dir);
  args.stop_after = 4;
  train::run_training(args, kvx::testing::small_training_data());
  const std::string before = train::latest_checkpoint(dir);
  const std::string weights = io::read_file(before + "/model.safetensors");
  const std::string moments = io::read_file(before + "/optimizer.safetensors");

  // The resumed run's next checkpoint cannot be written (files are capped below its size).
  int status = 0;
  const pid_t pid = spawn_worker(dir, "", weights.size() / 2);
  ASSERT_TRUE(wait_for(pid, 300, &status));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "the write failure went unnoticed (status " << status << ")";
  EXPECT_EQ(train::latest_checkpoint(dir), before);
  EXPECT_EQ(io::read_file(before + "/model.safetensors"), weights);
  EXPECT_EQ(io::read_file(before + "/optimizer.safetensors"), moments);
  expect_consistent(dir);
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name.rfind(".ckpt-", 0) != 0 && (name.rfind("ckpt-", 0) != 0 || e.path() == fs::path(before)))
        << "left behind: " << name;
  }
  fs::remove_all(dir);
}

TEST(CrashSafety, UnwritableOutputIsReportedBeforeTraining) {
  const std::string dir = temp_dir("unwritable");
  io::write_file_atomic(dir + "/a_file", "x");
  try {  // a path below a regular file cannot be created, whoever runs the test (root included)
    train::run_training(args_for(reliability_run(4), dir + "/a_file/run"), kvx::testing::small_training_data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not writable"), std::string::npos) << e.what();
  }
  try {
    io::check_output_dir(dir, 1e18, "a job");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a job needs about"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MiB free; free some space or write elsewhere"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Numerics, NonFiniteStepIsSkippedNotApplied) {
  const auto data = kvx::testing::small_training_data();
  const std::string clean = temp_dir("clean4"), faulty = temp_dir("nan5");
  auto a = args_for(reliability_run(12), clean);
  a.stop_after = 4;
  train::run_training(a, data);
  {
    ScopedFault fault("train.nan_loss@5");
    auto b = args_for(reliability_run(12), faulty);
    b.stop_after = 5;
    EXPECT_EQ(train::run_training(b, data).step, 5);
  }
  // Step 5 changed nothing: weights and AdamW state as after step 4.
  EXPECT_EQ(latest_file(faulty, "model.safetensors"), latest_file(clean, "model.safetensors"));
  EXPECT_EQ(latest_file(faulty, "optimizer.safetensors"), latest_file(clean, "optimizer.safetensors"));
  const auto skipped = log_rows_with(faulty, "skipped");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0]["step"], 5);
  EXPECT_EQ(skipped[0]["skipped"], "non-finite loss");
  fs::remove_all(clean);
  fs::remove_all(faulty);
}

TEST(Numerics, RepeatedNonFiniteStepsRollBackToTheLastCheckpoint) {
  const auto data = kvx::testing::small_training_data();
  const std::string dir = temp_dir("rollback");
  {
    ScopedFault fault("train.nan_loss@6-8");  // steps 6, 7, 8
    EXPECT_EQ(train::run_training(args_for(reliability_run(12), dir), data).step, 12);
  }
  const auto back = log_rows_with(dir, "rolled_back_from");
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0]["step"], 4);
  EXPECT_EQ(back[0]["rolled_back_from"], 8);
  EXPECT_EQ(back[0]["skipped_batches"], 4);
  EXPECT_TRUE(log_rows_with(dir, "skipped").empty()) << "the rolled-back steps' rows are dropped";
  EXPECT_EQ(logged(dir, "loss").size(), 12u);  // steps 1-4, then 5-12 on fresh batches
  auto weights = nn::load_safetensors(train::latest_checkpoint(dir) + "/model.safetensors");
  for (const auto& [name, t] : weights) EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << name;
  fs::remove_all(dir);
}

TEST(Numerics, DivergenceWithoutACheckpointOrAfterRollbacksStopsWithAClearError) {
  const auto data = kvx::testing::small_training_data();
  auto error_of = [&](const char* spec) {
    ScopedFault fault(spec);
    const std::string dir = temp_dir("diverged");
    std::string what;
    try {
      train::run_training(args_for(reliability_run(40), dir), data);
    } catch (const Error& e) {
      what = e.what();
    }
    fs::remove_all(dir);
    return what;
  };
  EXPECT_NE(error_of("train.nan_loss@1-3").find("before the first checkpoint; lower train.lr"), std::string::npos);
  EXPECT_NE(error_of("train.nan_loss@5-1000").find("after 3 roll-backs to the last checkpoint"), std::string::npos);
}

TEST(Determinism, SameSeedConfigAndThreadsGiveTheSameLossTrace) {
  const auto data = kvx::testing::small_training_data();
  const std::string a = temp_dir("same_a"), b = temp_dir("same_b");
  train::run_training(args_for(reliability_run(12), a), data);
  train::run_training(args_for(reliability_run(12), b), data);
  const auto la = logged(a, "loss");
  EXPECT_EQ(la.size(), 12u);
  EXPECT_EQ(la, logged(b, "loss"));
  EXPECT_EQ(latest_file(a, "model.safetensors"), latest_file(b, "model.safetensors"));
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(MemoryEstimate, ParameterCountMatchesTheModel) {
  for (const char* layout : {"dense", "lrkv", "mla", "lrkv,dense", "dense qk_norm"}) {
    auto c = reliability_run(1).model;
    c.layout = std::string(layout) == "dense qk_norm" ? "dense" : layout;
    c.qk_norm = std::string(layout) == "dense qk_norm";  // its q/k norm weights count too
    c.lrkv_rank = 4;
    c.kv_lora_rank = 16;
    c.qk_rope_head_dim = 4;
    c.tie_word_embeddings = std::string(layout) != "dense";
    model::Transformer m(c);
    EXPECT_EQ(model::parameter_count(c), static_cast<double>(m->num_parameters())) << layout;
  }
}

TEST(MemoryEstimate, TrainingThatCannotFitIsRefusedBeforeAllocating) {
  auto c = reliability_run(10);
  c.model.hidden_size = 16384;
  c.model.intermediate_size = 65536;
  c.model.num_hidden_layers = 64;
  c.model.num_attention_heads = 128;
  c.model.num_key_value_heads = 128;
  c.model.head_dim = 128;
  c.model.layout = "dense";
  const std::string dir = temp_dir("too_big");
  try {
    train::run_training(args_for(c, dir), kvx::testing::small_training_data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("training 'unit' needs about"), std::string::npos) << what;
    EXPECT_NE(what.find("GiB available; lower train.batch_size"), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(dir + "/LATEST"));
  fs::remove_all(dir);
}
