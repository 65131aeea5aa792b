// Nectar on a whole model (SPEC 1.4): the exact document in a module's place reproduces the model
// reading document + query as one sequence (forward and decode, fused and reference), a module's
// fused decode equals its libtorch forward, files round-trip and refuse what does not match, and
// `kvx fit nectar` runs end to end and beats the model without the document.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "compress/nectar.h"
#include "eval/commands.h"
#include "support/fixtures.h"
#include "train/checkpoint.h"
#include "util/error.h"

using namespace kvx;
using namespace kvx::compress;

namespace {

model::ModelConfig doc_config(int heads, int kv_heads) {
  auto c = kvx::testing::mixer_config(heads, kv_heads, 8, 24);
  c.num_hidden_layers = 2;
  c.vocab_size = 41;
  c.max_position_embeddings = 96;
  c.validate();
  return c;
}

std::vector<int32_t> random_ids(int64_t n, int vocab, uint64_t seed) {
  torch::manual_seed(seed);
  const auto t = torch::randint(vocab, {n}, torch::kLong);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(t[i].item<int64_t>()));
  return ids;
}

torch::Tensor as_tensor(const std::vector<int32_t>& ids) {
  return torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong).unsqueeze(0);
}

// Logits of `query` [B, T] decoded one token (or chunk) per step after the document.
torch::Tensor decode_after(model::Transformer& m, std::shared_ptr<const attention::NectarDocument> doc, const torch::Tensor& query,
                           bool reference, int64_t chunk) {
  attention::CacheOptions o;
  o.reference = reference;
  o.document = std::move(doc);
  auto state = m->new_state(query.size(0), o);
  std::vector<torch::Tensor> out;
  for (int64_t t = 0; t < query.size(1); t += chunk)
    out.push_back(m->step(query.narrow(1, t, std::min(chunk, query.size(1) - t)), state));
  EXPECT_EQ(state.length(), o.document->tokens + query.size(1));
  return torch::cat(out, 1);
}

}  // namespace

TEST(NectarModel, ExactDocumentEqualsReadingDocumentAndQueryAsOneSequence) {
  torch::NoGradGuard no_grad;
  for (const auto [H, Hkv] : {std::pair{4, 4}, {4, 2}, {4, 1}}) {
    torch::manual_seed(11);
    auto c = doc_config(H, Hkv);
    model::Transformer m(c);
    m->to(torch::kFloat64);
    const auto doc_ids = random_ids(29, c.vocab_size, 1), query_ids = random_ids(13, c.vocab_size, 2);
    std::vector<int32_t> all = doc_ids;
    all.insert(all.end(), query_ids.begin(), query_ids.end());
    const auto full = m->forward(as_tensor(all)).narrow(1, 29, 13);
    const auto doc = prefill_document(m, doc_ids, 13);
    EXPECT_EQ(doc.bytes(), 2 * 29 * c.num_hidden_layers * Hkv * c.head_dim * 4);
    const auto exact = doc.exact(c);
    const auto composed = forward_after_document(m, *exact, as_tensor(query_ids));
    EXPECT_TRUE(torch::allclose(composed, full, 1e-9, 1e-9)) << H << "/" << Hkv;
    // Decode reads the same, with the reference path in double and the fused kernel (f32) in chunks.
    EXPECT_TRUE(torch::allclose(decode_after(m, exact, as_tensor(query_ids), true, 1), full, 1e-9, 1e-9));
    EXPECT_TRUE(torch::allclose(decode_after(m, exact, as_tensor(query_ids), true, 5), full, 1e-9, 1e-9));
    m->to(torch::kFloat32);
    const auto doc32 = prefill_document(m, doc_ids, 13);
    const auto full32 = m->forward(as_tensor(all)).narrow(1, 29, 13);
    for (const int64_t chunk : {1, 4})
      EXPECT_TRUE(torch::allclose(decode_after(m, doc32.exact(c), as_tensor(query_ids), false, chunk), full32, 1e-4, 1e-4))
          << H << "/" << Hkv << " chunk " << chunk;
  }
}

