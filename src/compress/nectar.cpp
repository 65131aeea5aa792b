#include "compress/nectar.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <random>

#include "attention/dense.h"
#include "io/atomic_file.h"
#include "io/json_config.h"
#include "model/sampling.h"
#include "nn/tensor_io.h"
#include "text/corpus.h"
#include "train/adamw.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "util/error.h"

namespace kvx::compress {

using attention::DocumentAttention;
using attention::NectarDocument;

namespace {

std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

void require_dense(const model::ModelConfig& c) {
  if (c.loops != 1) throw Error("Nectar document modules are for non-looped models (this one runs " + std::to_string(c.loops) + " loops)");
  for (const auto& kind : c.layer_kinds())
    if (kind != "dense") throw Error("Nectar needs every layer dense (softmax KV to replace), found '" + kind + "'");
}

attention::DenseAttention& dense_layer(model::Transformer& model, int layer) {
  auto* dense = dynamic_cast<attention::DenseAttention*>(model->layers[layer]->as<model::BlockImpl>()->self_attn.get());
  if (!dense) throw Error("Nectar: layer " + std::to_string(layer) + " is not a dense attention layer");
  return *dense;
}

torch::Tensor rows(const torch::Tensor& ids, const std::vector<int64_t>& index) {
  return ids.index_select(0, torch::tensor(index, torch::kLong));
}

}  // namespace

// ---- the document ----------------------------------------------------------------------------------

int64_t DocumentKV::bytes() const {
  int64_t n = 0;
  for (size_t l = 0; l < keys.size(); ++l) n += (keys[l].numel() + values[l].numel()) * 4;
  return n;
}

std::shared_ptr<const NectarDocument> DocumentKV::exact(const model::ModelConfig& config) const {
  auto doc = std::make_shared<NectarDocument>();
  doc->tokens = tokens();
  for (size_t l = 0; l < keys.size(); ++l)
    doc->layers.push_back(std::make_shared<attention::ExactDocument>(config.num_attention_heads, keys[l], values[l]));
  return doc;
}

std::shared_ptr<const NectarDocument> no_document(const model::ModelConfig& c, int64_t tokens) {
  auto doc = std::make_shared<NectarDocument>();
  doc->tokens = tokens;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    doc->layers.push_back(std::make_shared<attention::NoDocument>(c.num_attention_heads, c.num_key_value_heads, c.head_dim));
  return doc;
}

std::vector<int32_t> read_document(const text::BpeTokenizer& tokenizer, const std::string& path) {
  const auto text = io::read_file(path);
  auto ids = tokenizer.encode(text);
  if (ids.empty()) throw Error("the document " + path + " is empty (0 tokens); give a file with text in it");
  return ids;
}

DocumentKV prefill_document(model::Transformer& model, const std::vector<int32_t>& document, int64_t reserve) {
  const auto& c = model->config();
  require_dense(c);
  if (document.empty()) throw Error("the document is empty (0 tokens); give a file with text in it");
  const auto n = static_cast<int64_t>(document.size());
  if (n + reserve > c.max_position_embeddings)
    throw Error("the document has " + std::to_string(n) + " tokens; with " + std::to_string(reserve) +
                " query tokens after it that is past the model's context of " + std::to_string(c.max_position_embeddings) +
                " (max_position_embeddings); use a shorter document (at most " +
                std::to_string(std::max<int64_t>(0, c.max_position_embeddings - reserve)) + " tokens) or shorter queries");
  torch::NoGradGuard no_grad;
  attention::CacheOptions reference;
  reference.reference = true;
  auto state = model->new_state(1, reference);
  const auto ids = model::token_batch(document);
  for (int64_t s = 0; s < n; s += 256) model->step(ids.narrow(1, s, std::min<int64_t>(256, n - s)), state);
  DocumentKV kv;
  kv.ids = document;
  for (auto& layer : state.layers) {
    const auto* dense = dynamic_cast<const attention::DenseKVCache*>(layer.get());
    kv.keys.push_back(dense->keys().clone());
    kv.values.push_back(dense->values().clone());
  }
  return kv;
}

torch::Tensor forward_after_document(model::Transformer& model, const NectarDocument& document, const torch::Tensor& ids,
                                     const std::function<void(int, const torch::Tensor&, const DocumentAttention&)>& observe) {
  const auto& c = model->config();
  require_dense(c);
  if (document.layers.size() != static_cast<size_t>(c.num_hidden_layers))
    throw Error("the document module has " + std::to_string(document.layers.size()) + " layers, the model " +
                std::to_string(c.num_hidden_layers));
  if (document.tokens + ids.size(1) > c.max_position_embeddings)
    throw Error("a document of " + std::to_string(document.tokens) + " tokens and " + std::to_string(ids.size(1)) +
                " tokens after it exceed the model's context of " + std::to_string(c.max_position_embeddings));
  const auto override_mixer = [&](int, int layer, const torch::Tensor& x) {
    return dense_layer(model, layer).forward_after_document(x, document.tokens, [&](const torch::Tensor& q) {
      auto r = document.layers[layer]->forward(q);
      if (observe) observe(layer, q, r);
      return r;
    });
  };
  return model->forward(ids, nullptr, override_mixer);
}

// ---- module config and files ------------------------------------------------------------------------

nlohmann::json NectarModuleConfig::to_json() const {
  return {{"format", "kvx-nectar-1"}, {"arch", arch.to_json()}, {"rho", rho}, {"layer_multipliers", layer_multipliers},
          {"document_tokens", document_tokens}, {"document_hash", document_hash}, {"document_path", document_path},
          {"model_fingerprint", model_fingerprint}, {"model", model}, {"sizes", sizes}};
}

NectarModuleConfig NectarModuleConfig::from_json(const nlohmann::json& j) {
  try {
    if (j.at("format") != "kvx-nectar-1") throw Error("unknown format " + j.at("format").dump());
    NectarModuleConfig c;
    c.arch = attention::NectarArch::from_json(j.at("arch"));
    c.rho = j.at("rho").get<double>();
    c.layer_multipliers = j.at("layer_multipliers").get<std::vector<double>>();
    c.document_tokens = j.at("document_tokens").get<int64_t>();
    c.document_hash = j.at("document_hash").get<std::string>();
    c.document_path = j.at("document_path").get<std::string>();
    c.model_fingerprint = j.at("model_fingerprint").get<std::string>();
    c.model = j.at("model");
    c.sizes = j.at("sizes").get<std::vector<int64_t>>();
    return c;
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("nectar.json: ") + e.what());
  }
}

