#include "train/train_config.h"

#include <cmath>

#include "io/json_config.h"
#include "text/corpus.h"
#include "text/mqar.h"
#include "util/error.h"

namespace kvx::train {

RunConfig RunConfig::from_json(const nlohmann::json& j) {
  io::JsonReader r(j, "run config");
  RunConfig c;
  c.name = r.get<std::string>("name", c.name);
  c.model = model::ModelConfig::from_json(r.sub("model"));
  {
    io::JsonReader d(r.sub("data"), "run config 'data'");
    c.data.data_dir = d.get<std::string>("data_dir", c.data.data_dir);
    c.data.sources = d.get<std::vector<std::string>>("sources", c.data.sources);
    c.data.mqar_fraction = d.get("mqar_fraction", c.data.mqar_fraction);
    c.data.mqar_max_pairs = d.get("mqar_max_pairs", c.data.mqar_max_pairs);
    c.data.mqar_symbols = d.get("mqar_symbols", c.data.mqar_symbols);
    d.finish();
  }
  {
    io::JsonReader t(r.sub("train"), "run config 'train'");
    auto& o = c.train;
    o.steps = t.get("steps", o.steps);
    o.batch_size = t.get("batch_size", o.batch_size);
    o.seq_len = t.get("seq_len", o.seq_len);
    o.lr = t.get("lr", o.lr);
    o.min_lr_ratio = t.get("min_lr_ratio", o.min_lr_ratio);
    o.warmup = t.get("warmup", o.warmup);
    o.weight_decay = t.get("weight_decay", o.weight_decay);
    o.beta1 = t.get("beta1", o.beta1);
    o.beta2 = t.get("beta2", o.beta2);
    o.eps = t.get("eps", o.eps);
    o.grad_clip = t.get("grad_clip", o.grad_clip);
    o.eval_every = t.get("eval_every", o.eval_every);
    o.eval_batches = t.get("eval_batches", o.eval_batches);
    o.checkpoint_every = t.get("checkpoint_every", o.checkpoint_every);
    o.log_every = t.get("log_every", o.log_every);
    o.seed = t.get("seed", o.seed);
    t.finish();
  }
  r.finish();
  c.validate();
  return c;
}

nlohmann::json RunConfig::to_json() const {
  const auto& o = train;
  return {{"name", name},
          {"model", model.to_json()},
          {"data",
           {{"data_dir", data.data_dir}, {"sources", data.sources}, {"mqar_fraction", data.mqar_fraction},
            {"mqar_max_pairs", data.mqar_max_pairs}, {"mqar_symbols", data.mqar_symbols}}},
          {"train",
           {{"steps", o.steps}, {"batch_size", o.batch_size}, {"seq_len", o.seq_len}, {"lr", o.lr},
            {"min_lr_ratio", o.min_lr_ratio}, {"warmup", o.warmup}, {"weight_decay", o.weight_decay},
            {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"grad_clip", o.grad_clip},
            {"eval_every", o.eval_every}, {"eval_batches", o.eval_batches},
            {"checkpoint_every", o.checkpoint_every}, {"log_every", o.log_every}, {"seed", o.seed}}}};
}

void RunConfig::validate() const {
  model.validate();
  const auto& o = train;
  auto positive = [](double v, const char* name) {
    if (!(v > 0)) throw Error(std::string("run config: train.") + name + " must be positive");
  };
  positive(o.steps, "steps");
  positive(o.batch_size, "batch_size");
  positive(o.seq_len, "seq_len");
  positive(o.lr, "lr");
  positive(o.eval_every, "eval_every");
  positive(o.eval_batches, "eval_batches");
  positive(o.checkpoint_every, "checkpoint_every");
  positive(o.log_every, "log_every");
  if (o.seq_len > model.max_position_embeddings)
    throw Error("run config: train.seq_len (" + std::to_string(o.seq_len) + ") exceeds model.max_position_embeddings (" +
                std::to_string(model.max_position_embeddings) + "); lower seq_len or raise the context limit");
  if (o.warmup < 0) throw Error("run config: train.warmup must be >= 0");
  if (o.min_lr_ratio < 0 || o.min_lr_ratio > 1) throw Error("run config: train.min_lr_ratio must be in [0, 1]");
  if (data.sources.empty()) throw Error("run config: data.sources is empty; use [\"brown\", \"kjv\"] or a subset");
  if (data.mqar_fraction < 0 || data.mqar_fraction > 1) throw Error("run config: data.mqar_fraction must be in [0, 1]");
  if (data.mqar_fraction > 0) text::MqarSpec::for_vocab(model.vocab_size, data.mqar_max_pairs, 1, train.seq_len + 1, data.mqar_symbols);
  for (const auto& s : data.sources) text::check_source(s, "run config");
  if (model.vocab_size < 256)  // found only after a 256-token tokenizer was trained and both splits tokenised
    throw Error("run config: model.vocab_size " + std::to_string(model.vocab_size) +
                " is below the 256 byte tokens a byte-level BPE starts from; set it to 256 or more");
}

RunConfig load_run_config(const std::string& path) {
  try {
    return RunConfig::from_json(io::parse_json_file(path));
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

std::vector<std::string> preset_names() { return {"tiny", "tiny-looped"}; }

RunConfig preset(const std::string& name) {
  if (name == "tiny-looped") {
    // The tiny model's width as an Ouro-style looped model: 2 shared layers run 4 times with
    // sandwich norms (the compute of 8 layers, the weights of 2, a cache per loop and layer).
    RunConfig c = preset("tiny");
    c.name = "tiny-looped";
    c.model.num_hidden_layers = 2;
    c.model.loops = 4;
    c.model.sandwich_norm = true;
    return c;
  }
  if (name == "tiny") {
    // Trains in a few minutes on 2 cores (see README for the measured figures).
    RunConfig c;
    c.name = "tiny";
    auto& m = c.model;
    m.vocab_size = 4096;
    m.hidden_size = 384;
    m.num_hidden_layers = 4;
    m.num_attention_heads = 6;
    m.num_key_value_heads = 6;
    m.head_dim = 64;
    m.intermediate_size = 1024;
    m.max_position_embeddings = 512;
    m.layout = "dense";
    auto& t = c.train;
    t.steps = 600;
    t.batch_size = 16;
    t.seq_len = 128;
    t.lr = 2e-3;
    t.warmup = 30;
    t.eval_every = 100;
    t.checkpoint_every = 100;
    return c;
  }
  std::string valid;
  for (const auto& n : preset_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw Error("unknown preset '" + name + "' (valid: " + valid + ")");
}

double learning_rate(const TrainOptions& t, int step) {
  if (step < t.warmup) return t.lr * (step + 1) / static_cast<double>(t.warmup);
  const double span = std::max(1, t.steps - t.warmup);
  const double progress = std::min(1.0, (step - t.warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
}

}  // namespace kvx::train