TEST(NectarModel, ModuleDecodeFusedEqualsReferenceEqualsForward) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(12);
  auto c = doc_config(6, 2);
  c.head_dim = 8;
  model::Transformer m(c);
  const auto doc_ids = random_ids(40, c.vocab_size, 3);
  const auto doc = prefill_document(m, doc_ids, 20);
  for (const std::string kind : {"mlp", "quadrature"}) {
    NectarModuleConfig mc;
    mc.arch = attention::NectarArch::parse(kind, kind == "mlp" ? "1,1,1" : "");
    mc.document_tokens = doc.tokens();
    mc.sizes = {kind == "mlp" ? 7 : 5, kind == "mlp" ? 3 : 9};
    auto module = DocumentModule::build(mc, c);
    if (kind == "quadrature")
      for (int l = 0; l < 2; ++l)
        dynamic_cast<attention::NectarQuadrature*>(module.layers[l].get())->initialize(doc.keys[l][0], doc.values[l][0]);
    const auto set = module.decode_set();
    torch::manual_seed(4);
    const auto query = torch::randint(c.vocab_size, {2, 17}, torch::kLong);
    const auto forward = forward_after_document(m, *set, query);
    EXPECT_TRUE(torch::allclose(decode_after(m, set, query, true, 1), forward, 1e-4, 1e-4)) << kind;
    EXPECT_TRUE(torch::allclose(decode_after(m, set, query, false, 1), forward, 1e-4, 1e-4)) << kind;
    EXPECT_TRUE(torch::allclose(decode_after(m, set, query, false, 6), forward, 1e-4, 1e-4)) << kind;
    // The module changes the answer: it is not the exact document, nor no document.
    EXPECT_FALSE(torch::allclose(forward, forward_after_document(m, *doc.exact(c), query), 1e-3, 1e-3));
    EXPECT_FALSE(torch::allclose(forward, forward_after_document(m, *no_document(c, doc.tokens()), query), 1e-3, 1e-3));
  }
}

TEST(NectarModel, BadDocumentsAndOptionsAreRefused) {
  torch::NoGradGuard no_grad;
  auto c = doc_config(4, 2);
  model::Transformer m(c);
  EXPECT_THROW(prefill_document(m, {}, 8), Error);
  try {
    prefill_document(m, random_ids(90, c.vocab_size, 1), 8);
    ADD_FAILURE() << "a document past the context was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos) << e.what();
  }
  const auto doc = prefill_document(m, random_ids(80, c.vocab_size, 1), 8);
  EXPECT_THROW(forward_after_document(m, *doc.exact(c), torch::zeros({1, 20}, torch::kLong)), Error);  // 80 + 20 > 96
  attention::CacheOptions o;
  o.document = doc.exact(c);
  auto state = m->new_state(1, o);
  m->step(torch::zeros({1, 16}, torch::kLong), state);
  EXPECT_THROW(m->step(torch::zeros({1, 1}, torch::kLong), state), Error);  // position 96
  o.share_kv_layers = 2;
  EXPECT_THROW(m->new_state(1, o), Error);
  auto looped = c;
  looped.loops = 2;
  model::Transformer lm(looped);
  EXPECT_THROW(prefill_document(lm, random_ids(10, c.vocab_size, 1), 8), Error);
  EXPECT_THROW(layer_budgets(0, 10, 8, 2, {}), Error);
  EXPECT_THROW(layer_budgets(0.1, 10, 8, 2, {1, 1, 1}), Error);
  const auto b = layer_budgets(0.1, 100, 8, 4, {1, 3});  // groups {0,1}, {2,3}: 0.5x and 1.5x of 160
  ASSERT_EQ(b.size(), 4u);
  EXPECT_DOUBLE_EQ(b[0], 80);
  EXPECT_DOUBLE_EQ(b[3], 240);
}