std::vector<double> layer_budgets(double rho, int64_t tokens, int head_dim, int layers, const std::vector<double>& multipliers) {
  if (!(rho > 0)) throw Error("--rho must be positive (a fraction of the document's KV, e.g. 0.02)");
  const double base = rho * 2.0 * static_cast<double>(tokens) * head_dim;
  std::vector<double> m(layers, 1.0);
  if (!multipliers.empty()) {
    const int groups = static_cast<int>(multipliers.size());
    if (groups > layers) throw Error("--layer-multipliers gives " + std::to_string(groups) + " groups for " + std::to_string(layers) + " layers");
    for (double x : multipliers)
      if (!(x > 0)) throw Error("--layer-multipliers must all be positive");
    for (int l = 0; l < layers; ++l) m[l] = multipliers[static_cast<size_t>(l) * groups / layers];
    const double mean = std::accumulate(m.begin(), m.end(), 0.0) / layers;
    for (auto& x : m) x /= mean;
  }
  for (auto& x : m) x *= base;
  return m;
}

DocumentModule DocumentModule::build(const NectarModuleConfig& config, const model::ModelConfig& c) {
  if (config.sizes.size() != static_cast<size_t>(c.num_hidden_layers))
    throw Error("Nectar module: " + std::to_string(config.sizes.size()) + " layer sizes for a model of " +
                std::to_string(c.num_hidden_layers) + " layers");
  DocumentModule m;
  m.config = config;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (config.arch.kind == "mlp")
      m.layers.push_back(std::make_shared<attention::NectarMlp>(c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                                                config.arch, config.sizes[l]));
    else
      m.layers.push_back(
          std::make_shared<attention::NectarQuadrature>(c.num_attention_heads, c.num_key_value_heads, c.head_dim, config.sizes[l]));
  }
  return m;
}

std::shared_ptr<const NectarDocument> DocumentModule::decode_set() const {
  auto doc = std::make_shared<NectarDocument>();
  doc->tokens = config.document_tokens;
  doc->layers = layers;
  return doc;
}

std::vector<std::pair<std::string, torch::Tensor>> DocumentModule::named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t l = 0; l < layers.size(); ++l)
    for (const auto& p : layers[l]->named_parameters()) out.emplace_back("layers." + std::to_string(l) + "." + p.key(), p.value());
  return out;
}

int64_t DocumentModule::parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void DocumentModule::save(const std::string& dir) const {
  io::make_dirs(dir);
  nn::TensorMap tensors;
  for (const auto& [name, t] : named_parameters()) tensors[name] = t.detach();
  nn::save_safetensors(dir + "/nectar.safetensors", tensors);
  io::write_file_atomic(dir + "/nectar.json", config.to_json().dump(2) + "\n");
}

