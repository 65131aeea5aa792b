#include "train/checkpoint.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>

#include "io/atomic_file.h"
#include "io/json_config.h"
#include "model/hf_format.h"
#include "nn/tensor_io.h"
#include "model/memory.h"
#include "util/error.h"
#include "util/fault.h"

namespace kvx::train {

namespace fs = std::filesystem;

namespace {
// A directory with config.json is complete (resolve_model_dir): writers of model directories
// remove an existing config first and write the new one last, so a write killed midway over an
// older model never pairs one model's config with another's weights.
void begin_model_dir(const std::string& dir) {
  io::make_dirs(dir);
  fs::remove(dir + "/config.json");
  io::fsync_dir(dir);
}
}  // namespace

void save_model_dir(const std::string& dir, const model::Transformer& model, const text::BpeTokenizer& tokenizer) {
  begin_model_dir(dir);
  tokenizer.save(dir + "/tokenizer.json");
  nn::save_safetensors(dir + "/model.safetensors", model->state_dict_hf(), {{"format", "pt"}, {"producer", "kvx"}});
  io::write_file_atomic(dir + "/config.json", model->config().to_json().dump(2) + "\n");
}

namespace {

// Every tensor of an HF model directory: model.safetensors, or the shards its
// model.safetensors.index.json names (any float type; load_state_dict_hf converts). A tied model's
// stored lm_head.weight and older checkpoints' RoPE inv_freq buffers are dropped.
nn::TensorMap load_hf_weights(const std::string& dir, const model::ModelConfig& config) {
  nn::TensorMap all;
  const std::string index = dir + "/model.safetensors.index.json";
  if (io::file_exists(index)) {
    const auto j = io::parse_json_file(index);
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(index + ": no weight_map object; is the index file truncated?");
    std::set<std::string> files;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw Error(index + ": weight_map['" + it.key() + "'] is " + it.value().dump().substr(0, 40) +
                    ", not a shard file name; is the index file damaged?");
      files.insert(it.value().get<std::string>());
    }
    for (const auto& f : files) {
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        throw Error(index + ": shard name '" + f + "' must be a file in the model directory");
      for (auto& [name, t] : nn::load_safetensors(dir + "/" + f)) {
        const auto listed = j["weight_map"].find(name);
        if (listed == j["weight_map"].end() || *listed != f)
          throw Error(dir + "/" + f + ": tensor '" + name + "' is not listed for this shard in model.safetensors.index.json");
        all[name] = t;
      }
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it)
      if (!all.count(it.key())) throw Error(index + " lists '" + it.key() + "' but its shard does not hold it (a truncated download?)");
  } else if (io::file_exists(dir + "/model.safetensors")) {
    all = nn::load_safetensors(dir + "/model.safetensors");
  } else {
    throw Error(dir + " has neither model.safetensors nor model.safetensors.index.json");
  }
  for (auto it = all.begin(); it != all.end();) {
    const bool rope_buffer = it->first.find("rotary_emb.inv_freq") != std::string::npos;
    const bool tied_head = config.tie_word_embeddings && it->first == "lm_head.weight";
    it = rope_buffer || tied_head ? all.erase(it) : std::next(it);
  }
  for (auto& [name, t] : all)
    if (!t.is_floating_point()) throw Error(dir + ": tensor '" + name + "' is not floating point (quantised checkpoints are not supported)");
  return all;
}

}  // namespace

model::Transformer import_hf(const std::string& hf_dir, const std::string& out_dir) {
  const auto config = model::config_from_hf(io::parse_json_file(hf_dir + "/config.json"), hf_dir + "/config.json");
  if (!io::file_exists(hf_dir + "/tokenizer.json"))
    throw Error(hf_dir + " has no tokenizer.json; kvx needs the model's tokenizer beside its weights");
  const auto tokenizer = text::BpeTokenizer::load(hf_dir + "/tokenizer.json");
  if (tokenizer.vocab_size() > config.vocab_size)
    throw Error(hf_dir + ": tokenizer.json has " + std::to_string(tokenizer.vocab_size()) + " tokens but config.json's vocab_size is " +
                std::to_string(config.vocab_size));
  model::Transformer m(config);
  m->load_state_dict_hf(load_hf_weights(hf_dir, config), hf_dir);
  save_model_dir(out_dir, m, tokenizer);
  return m;
}

