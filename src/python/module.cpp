// The Python module `kvx._kvx` (python/kvx/ wraps it): models (load, logits, generate, eval),
// training, the comparison runner, Hugging Face interchange, and the attention operators
// (ops.cpp). kvx::Error becomes kvx.KvxError, a ValueError.
#include <pybind11/stl.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "compare/experiment.h"
#include "compare/report.h"
#include "compare/runner.h"
#include "eval/commands.h"
#include "model/sampling.h"
#include "python/arrays.h"
#include "text/corpus.h"
#include "train/checkpoint.h"
#include "train/dataset.h"
#include "train/trainer.h"
#include "util/error.h"
#include "util/threads.h"

namespace kvx::python {

void register_ops(py::module_& m);

namespace {

using namespace pybind11::literals;

// A tokenizer.json (kvx's byte-level BPE, or a Hugging Face model's of that kind).
class Tokenizer {
 public:
  explicit Tokenizer(text::BpeTokenizer t) : t_(std::move(t)) {}
  static Tokenizer load(const std::string& path) { return Tokenizer(text::BpeTokenizer::load(path)); }
  // Trained on the corpora's training split (cached under data_dir/tokenizers, as kvx train does).
  static Tokenizer train(int vocab, const std::vector<std::string>& sources, const std::string& data_dir) {
    py::gil_scoped_release unlocked;
    return Tokenizer(train::load_or_train_tokenizer(data_dir.empty() ? text::default_data_dir() : data_dir, sources, vocab));
  }
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const {
    return add_special_tokens ? t_.encode_with_special_tokens(text) : t_.encode(text);
  }
  py::bytes decode(const std::vector<int32_t>& ids) const {
    for (int32_t id : ids)
      if (id < 0 || id >= t_.vocab_size())
        throw Error("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(t_.vocab_size()) + ")");
    return py::bytes(t_.decode(ids));
  }
  int vocab_size() const { return t_.vocab_size(); }
  void save(const std::string& path) const { t_.save(path); }
  std::string to_json() const { return t_.to_json(); }