DocumentModule DocumentModule::load(const std::string& dir, const model::Transformer& model) {
  if (!io::file_exists(dir + "/nectar.json"))
    throw Error(dir + " is not a Nectar module directory (no nectar.json); make one with kvx fit nectar");
  const auto config = NectarModuleConfig::from_json(io::parse_json_file(dir + "/nectar.json"));
  const auto& c = model->config();
  const auto fingerprint = model_fingerprint(model);
  if (config.model != c.to_json() || config.model_fingerprint != fingerprint)
    throw Error("the Nectar module in " + dir + " was fitted for another model (weights " + config.model_fingerprint +
                ", this model " + fingerprint + "); fit one for this model with kvx fit nectar");
  auto m = build(config, c);
  const auto tensors = nn::load_safetensors(dir + "/nectar.safetensors");
  torch::NoGradGuard no_grad;
  size_t used = 0;
  for (auto& [name, t] : m.named_parameters()) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) throw Error(dir + "/nectar.safetensors lacks " + name + " (truncated or from another version)");
    if (it->second.sizes() != t.sizes())
      throw Error(dir + "/nectar.safetensors: " + name + " is " + c10::str(it->second.sizes()) + ", nectar.json implies " +
                  c10::str(t.sizes()));
    t.copy_(it->second);
    ++used;
  }
  if (used != tensors.size()) throw Error(dir + "/nectar.safetensors has tensors nectar.json does not describe");
  return m;
}

std::string model_fingerprint(const model::Transformer& model) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& [name, t] : model->state_dict_hf()) {  // sorted by name
    const auto c = t.to(torch::kFloat32).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < name.size(); ++i) h = (h ^ static_cast<unsigned char>(name[i])) * 1099511628211ull;
    for (int64_t i = 0; i < c.numel() * 4; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return hex64(h);
}

std::string tokens_fingerprint(const std::vector<int32_t>& ids) {
  return hex64(text::fnv1a64(std::string_view(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t))));
}

// ---- queries ------------------------------------------------------------------------------------------

namespace {

nlohmann::json ids_json(const torch::Tensor& t) {
  nlohmann::json a = nlohmann::json::array();
  const auto c = t.contiguous();
  for (int64_t i = 0; i < c.size(0); ++i) {
    const auto* p = c[i].data_ptr<int64_t>();
    a.push_back(std::vector<int64_t>(p, p + c.size(1)));
  }
  return a;
}

torch::Tensor ids_tensor(const nlohmann::json& a) {
  std::vector<int64_t> flat;
  int64_t width = 0;
  for (const auto& row : a) {
    const auto r = row.get<std::vector<int64_t>>();
    if (width && static_cast<int64_t>(r.size()) != width) throw Error("queries.json: rows of different lengths");
    width = static_cast<int64_t>(r.size());
    flat.insert(flat.end(), r.begin(), r.end());
  }
  if (a.empty()) return torch::zeros({0, 0}, torch::kLong);
  return torch::tensor(flat, torch::kLong).view({static_cast<int64_t>(a.size()), width});
}

// Cosine similarity of token-count vectors.
double bag_cosine(const std::map<int64_t, double>& a, const std::map<int64_t, double>& b) {
  double dot = 0, na = 0, nb = 0;
  for (const auto& [k, v] : a) {
    na += v * v;
    const auto it = b.find(k);
    if (it != b.end()) dot += v * it->second;
  }
  for (const auto& [k, v] : b) nb += v * v;
  return dot / std::sqrt(std::max(na * nb, 1e-30));
}

}  // namespace

nlohmann::json NectarQueries::to_json() const {
  return {{"train", ids_json(train)}, {"validation", ids_json(validation)}, {"test", ids_json(test)}, {"challenge", ids_json(challenge)}};
}

NectarQueries NectarQueries::from_json(const nlohmann::json& j) {
  try {
    return {ids_tensor(j.at("train")), ids_tensor(j.at("validation")), ids_tensor(j.at("test")), ids_tensor(j.at("challenge"))};
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("queries.json: ") + e.what());
  }
}