void export_hf(const std::string& model_path, const std::string& out_dir, const std::string& dtype) {
  auto loaded = load_model(model_path);
  const std::string type = model::hf_dtype_name(dtype);
  const auto hf = model::config_to_hf(loaded.model->config(), type);
  const auto scalar = dtype == "bf16" ? torch::kBFloat16 : dtype == "f16" ? torch::kFloat16 : torch::kFloat32;
  nn::TensorMap tensors;
  for (const auto& [name, t] : loaded.model->state_dict_hf()) tensors[name] = t.to(scalar).contiguous();
  const auto& c = loaded.model->config();
  if (c.loops > 1 && !c.exit_gate) {  // Ouro's layout always has a gate: one that never exits early
    tensors["model.early_exit_gate.weight"] = torch::zeros({1, c.hidden_size}, scalar);
    tensors["model.early_exit_gate.bias"] = torch::full({1}, model::kHfNeverExitGateBias, scalar);
  }
  begin_model_dir(out_dir);
  nn::save_safetensors(out_dir + "/model.safetensors", tensors, {{"format", "pt"}, {"producer", "kvx"}});
  loaded.tokenizer.save(out_dir + "/tokenizer.json");
  io::write_file_atomic(out_dir + "/config.json", hf.dump(2) + "\n");  // last: a directory with config.json is complete
}

std::string resolve_model_dir(const std::string& path) {
  if (io::file_exists(path + "/config.json")) return path;
  std::string latest = latest_checkpoint(path);
  if (!latest.empty()) return latest;
  throw Error("'" + path + "' is neither a model directory (no config.json) nor a run directory with a checkpoint (no LATEST); "
              "train one with `kvx train` or check the path");
}

LoadedModel load_model(const std::string& path) {
  LoadedModel out;
  out.dir = resolve_model_dir(path);
  model::ModelConfig config;
  try {
    config = model::ModelConfig::from_json(io::parse_json_file(out.dir + "/config.json"));
  } catch (const Error& e) {
    throw Error(out.dir + "/config.json: " + e.what());
  }
  out.tokenizer = text::BpeTokenizer::load(out.dir + "/tokenizer.json");
  if (out.tokenizer.vocab_size() > config.vocab_size)
    throw Error(out.dir + ": tokenizer.json has " + std::to_string(out.tokenizer.vocab_size()) +
                " tokens but config.json's vocab_size is " + std::to_string(config.vocab_size) + "; they do not belong together");
  model::MemoryEstimate need;  // the fp32 weights, and the weights file read whole beside them
  need.weights = 2 * 4 * model::parameter_count(config);
  model::require_memory(need, model::available_memory_bytes(), "loading " + out.dir,
                        "check config.json's sizes (vocab_size, hidden_size, intermediate_size, num_hidden_layers)");
  out.model = model::Transformer(config);
  out.model->load_state_dict_hf(nn::load_safetensors(out.dir + "/model.safetensors"), out.dir + "/model.safetensors");
  return out;
}

std::string latest_checkpoint(const std::string& run_dir) {
  const std::string pointer = run_dir + "/LATEST";
  if (!io::file_exists(pointer)) return "";
  std::string name = io::read_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  std::string dir = run_dir + "/" + name;
  if (name.empty() || !io::file_exists(dir + "/config.json"))
    throw Error(pointer + " names '" + name + "', which is not a complete checkpoint; remove LATEST to start over");
  return dir;
}

