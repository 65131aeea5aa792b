// Checkpoints (bit-exact save/load, atomic layout, clear errors for damaged or mismatched files)
// and exact resume, on a small synthetic byte-level corpus.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <random>

#include <unistd.h>

#include "io/atomic_file.h"
#include "io/dir_lock.h"
#include "support/fixtures.h"
#include "nn/tensor_io.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "util/error.h"

using namespace kvx;
namespace fs = std::filesystem;

namespace {

using kvx::testing::small_run;
using kvx::testing::temp_dir;


void expect_same_weights(const nn::TensorMap& a, const nn::TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
}

}  // namespace

TEST(Training, LossGoesDownAndCheckpointLoadsBitExact) {
  auto data = kvx::testing::small_training_data();
  train::TrainArgs args;
  args.config = small_run(8);
  args.run_dir = temp_dir("ckpt");
  args.verbose = false;
  auto s = train::run_training(args, data);
  EXPECT_EQ(s.step, 8);
  EXPECT_LT(s.val_cross_entropy, std::log(256.0));  // better than uniform after 8 steps
  const std::string latest = train::latest_checkpoint(args.run_dir);
  EXPECT_EQ(fs::path(latest).filename(), "ckpt-00000008");
  for (const char* f : {"config.json", "tokenizer.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(latest + "/" + f)) << f;
  EXPECT_TRUE(fs::exists(args.run_dir + "/log.jsonl"));

  auto loaded = train::load_model(args.run_dir);
  auto again = train::load_model(latest);
  expect_same_weights(loaded.model->state_dict_hf(), again.model->state_dict_hf());
  expect_same_weights(loaded.model->state_dict_hf(), nn::load_safetensors(latest + "/model.safetensors"));
  // A fresh save of the loaded model is byte-identical.
  const std::string copy = temp_dir("ckpt_copy");
  train::save_model_dir(copy, loaded.model, loaded.tokenizer);
  EXPECT_EQ(io::read_file(copy + "/model.safetensors"), io::read_file(latest + "/model.safetensors"));
  fs::remove_all(copy);

  // Training into a run directory that already has a checkpoint needs --resume.
  EXPECT_THROW(train::run_training(args, data), kvx::Error);
  fs::remove_all(args.run_dir);
}

TEST(Training, ResumeEqualsStraightRun) {
  auto data = kvx::testing::small_training_data();
  train::TrainArgs straight;
  straight.config = small_run(8);
  straight.run_dir = temp_dir("straight");
  straight.verbose = false;
  train::run_training(straight, data);

  train::TrainArgs halves = straight;
  halves.run_dir = temp_dir("halves");
  halves.stop_after = 4;  // as if killed right after the step-4 checkpoint
  train::run_training(halves, data);
  halves.stop_after = -1;
  halves.resume = true;
  auto s = train::run_training(halves, data);
  EXPECT_EQ(s.step, 8);

  // Resuming with settings that change the model's shapes or the data order is refused clearly,
  // before the optimizer state is read (a wider model failed on an optimizer tensor's shape).
  auto resume_error = [&](auto edit) {
    train::TrainArgs changed = halves;
    edit(changed.config);
    try {
      train::run_training(changed, data);
    } catch (const kvx::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(resume_error([](train::RunConfig& c) { c.model.hidden_size = 48; }).find("model config differs"), std::string::npos);
  EXPECT_NE(resume_error([](train::RunConfig& c) { c.train.batch_size = 2; }).find("train.batch_size (4 -> 2)"), std::string::npos);
  EXPECT_NE(resume_error([](train::RunConfig& c) { c.train.seq_len = 16; }).find("train.seq_len"), std::string::npos);
  {  // a checkpoint whose tokenizer is not the data's (ids would change meaning)
    train::TrainArgs other = halves;
    other.run_dir = temp_dir("other_tokenizer");
    fs::copy(halves.run_dir, other.run_dir, fs::copy_options::recursive);
    text::BpeTokenizer::train("the cat sat on the mat and the cat ran far", text::BpeTrainOptions{258, 2})
        .save(train::latest_checkpoint(other.run_dir) + "/tokenizer.json");
    try {
      train::run_training(other, data);
      ADD_FAILURE() << "resuming with another tokenizer was accepted";
    } catch (const kvx::Error& e) {
      EXPECT_NE(std::string(e.what()).find("tokenizer.json differs"), std::string::npos) << e.what();
    }
    fs::remove_all(other.run_dir);
  }
  {  // a second run into a directory that a live run holds
    io::DirLock live(halves.run_dir, "test");
    try {
      train::run_training(halves, data);
      ADD_FAILURE() << "a second run into a locked run directory was accepted";
    } catch (const kvx::Error& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another kvx run (pid " + std::to_string(::getpid()) + ")"),
                std::string::npos) << e.what();
    }
  }

  const auto a = train::latest_checkpoint(straight.run_dir), b = train::latest_checkpoint(halves.run_dir);
  expect_same_weights(nn::load_safetensors(a + "/model.safetensors"), nn::load_safetensors(b + "/model.safetensors"));
  expect_same_weights(nn::load_safetensors(a + "/optimizer.safetensors"), nn::load_safetensors(b + "/optimizer.safetensors"));
  fs::remove_all(straight.run_dir);
  fs::remove_all(halves.run_dir);
}

TEST(Training, DamagedOrMismatchedCheckpointsGiveClearErrors) {
  auto data = kvx::testing::small_training_data();
  train::TrainArgs args;
  args.config = small_run(4);
  args.run_dir = temp_dir("bad");
  args.verbose = false;
  train::run_training(args, data);
  const std::string dir = train::latest_checkpoint(args.run_dir);
  const std::string weights = io::read_file(dir + "/model.safetensors");
  auto error_of_load = [&] {
    try {
      train::load_model(dir);
    } catch (const kvx::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };

  io::write_file_atomic(dir + "/model.safetensors", weights.substr(0, weights.size() / 2));  // truncated
  EXPECT_NE(error_of_load().find("model.safetensors"), std::string::npos);
  io::write_file_atomic(dir + "/model.safetensors", std::string(weights.size(), 'x'));  // garbage
  EXPECT_NE(error_of_load().find("header length"), std::string::npos) << error_of_load();
  io::write_file_atomic(dir + "/model.safetensors", weights);
  EXPECT_EQ(error_of_load(), "");

  // A config that does not match the weights.
  auto cfg = nlohmann::json::parse(io::read_file(dir + "/config.json"));
  cfg["intermediate_size"] = 64;
  io::write_file_atomic(dir + "/config.json", cfg.dump());
  EXPECT_NE(error_of_load().find("do not match the config"), std::string::npos) << error_of_load();
  cfg["intermediate_size"] = 48;
  cfg["num_hidden_layers"] = 3;
  cfg["layout"] = "dense*3";
  io::write_file_atomic(dir + "/config.json", cfg.dump());
  EXPECT_NE(error_of_load().find("missing tensor 'model.layers.2"), std::string::npos) << error_of_load();
  cfg["num_hidden_layers"] = 2;
  cfg["layout"] = "dense";
  cfg["hidden_dim"] = 48;  // unknown key
  io::write_file_atomic(dir + "/config.json", cfg.dump());
  EXPECT_NE(error_of_load().find("unknown key 'hidden_dim'"), std::string::npos) << error_of_load();

  EXPECT_THROW(train::load_model(args.run_dir + "/nowhere"), kvx::Error);
  fs::remove_all(args.run_dir);
}

TEST(Training, RunConfigRejectsUnknownKeysAndBadValues) {
  auto j = small_run(4).to_json();
  j["train"]["learning_rate"] = 0.1;
  try {
    train::RunConfig::from_json(j);
    FAIL();
  } catch (const kvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown key 'learning_rate'"), std::string::npos) << e.what();
  }
  j = small_run(4).to_json();
  j["train"]["seq_len"] = 1000;
  EXPECT_THROW(train::RunConfig::from_json(j), kvx::Error);
  j = small_run(4).to_json();
  j["data"]["sources"] = {"wiki"};
  EXPECT_THROW(train::RunConfig::from_json(j), kvx::Error);
  j = small_run(4).to_json();
  j["model"]["vocab_size"] = 200;  // below the 256 byte tokens (failed only after tokenising)
  EXPECT_THROW(train::RunConfig::from_json(j), kvx::Error);
  EXPECT_THROW(train::preset("huge"), kvx::Error);
}

TEST(Training, LearningRateScheduleWarmsUpThenDecays) {
  train::TrainOptions t;
  t.steps = 100;
  t.warmup = 10;
  t.lr = 1.0;
  t.min_lr_ratio = 0.1;
  EXPECT_NEAR(train::learning_rate(t, 0), 0.1, 1e-12);
  EXPECT_NEAR(train::learning_rate(t, 9), 1.0, 1e-12);
  EXPECT_NEAR(train::learning_rate(t, 10), 1.0, 1e-12);
  EXPECT_NEAR(train::learning_rate(t, 55), 0.55, 1e-12);
  EXPECT_NEAR(train::learning_rate(t, 100), 0.1, 1e-12);
}

TEST(Training, InitFromStartsAtTheGivenWeightsAndChecksTheConfig) {
  auto data = kvx::testing::small_training_data();
  train::TrainArgs first;
  first.config = small_run(4);
  first.run_dir = temp_dir("init_src");
  first.verbose = false;
  train::run_training(first, data);
  const auto src = train::latest_checkpoint(first.run_dir);

  // A negligible learning rate (below float resolution) keeps the weights: the first checkpoint equals the source.
  train::TrainArgs tune = first;
  tune.run_dir = temp_dir("init_tune");
  tune.init_from = first.run_dir;
  tune.config.train.lr = 1e-30;
  tune.config.train.steps = 2;
  tune.config.train.checkpoint_every = 2;
  train::run_training(tune, data);
  expect_same_weights(nn::load_safetensors(src + "/model.safetensors"),
                      nn::load_safetensors(train::latest_checkpoint(tune.run_dir) + "/model.safetensors"));

  // Weights of another architecture are refused by name.
  train::TrainArgs other = tune;
  other.run_dir = temp_dir("init_other");
  other.config.model.num_key_value_heads = 4;
  EXPECT_THROW(train::run_training(other, data), kvx::Error);
  for (const auto& d : {first.run_dir, tune.run_dir, other.run_dir}) fs::remove_all(d);
}