NectarQueries make_queries(model::Transformer& model, const text::BpeTokenizer& tokenizer, const DocumentKV& document,
                           const QueryOptions& o) {
  if (o.count < 8) throw Error("Nectar needs at least 8 queries (--queries)");
  if (o.length < 4) throw Error("Nectar queries need at least 4 tokens (--query-length)");
  const int64_t n = document.tokens(), m = o.length;
  const auto& doc = document.ids;
  std::mt19937_64 rng(o.seed);
  const auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, std::max(lo, hi))(rng); };
  const auto blank = tokenizer.encode(" ___"), answer = tokenizer.encode("\nAnswer:");
  // forced[i][t] >= 0: that token; -1: the model samples it.
  std::vector<std::vector<int64_t>> forced(o.count, std::vector<int64_t>(m, -1));
  for (int i = 0; i < o.count; ++i) {
    auto& f = forced[i];
    const int kind = i % 10 < 4 ? 0 : (i % 10 < 7 ? 1 : 2);  // 40% quote, 30% cloze, 30% sample
    std::vector<int64_t> seq;
    if (kind == 0) {  // quote: a span and the document's continuation
      const int64_t s = uniform(0, n - 8);
      for (int64_t t = s; t < n && static_cast<int64_t>(seq.size()) < m; ++t) seq.push_back(doc[t]);
    } else if (kind == 1) {  // cloze: span with a blank, then the answer and the span's continuation
      const int64_t span = std::min<int64_t>(n, uniform(8, 20)), s = uniform(0, n - span), hole = s + uniform(span / 3, span - 1);
      for (int64_t t = s; t < s + span; ++t) {
        if (t == hole)
          seq.insert(seq.end(), blank.begin(), blank.end());
        else
          seq.push_back(doc[t]);
      }
      seq.insert(seq.end(), answer.begin(), answer.end());
      for (int64_t t = hole; t < n && static_cast<int64_t>(seq.size()) < m; ++t) seq.push_back(doc[t]);
    } else {  // sample: a short span, then the model's own continuation
      const int64_t span = std::min<int64_t>(n, uniform(4, 12)), s = uniform(0, n - span);
      for (int64_t t = s; t < s + span; ++t) seq.push_back(doc[t]);
    }
    for (int64_t t = 0; t < m && t < static_cast<int64_t>(seq.size()); ++t) f[t] = seq[t];
  }
  // Decode all queries at once after the exact document, sampling where nothing is forced.
  torch::NoGradGuard no_grad;
  attention::CacheOptions options;
  options.document = document.exact(model->config());
  auto ids = torch::zeros({o.count, m}, torch::kLong);
  auto* idp = ids.data_ptr<int64_t>();
  for (int i = 0; i < o.count; ++i) idp[i * m] = forced[i][0];
  const model::SamplingOptions sampling{1.0, 0.95};
  for (int b0 = 0; b0 < o.count; b0 += 64) {
    const int B = std::min(64, o.count - b0);
    auto state = model->new_state(B, options);
    for (int64_t t = 0; t + 1 < m; ++t) {
      const auto logits = model->step(ids.narrow(0, b0, B).narrow(1, t, 1), state).select(1, 0);
      for (int b = 0; b < B; ++b) {
        const int i = b0 + b;
        idp[i * m + t + 1] = forced[i][t + 1] >= 0 ? forced[i][t + 1] : model::sample_token(logits[b], sampling, rng);
      }
    }
  }
  // 80/20, a validation eighth of the 80, and the challenge quarter of the test.
  std::vector<int64_t> order(o.count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int test_n = std::max(2, o.count / 5), val_n = std::max(1, (o.count - test_n) / 8);
  const std::vector<int64_t> test(order.begin(), order.begin() + test_n), val(order.begin() + test_n, order.begin() + test_n + val_n),
      train(order.begin() + test_n + val_n, order.end());
  std::vector<std::map<int64_t, double>> bags(o.count);
  for (int i = 0; i < o.count; ++i)
    for (int64_t t = 0; t < m; ++t) bags[i][idp[i * m + t]] += 1;
  std::vector<std::pair<double, int64_t>> nearest;
  for (const auto i : test) {
    double best = 0;
    for (const auto j : train) best = std::max(best, bag_cosine(bags[i], bags[j]));
    nearest.emplace_back(best, i);
  }
  std::sort(nearest.begin(), nearest.end());
  std::vector<int64_t> challenge;
  for (int k = 0; k < std::max(1, test_n / 4); ++k) challenge.push_back(nearest[k].second);
  return {rows(ids, train), rows(ids, val), rows(ids, test), rows(ids, challenge)};
}