namespace {

// Removes a checkpoint directory without ever leaving a half-deleted ckpt-* behind: it is first
// renamed (atomic) to a hidden .ckpt-*.old name, which the next save cleans up if a kill interrupts.
void discard_checkpoint_dir(const std::string& run_dir, const std::string& name) {
  const std::string hidden = run_dir + "/." + name + ".old";
  fs::remove_all(hidden);
  fs::rename(run_dir + "/" + name, hidden);
  if (fault_at("checkpoint.mid_prune")) ::raise(SIGKILL);
  fs::remove_all(hidden);
}

}  // namespace

void save_checkpoint(const std::string& run_dir, const model::Transformer& model, const text::BpeTokenizer& tokenizer,
                     const AdamW& optimizer, const TrainerState& state, int keep) {
  std::ostringstream name;
  name << "ckpt-" << std::setw(8) << std::setfill('0') << state.step;
  const std::string final_dir = run_dir + "/" + name.str();
  const std::string tmp_dir = run_dir + "/." + name.str() + ".tmp";
  fs::remove_all(tmp_dir);
  try {
    save_model_dir(tmp_dir, model, tokenizer);
    if (fault_at("checkpoint.mid_write")) ::raise(SIGKILL);
    nn::save_safetensors(tmp_dir + "/optimizer.safetensors", optimizer.state());
    nlohmann::json st = {{"step", state.step}, {"run_config", state.run_config}};
    if (state.sampler_states.size() == 1)
      st["sampler_state"] = state.sampler_states[0];
    else
      st["sampler_states"] = state.sampler_states;  // data-parallel: one per worker
    io::write_file_atomic(tmp_dir + "/trainer_state.json", st.dump(2) + "\n");
  } catch (...) {  // e.g. a full disk: the previous checkpoint and LATEST are untouched; free the space
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    throw;
  }
  if (fs::exists(final_dir)) discard_checkpoint_dir(run_dir, name.str());  // a leftover from an interrupted save of this step
  fs::rename(tmp_dir, final_dir);
  io::fsync_dir(run_dir);
  if (fault_at("checkpoint.before_latest")) ::raise(SIGKILL);
  io::write_file_atomic(run_dir + "/LATEST", name.str() + "\n");
  // Drop all but the newest `keep` checkpoints, and saves that a killed run left unfinished.
  std::vector<std::string> unfinished;
  for (const auto& e : fs::directory_iterator(run_dir)) {
    std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind(".ckpt-", 0) == 0) unfinished.push_back(n);
  }
  for (const auto& n : unfinished) fs::remove_all(run_dir + "/" + n);
  const std::vector<std::string> all = checkpoint_names(run_dir);
  for (size_t i = 0; i + keep < all.size(); ++i)
    if (all[i] != name.str()) discard_checkpoint_dir(run_dir, all[i]);
}

std::vector<std::string> checkpoint_names(const std::string& run_dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    std::string n = e.path().filename().string();
    if (e.is_directory(ec) && n.rfind("ckpt-", 0) == 0) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

TrainerState read_trainer_state(const std::string& dir) {
  nlohmann::json j = io::parse_json_file(dir + "/trainer_state.json");
  TrainerState s;
  try {
    s.step = j.at("step").get<int64_t>();
    if (j.contains("sampler_states"))
      s.sampler_states = j.at("sampler_states").get<std::vector<std::string>>();
    else
      s.sampler_states = {j.at("sampler_state").get<std::string>()};
    s.run_config = j.at("run_config");
  } catch (const std::exception& e) {
    throw Error(dir + "/trainer_state.json is incomplete (" + e.what() + "); the checkpoint cannot be resumed");
  }
  return s;
}

void load_optimizer_state(const std::string& dir, AdamW& optimizer) {
  optimizer.load_state(nn::load_safetensors(dir + "/optimizer.safetensors"), dir + "/optimizer.safetensors");
}

}  // namespace kvx::train