TEST(NectarModel, FitSaveLoadAndRefuseAnotherModel) {
  // A byte-level model trained briefly on the synthetic corpus, a document from the same words.
  const auto dir = kvx::testing::temp_dir("nectar_fit");
  auto run = kvx::testing::small_run(12);
  run.model.max_position_embeddings = 160;
  const auto data = kvx::testing::small_training_data();
  train::TrainArgs args;
  args.config = run;
  args.run_dir = dir + "/run";
  args.verbose = false;
  train::run_training(args, data);
  const std::string document = dir + "/doc.txt";
  std::ofstream(document) << "the cat sat on a mat and the dog ran far. a dog sat on the cat and ran.\n";
  FitNectarRun fit;
  fit.model = dir + "/run";
  fit.document = document;
  fit.out = dir + "/module";
  fit.rho = 0.5;
  fit.arch = attention::NectarArch::parse("mlp", "1,1,1");
  fit.steps = 30;
  fit.batch = 8;
  fit.queries.count = 40;
  fit.queries.length = 24;
  fit.verbose = false;
  const auto report = fit_nectar_run(fit);
  EXPECT_EQ(report["queries"]["test"].get<int>(), 8);
  EXPECT_EQ(report["queries"]["challenge"].get<int>(), 2);
  EXPECT_LE(report["module_bytes"].get<double>(), 0.5 * report["document_kv_bytes"].get<double>() * 1.0001);
  // Fitting lowered the held-out objective, and the module is closer to the document than nothing.
  EXPECT_LT(report["curve"].back()["validation_loss"].get<double>(), report["curve"][0]["validation_loss"].get<double>());
  EXPECT_LT(report["splits"]["test"]["content_mse"].get<double>(), report["splits"]["test_no_document"]["content_mse"].get<double>());
  for (const auto* f : {"nectar.json", "nectar.safetensors", "queries.json", "report.json"})
    EXPECT_TRUE(std::filesystem::exists(fit.out + "/" + f)) << f;

  auto loaded = train::load_model(dir + "/run");
  const auto module = DocumentModule::load(fit.out, loaded.model);
  {  // generate puts a tokenizer's leading special token (a BOS) before a prompt, but not between a module's document and it
    auto j = nlohmann::json::parse(loaded.tokenizer.to_json());
    j["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", {{{"SpecialToken", {{"id", "<bos>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
                           {"special_tokens", {{"<bos>", {{"ids", {0}}}}}}};
    train::LoadedModel bos{loaded.model, text::BpeTokenizer::from_json(j.dump()), loaded.dir};
    eval::GenerateRequest r;
    r.prompt = "the cat";
    r.max_new = 1;
    r.temperature = 0;
    const int64_t text_tokens = static_cast<int64_t>(bos.tokenizer.encode(r.prompt).size());
    EXPECT_EQ(eval::generate_text(bos, r).prompt_tokens, text_tokens + 1);
    r.document_module = fit.out;
    EXPECT_EQ(eval::generate_text(bos, r).prompt_tokens, text_tokens);
  }
  const auto again = evaluate_module_dir(loaded.model, loaded.tokenizer, fit.out, "");
  EXPECT_NEAR(again["test"]["kl"].get<double>(), report["splits"]["test"]["kl"].get<double>(), 1e-6);
  // The saved queries serve only the options they were made with (other counts reused them, mislabelled).
  {
    const auto doc_kv = prefill_document(loaded.model, read_document(loaded.tokenizer, document), fit.queries.length);
    const std::string shared = dir + "/shared_queries.json";
    const auto made = load_or_make_queries(shared, loaded.model, loaded.tokenizer, doc_kv, fit.queries);
    EXPECT_TRUE(torch::equal(load_or_make_queries(shared, loaded.model, loaded.tokenizer, doc_kv, fit.queries).test, made.test));
    QueryOptions fewer = fit.queries;
    fewer.count = 20;
    try {
      load_or_make_queries(shared, loaded.model, loaded.tokenizer, doc_kv, fewer);
      ADD_FAILURE() << "queries made for other options were reused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("asked for"), std::string::npos) << e.what();
    }
  }
  // Another document, another model, a truncated file: refused with the reason.
  const std::string other = dir + "/other.txt";
  std::ofstream(other) << "a dog ran far.\n";
  EXPECT_THROW(evaluate_module_dir(loaded.model, loaded.tokenizer, fit.out, other), Error);
  std::ofstream(dir + "/empty.txt").close();
  EXPECT_THROW(read_document(loaded.tokenizer, dir + "/empty.txt"), Error);
  {
    torch::NoGradGuard no_grad;
    auto p = loaded.model->parameters()[1];
    p.add_(1e-3);
  }
  try {
    DocumentModule::load(fit.out, loaded.model);
    ADD_FAILURE() << "a module for another model was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos) << e.what();
  }
  auto fresh = train::load_model(dir + "/run");
  const auto path = fit.out + "/nectar.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 9);
  EXPECT_THROW(DocumentModule::load(fit.out, fresh.model), Error);
  std::filesystem::remove_all(dir);
}