NectarQueries load_or_make_queries(const std::string& file, model::Transformer& model, const text::BpeTokenizer& tokenizer,
                                   const DocumentKV& document, const QueryOptions& options, double* seconds) {
  // The file records whose queries they are (hashing every weight: only when there is a file).
  const auto fingerprint = file.empty() ? std::string() : model_fingerprint(model);
  const auto document_hash = tokens_fingerprint(document.ids);
  if (!file.empty() && io::file_exists(file)) {
    const auto j = io::parse_json_file(file);
    if (j.at("model_fingerprint") != fingerprint || j.at("document_hash") != document_hash)
      throw Error(file + " holds queries for another model or document; delete it or give another file");
    const nlohmann::json asked = {{"count", options.count}, {"length", options.length}, {"seed", options.seed}};
    if (j.contains("options") && j.at("options") != asked)
      throw Error(file + " holds queries made with " + j.at("options").dump() + ", not the " + asked.dump() +
                  " asked for; delete it or give another file");
    auto queries = NectarQueries::from_json(j.at("splits"));
    if (queries.train.size(1) > options.length)
      throw Error(file + " holds queries of " + std::to_string(queries.train.size(1)) + " tokens, more than the " +
                  std::to_string(options.length) + " asked for");
    if (seconds) *seconds = j.at("seconds").get<double>();
    return queries;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto queries = make_queries(model, tokenizer, document, options);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (seconds) *seconds = took;
  if (!file.empty())
    io::write_file_atomic(file, nlohmann::json{{"model_fingerprint", fingerprint},
                                               {"document_hash", document_hash},
                                               {"options", {{"count", options.count}, {"length", options.length}, {"seed", options.seed}}},
                                               {"seconds", took},
                                               {"splits", queries.to_json()}}.dump() + "\n");
  return queries;
}

// ---- quality ------------------------------------------------------------------------------------------

nlohmann::json NectarQuality::to_json() const {
  // No document has no log mass (-inf): its alpha error is not a number worth printing.
  return {{"alpha_mse", std::isfinite(alpha_mse) ? nlohmann::json(alpha_mse) : nlohmann::json(nullptr)}, {"content_mse", content_mse}, {"kl", kl}, {"teacher_accuracy", teacher_accuracy},
          {"student_accuracy", student_accuracy}, {"accuracy_gap", accuracy_gap()}, {"top1_agreement", top1_agreement},
          {"tokens", tokens}};
}

NectarQuality evaluate_document_module(model::Transformer& model, const DocumentKV& document, const NectarDocument& student,
                                       const torch::Tensor& queries) {
  torch::NoGradGuard no_grad;
  const auto exact = document.exact(model->config());
  const int L = model->config().num_hidden_layers;
  NectarQuality q;
  double alpha_se = 0, content_se = 0, kl = 0, t_ok = 0, s_ok = 0, agree = 0;
  int64_t head_tokens = 0;
  for (int64_t b0 = 0; b0 < queries.size(0); b0 += 32) {
    const auto batch = queries.narrow(0, b0, std::min<int64_t>(32, queries.size(0) - b0));
    const auto x = batch.narrow(1, 0, batch.size(1) - 1), y = batch.narrow(1, 1, batch.size(1) - 1);
    std::vector<torch::Tensor> qs(L);
    std::vector<DocumentAttention> targets(L);
    const auto full = forward_after_document(model, *exact, x, [&](int l, const torch::Tensor& qq, const DocumentAttention& r) {
      qs[l] = qq;
      targets[l] = r;
    });
    const auto logits = forward_after_document(model, student, x);
    for (int l = 0; l < L; ++l) {  // the module on the teacher's queries
      const auto r = student.layers[l]->forward(qs[l]);
      alpha_se += (r.log_mass - targets[l].log_mass).pow(2).sum().item<double>();
      content_se += (r.content - targets[l].content).pow(2).sum().item<double>();
      head_tokens += targets[l].log_mass.numel();
    }
    const auto lp_full = torch::log_softmax(full, -1), lp = torch::log_softmax(logits, -1);
    kl += (lp_full.exp() * (lp_full - lp)).sum().item<double>();
    const auto t_arg = full.argmax(-1), s_arg = logits.argmax(-1);
    t_ok += (t_arg == y).sum().item<double>();
    s_ok += (s_arg == y).sum().item<double>();
    agree += (t_arg == s_arg).sum().item<double>();
    q.tokens += y.numel();
  }
  q.alpha_mse = alpha_se / std::max<int64_t>(1, head_tokens);
  q.content_mse = content_se / std::max<int64_t>(1, head_tokens);
  q.kl = kl / std::max<int64_t>(1, q.tokens);
  q.teacher_accuracy = t_ok / std::max<int64_t>(1, q.tokens);
  q.student_accuracy = s_ok / std::max<int64_t>(1, q.tokens);
  q.top1_agreement = agree / std::max<int64_t>(1, q.tokens);
  return q;
}

// ---- fitting ------------------------------------------------------------------------------------------

nlohmann::json fit_nectar_run(const FitNectarRun& run) {
  // The CLI names a default next to the model (as fit lla does); never inside the resolved
  // checkpoint, which later training prunes.
  if (run.out.empty()) throw Error("fit nectar: give an output directory (--out)");
  // checked before the minutes of query making and teacher targets
  if (run.steps < 1 || run.batch < 1)
    throw Error("fit nectar: --steps and --batch must be >= 1 (got " + std::to_string(run.steps) + ", " + std::to_string(run.batch) + ")");
  if (!(run.lr > 0) || !std::isfinite(run.lr))
    throw Error("fit nectar: --lr must be a positive number (got " + std::to_string(run.lr) + ")");
  const auto t_start = std::chrono::steady_clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(); };
  auto loaded = train::load_model(run.model);
  auto& model = loaded.model;
  model->eval();
  for (auto& p : model->parameters()) p.requires_grad_(false);
  const auto& c = model->config();
  require_dense(c);
  run.arch.validate();
  const bool mlp = run.arch.kind == "mlp";
  const double w_alpha = run.alpha_weight >= 0 ? run.alpha_weight : (mlp ? 0.1 : 0.0);
  const double w_content = run.content_weight >= 0 ? run.content_weight : 1.0;
  const double w_kl = run.kl_weight >= 0 ? run.kl_weight : 0.01;
  if (w_alpha + w_content + w_kl <= 0) throw Error("Nectar loss weights are all zero; give one of them a positive weight");

  const auto document_ids = read_document(loaded.tokenizer, run.document);
  const auto document = prefill_document(model, document_ids, run.queries.length);
  const int64_t n = document.tokens();
  // Budget and sizes (checked before the queries are made: a budget too small fails fast).
  NectarModuleConfig config;
  config.arch = run.arch;
  config.rho = run.rho;
  config.layer_multipliers = run.layer_multipliers;
  config.document_tokens = n;
  config.document_hash = tokens_fingerprint(document_ids);
  config.document_path = run.document;
  config.model_fingerprint = model_fingerprint(model);
  config.model = c.to_json();
  for (const double budget : layer_budgets(run.rho, n, c.head_dim, c.num_hidden_layers, run.layer_multipliers))
    config.sizes.push_back(mlp ? attention::NectarMlp::width_for_budget(run.arch, c.head_dim, budget)
                               : attention::NectarQuadrature::pairs_for_budget(c.head_dim, budget));
  const std::string& out = run.out;
  io::check_output_dir(out, 1e6, "kvx fit nectar");
  if (run.verbose) {
    std::fprintf(stderr, "fit nectar: document %s, %lld tokens (%.2f MiB of f32 KV); %s, rho %.3g\n", run.document.c_str(),
                 static_cast<long long>(n), document.bytes() / 1048576.0, run.arch.kind.c_str(), run.rho);
    if (run.queries_file.empty() || !io::file_exists(run.queries_file))
      std::fprintf(stderr, "fit nectar: making %d queries of %d tokens with the model\n", run.queries.count, run.queries.length);
    else
      std::fprintf(stderr, "fit nectar: the queries of %s\n", run.queries_file.c_str());
  }
  double query_seconds = 0;  // making the queries (also when an earlier fit made them)
  const auto queries = load_or_make_queries(run.queries_file, model, loaded.tokenizer, document, run.queries, &query_seconds);
  const double setup_seconds = seconds();

  // The teacher's regression targets on the training queries, cached once.
  const int L = c.num_hidden_layers;
  const auto x_all = queries.train.narrow(1, 0, queries.train.size(1) - 1);
  const auto teacher_document = document.exact(c);
  std::vector<std::vector<torch::Tensor>> q_parts(L), a_parts(L), c_parts(L);
  {
    torch::NoGradGuard no_grad;
    for (int64_t b0 = 0; b0 < x_all.size(0); b0 += 32)
      forward_after_document(model, *teacher_document, x_all.narrow(0, b0, std::min<int64_t>(32, x_all.size(0) - b0)),
                             [&](int l, const torch::Tensor& q, const DocumentAttention& r) {
                               q_parts[l].push_back(q);
                               a_parts[l].push_back(r.log_mass);
                               c_parts[l].push_back(r.content);
                             });
  }
  std::vector<torch::Tensor> target_q(L), target_alpha(L), target_content(L);
  for (int l = 0; l < L; ++l) {
    target_q[l] = torch::cat(q_parts[l]), target_alpha[l] = torch::cat(a_parts[l]), target_content[l] = torch::cat(c_parts[l]);
    q_parts[l].clear(), a_parts[l].clear(), c_parts[l].clear();
  }

  auto module = DocumentModule::build(config, c);
  for (int l = 0; l < L; ++l) {
    if (mlp) {
      const auto flat = [](const torch::Tensor& t) { return t.transpose(1, 2).reshape({-1, t.size(1), t.dim() == 4 ? t.size(3) : 1}); };
      auto* layer = dynamic_cast<attention::NectarMlp*>(module.layers[l].get());
      layer->initialize(flat(target_q[l]), flat(target_alpha[l].unsqueeze(-1)).squeeze(-1), flat(target_content[l]));
    } else {
      dynamic_cast<attention::NectarQuadrature*>(module.layers[l].get())->initialize(document.keys[l][0], document.values[l][0]);
    }
  }
  const auto student = module.decode_set();
  if (run.verbose)
    std::fprintf(stderr, "fit nectar: %lld parameters (%.1f KiB, %.2f%% of the document's KV), sizes per layer:",
                 static_cast<long long>(module.parameter_count()), module.bytes() / 1024.0,
                 100.0 * module.bytes() / static_cast<double>(document.bytes()));
  if (run.verbose) {
    for (auto s : config.sizes) std::fprintf(stderr, " %lld", static_cast<long long>(s));
    std::fprintf(stderr, " (%s)\n", mlp ? "width" : "pairs");
  }

  train::AdamWOptions ao;
  ao.weight_decay = 0.0;
  train::AdamW optimizer(module.named_parameters(), ao);
  const auto loss_on = [&](const std::vector<int64_t>& index, torch::Tensor* kl_out) {
    const auto idx = torch::tensor(index, torch::kLong);
    torch::Tensor reg = torch::zeros({});
    const double tokens = static_cast<double>(index.size()) * x_all.size(1);
    for (int l = 0; l < L; ++l) {
      const auto r = module.layers[l]->forward(target_q[l].index_select(0, idx));
      if (w_alpha > 0) reg = reg + w_alpha * (r.log_mass - target_alpha[l].index_select(0, idx)).pow(2).sum() / tokens;
      if (w_content > 0) reg = reg + w_content * (r.content - target_content[l].index_select(0, idx)).pow(2).sum() / tokens;
    }
    torch::Tensor kl = torch::zeros({});
    if (w_kl > 0) {
      const auto x = x_all.index_select(0, idx);
      torch::Tensor teacher;
      {
        torch::NoGradGuard no_grad;
        teacher = torch::log_softmax(forward_after_document(model, *teacher_document, x), -1);
      }
      const auto lp = torch::log_softmax(forward_after_document(model, *student, x), -1);
      kl = (teacher.exp() * (teacher - lp)).sum() / tokens;
    }
    if (kl_out) *kl_out = kl.detach();
    return reg + w_kl * kl;
  };
  const auto objective = [&](const torch::Tensor& split) {  // the loss on held-out queries, no gradient
    torch::NoGradGuard no_grad;
    const auto qual = evaluate_document_module(model, document, *student, split);
    return w_alpha * qual.alpha_mse * c.num_attention_heads * L + w_content * qual.content_mse * c.num_attention_heads * L +
           w_kl * qual.kl;
  };
  auto snapshot = [&] {
    std::vector<torch::Tensor> s;
    for (const auto& [name, t] : module.named_parameters()) s.push_back(t.detach().clone());
    return s;
  };
  auto best = snapshot();
  double best_val = objective(queries.validation);
  int best_step = 0;
  nlohmann::json curve = nlohmann::json::array();
  curve.push_back({{"step", 0}, {"validation_loss", best_val}});
  if (run.verbose) std::fprintf(stderr, "fit nectar: step 0 | validation loss %.5f\n", best_val);
  std::mt19937_64 rng(run.queries.seed + 17);
  std::vector<int64_t> order(x_all.size(0));
  std::iota(order.begin(), order.end(), 0);
  size_t cursor = order.size();
  const int every = std::max(1, run.steps / std::max(1, run.evals));
  const auto t_train = std::chrono::steady_clock::now();
  for (int step = 1; step <= run.steps; ++step) {
    std::vector<int64_t> index;
    while (static_cast<int>(index.size()) < std::min<int>(run.batch, static_cast<int>(order.size()))) {
      if (cursor == order.size()) std::shuffle(order.begin(), order.end(), rng), cursor = 0;
      index.push_back(order[cursor++]);
    }
    torch::Tensor kl;
    const auto loss = loss_on(index, &kl);
    optimizer.zero_grad();
    loss.backward();
    std::vector<torch::Tensor> grads;
    for (const auto& [name, t] : module.named_parameters()) grads.push_back(t);
    torch::nn::utils::clip_grad_norm_(grads, 1.0);
    const double progress = std::max(0.0, (step - run.warmup) / std::max(1.0, static_cast<double>(run.steps - run.warmup)));
    const double lr = run.lr * std::min(1.0, step / static_cast<double>(std::max(1, run.warmup))) * 0.5 * (1 + std::cos(M_PI * progress));
    optimizer.step(lr);
    if (run.verbose && (step % 20 == 0 || step == 1)) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_train).count();
      std::fprintf(stderr, "fit nectar: step %4d/%d | loss %.5f | kl %.5f | lr %.2e | %.0f tok/s | ETA %s\n", step, run.steps,
                   loss.item<double>(), kl.item<double>(), lr, step * run.batch * x_all.size(1) / std::max(elapsed, 1e-9),
                   train::format_duration(elapsed / step * (run.steps - step)).c_str());
    }
    if (step % every == 0 || step == run.steps) {
      const double v = objective(queries.validation);
      curve.push_back({{"step", step}, {"validation_loss", v}, {"train_loss", loss.item<double>()}});
      if (run.verbose) std::fprintf(stderr, "fit nectar: step %d | validation loss %.5f (best %.5f)\n", step, v, best_val);
      if (v < best_val) best_val = v, best_step = step, best = snapshot();
    }
  }
  {
    torch::NoGradGuard no_grad;
    auto params = module.named_parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(best[i]);
  }
  const double fit_seconds = seconds() - setup_seconds;  // target capture and optimisation
  module.save(out);
  io::write_file_atomic(out + "/queries.json", queries.to_json().dump() + "\n");

  // Held-out quality: the module, and the model with no document at all for scale.
  nlohmann::json splits;
  for (const auto& [name, split] : {std::pair{"test", &queries.test}, {"challenge", &queries.challenge}}) {
    splits[name] = evaluate_document_module(model, document, *student, *split).to_json();
    splits[std::string(name) + "_no_document"] = evaluate_document_module(model, document, *no_document(c, n), *split).to_json();
  }
  nlohmann::json report = {{"module", out}, {"config", config.to_json()},
                           {"loss_weights", {w_alpha, w_content, w_kl}},
                           {"parameters", module.parameter_count()}, {"module_bytes", module.bytes()},
                           {"document_kv_bytes", document.bytes()},
                           {"budget_fraction", module.bytes() / static_cast<double>(document.bytes())},
                           {"queries", {{"train", queries.train.size(0)}, {"validation", queries.validation.size(0)},
                                        {"test", queries.test.size(0)}, {"challenge", queries.challenge.size(0)},
                                        {"length", run.queries.length}}},
                           {"steps", run.steps}, {"best_step", best_step}, {"curve", curve},
                           {"query_seconds", query_seconds}, {"fit_seconds", fit_seconds}, {"splits", splits}};
  io::write_file_atomic(out + "/report.json", report.dump(2) + "\n");
  return report;
}