 private:
  text::BpeTokenizer t_;
};

// A loaded model and its tokenizer.
class Model {
 public:
  explicit Model(const std::string& path) {
    py::gil_scoped_release unlocked;
    m_ = train::load_model(path);
  }
  std::string dir() const { return m_.dir; }
  py::object config() const { return to_python(m_.model->config().to_json()); }
  int64_t parameters() const { return m_.model->num_parameters(); }
  double kv_bytes_per_token(const std::string& kv_cache) const {
    return m_.model->kv_bytes_per_token(kernels::parse_kv_type(kv_cache));
  }
  Tokenizer tokenizer() const { return Tokenizer(m_.tokenizer); }
  // Next-token logits [n, vocab] for a sequence of ids, in one forward pass.
  py::array logits(const std::vector<int32_t>& ids) {
    if (ids.empty()) throw Error("logits: the sequence is empty; give at least one token id");
    const auto& c = m_.model->config();
    if (static_cast<int64_t>(ids.size()) > c.max_position_embeddings)
      throw Error("logits: " + std::to_string(ids.size()) + " tokens exceed the model's context limit of " +
                  std::to_string(c.max_position_embeddings));
    for (int32_t id : ids)
      if (id < 0 || id >= c.vocab_size)
        throw Error("logits: token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
    const torch::Tensor out = exclusive([&] {
      torch::NoGradGuard ng;
      m_.model->eval();
      return m_.model->forward(model::token_batch(ids))[0];
    });
    return to_array(out);
  }
  // on_piece (or None): called with each generated token's bytes as it is produced.
  py::dict generate(const eval::GenerateRequest& request, const py::object& on_piece) {
    const eval::GenerateRequest r = request;  // a copy: Python may change the object while the GIL is released
    std::function<void(const std::string&)> stream;
    if (!on_piece.is_none())
      stream = [&on_piece](const std::string& piece) {
        py::gil_scoped_acquire locked;
        on_piece(py::bytes(piece));  // a Python exception here ends the generation and is re-raised
      };
    const eval::GenerateOutput o = exclusive([&] { return eval::generate_text(m_, r, stream); });
    const auto& s = o.stats;
    return py::dict("text"_a = py::bytes(o.text), "tokens"_a = s.tokens, "prompt_tokens"_a = o.prompt_tokens,
                    "prefill_seconds"_a = s.prefill_seconds, "decode_seconds"_a = s.decode_seconds,
                    "cache"_a = o.cache, "cache_bytes"_a = s.cache_bytes, "cache_bytes_per_token"_a = s.cache_bytes_per_token);
  }
  py::object evaluate(const eval::EvalRequest& request) {
    const eval::EvalRequest r = request;  // a copy, as in generate
    return to_python(exclusive([&] { return eval::evaluate_model(m_, r); }));
  }

 private:
  // Runs f without the GIL, one computation at a time: the model's caches (RoPE tables,
  // train/eval mode) are shared. A call from the thread already computing (a generate stream
  // callback calling back into this Model) is an error: the mutex is not recursive, and it hung.
  template <class F>
  auto exclusive(F&& f) -> decltype(f()) {
    if (owner_.load() == std::this_thread::get_id())
      throw Error("a generate stream callback called back into the same Model; collect the pieces and make the call "
                  "after generate returns");
    py::gil_scoped_release unlocked;
    std::lock_guard<std::mutex> lock(busy_);
    owner_ = std::this_thread::get_id();
    struct Release {
      std::atomic<std::thread::id>& owner;
      ~Release() { owner = std::thread::id(); }
    } release{owner_};
    return f();
  }
  train::LoadedModel m_;
  std::mutex busy_;
  std::atomic<std::thread::id> owner_{};
};

train::RunConfig run_config(const std::string& preset, const py::object& patch) {
  auto j = train::preset(preset).to_json();
  j.merge_patch(to_json(patch));
  auto c = train::RunConfig::from_json(j);
  c.validate();
  return c;
}

py::object train_model(const std::string& out, const std::string& preset, const py::object& patch, bool resume) {
  train::TrainArgs args;
  args.config = run_config(preset, patch);
  args.run_dir = out;
  args.resume = resume;
  train::TrainSummary s;
  {
    py::gil_scoped_release unlocked;
    s = train::run_training(args, train::prepare_training_data(args.config));
  }
  return py::dict("step"_a = s.step, "train_loss"_a = s.train_loss, "val_cross_entropy"_a = s.val_cross_entropy,
                  "val_bits_per_byte"_a = s.val_bits_per_byte, "unigram_cross_entropy"_a = s.unigram_cross_entropy,
                  "seconds"_a = s.seconds, "tokens_per_second"_a = s.tokens_per_second,
                  "model"_a = train::latest_checkpoint(out));
}

compare::Experiment experiment(const std::string& name, const std::string& preset, const py::object& patch,
                               const std::vector<std::string>& arms, const std::string& document) {
  auto e = compare::builtin_experiment(name, preset);
  if (!document.empty()) compare::use_document(e, document);
  if (!patch.is_none()) compare::apply_patch(e, to_json(patch));
  compare::select_arms(e, arms);
  return e;
}

py::object run_compare(const std::string& name, const std::string& preset, const py::object& patch,
                       const std::vector<std::string>& arms, const std::string& document, const std::string& out_dir,
                       const std::string& data_dir, bool verbose) {
  auto e = experiment(name, preset, patch, arms, document);
  compare::CompareOptions o;
  o.out_dir = out_dir;
  o.data_dir = data_dir;
  o.verbose = verbose;
  nlohmann::json j;
  {
    py::gil_scoped_release unlocked;
    const auto r = compare::run_experiment(e, o);
    const std::string table = compare::write_report(r);
    j = compare::results_json(r);
    j["report"] = table;
    j["dir"] = r.dir;
    j["seconds"] = r.seconds;
  }
  return to_python(j);
}

}  // namespace
}  // namespace kvx::python

PYBIND11_MODULE(_kvx, m) {
  using namespace kvx;
  using namespace kvx::python;
  using namespace pybind11::literals;
  m.doc() = "kvx: transformer attention with a smaller KV cache (C++ core)";
  torch::set_num_threads(hardware_threads());
  py::register_exception<Error>(m, "KvxError", PyExc_ValueError);

  py::class_<eval::GenerateRequest>(m, "GenerateRequest")
      .def(py::init<>())
      .def_readwrite("prompt", &eval::GenerateRequest::prompt)
      .def_readwrite("max_new", &eval::GenerateRequest::max_new)
      .def_readwrite("temperature", &eval::GenerateRequest::temperature)
      .def_readwrite("top_p", &eval::GenerateRequest::top_p)
      .def_readwrite("seed", &eval::GenerateRequest::seed)
      .def_readwrite("kv_cache", &eval::GenerateRequest::kv_cache)
      .def_readwrite("evict", &eval::GenerateRequest::evict)
      .def_readwrite("reference", &eval::GenerateRequest::reference)
      .def_readwrite("lla", &eval::GenerateRequest::lla)
      .def_readwrite("lla_absorbed", &eval::GenerateRequest::lla_absorbed)
      .def_readwrite("share_kv_layers", &eval::GenerateRequest::share_kv_layers)
      .def_readwrite("document_module", &eval::GenerateRequest::document_module);
  py::class_<eval::EvalRequest>(m, "EvalRequest")
      .def(py::init<>())
      .def_readwrite("split", &eval::EvalRequest::split)
      .def_readwrite("data_dir", &eval::EvalRequest::data_dir)
      .def_readwrite("sources", &eval::EvalRequest::sources)
      .def_readwrite("max_windows", &eval::EvalRequest::max_windows)
      .def_readwrite("seq_len", &eval::EvalRequest::seq_len)
      .def_readwrite("batch", &eval::EvalRequest::batch)
      .def_readwrite("kv_cache", &eval::EvalRequest::kv_cache)
      .def_readwrite("evict", &eval::EvalRequest::evict)
      .def_readwrite("lla", &eval::EvalRequest::lla)
      .def_readwrite("lla_absorbed", &eval::EvalRequest::lla_absorbed)
      .def_readwrite("share_kv_layers", &eval::EvalRequest::share_kv_layers)
      .def_readwrite("mqar", &eval::EvalRequest::mqar)
      .def_readwrite("mqar_symbols", &eval::EvalRequest::mqar_symbols)
      .def_readwrite("mqar_sequences", &eval::EvalRequest::mqar_sequences)
      .def_readwrite("document_module", &eval::EvalRequest::document_module)
      .def_readwrite("document", &eval::EvalRequest::document);

  py::class_<Tokenizer>(m, "Tokenizer")
      .def(py::init(&Tokenizer::load), "path"_a)
      .def_static("train", &Tokenizer::train, "vocab"_a, "sources"_a = std::vector<std::string>{"brown", "kjv"},
                  "data_dir"_a = "")
      .def("encode", &Tokenizer::encode, "text"_a, "add_special_tokens"_a = false)
      .def("decode", &Tokenizer::decode, "ids"_a)
      .def_property_readonly("vocab_size", &Tokenizer::vocab_size)
      .def("save", &Tokenizer::save, "path"_a)
      .def("to_json", &Tokenizer::to_json);

  py::class_<Model>(m, "Model")
      .def(py::init<const std::string&>(), "path"_a)
      .def_property_readonly("dir", &Model::dir)
      .def_property_readonly("config", &Model::config)
      .def_property_readonly("parameters", &Model::parameters)
      .def("kv_bytes_per_token", &Model::kv_bytes_per_token, "kv_cache"_a = "f32")
      .def_property_readonly("tokenizer", &Model::tokenizer)
      .def("logits", &Model::logits, "ids"_a)
      .def("generate", &Model::generate, "request"_a, "on_piece"_a = py::none())
      .def("evaluate", &Model::evaluate, "request"_a);

  m.def("preset", [](const std::string& name) { return to_python(train::preset(name).to_json()); }, "name"_a);
  m.def("presets", &train::preset_names);
  m.def("train", &train_model, "out"_a, "preset"_a = "tiny", "patch"_a = py::none(), "resume"_a = false);
  m.def("experiments", &compare::experiment_names);
  m.def("experiment", [](const std::string& name, const std::string& preset, const py::object& patch,
                         const std::vector<std::string>& arms, const std::string& document) {
    return to_python(experiment(name, preset, patch, arms, document).to_json());
  }, "name"_a, "preset"_a = "tiny", "patch"_a = py::none(), "arms"_a = std::vector<std::string>{}, "document"_a = "");
  m.def("compare", &run_compare, "name"_a, "preset"_a = "tiny", "patch"_a = py::none(),
        "arms"_a = std::vector<std::string>{}, "document"_a = "", "out_dir"_a = "runs/compare", "data_dir"_a = "",
        "verbose"_a = true);
  m.def("import_hf", [](const std::string& hf_dir, const std::string& out) {
    py::gil_scoped_release unlocked;
    train::import_hf(hf_dir, out);
  }, "hf_dir"_a, "out"_a);
  m.def("export_hf", [](const std::string& model, const std::string& out, const std::string& dtype) {
    py::gil_scoped_release unlocked;
    train::export_hf(model, out, dtype);
  }, "model"_a, "out"_a, "dtype"_a = "f32");

  register_ops(m);
}