nlohmann::json evaluate_module_dir(model::Transformer& model, const text::BpeTokenizer& tokenizer, const std::string& module_dir,
                                   const std::string& document_path) {
  const auto module = DocumentModule::load(module_dir, model);
  const auto path = document_path.empty() ? module.config.document_path : document_path;
  const auto ids = read_document(tokenizer, path);
  if (tokens_fingerprint(ids) != module.config.document_hash)
    throw Error("the document " + path + " is not the one the module in " + module_dir + " was fitted on (its tokens differ)");
  const auto queries = NectarQueries::from_json(io::parse_json_file(module_dir + "/queries.json"));
  const auto document = prefill_document(model, ids, queries.test.size(1));
  nlohmann::json r = {{"module", module_dir}, {"document", path}, {"document_tokens", document.tokens()},
                      {"module_bytes", module.bytes()}, {"document_kv_bytes", document.bytes()}};
  for (const auto& [name, split] : {std::pair{"test", &queries.test}, {"challenge", &queries.challenge}}) {
    r[name] = evaluate_document_module(model, document, *module.decode_set(), *split).to_json();
    r[std::string(name) + "_no_document"] = evaluate_document_module(model, document, *no_document(model->config(), document.tokens()), *split).to_json();
  }
  return r;
}

}  // namespace kvx::compress
