#include "eval/commands.h"

#include <chrono>
#include <cstdio>
#include <limits>
#include <optional>

#include "compress/lla_codec.h"
#include "compress/nectar.h"
#include "eval/evaluate.h"
#include "model/memory.h"
#include "text/corpus.h"
#include "train/dataset.h"
#include "util/error.h"
#include "util/strings.h"

namespace kvx::eval {

namespace {

// The decode cache a request names: element type, eviction, LLA codes, CLA sharing.
attention::CacheOptions cache_options(const train::LoadedModel& m, const std::string& type, const std::string& evict,
                                      bool reference, const std::string& lla, bool lla_absorbed, int share_kv_layers) {
  auto cache = attention::CacheOptions::parse(type, evict, reference);
  if (!lla.empty()) cache.lla = compress::LlaCodec::load(lla, m.model->config()).decode_set();
  cache.lla_absorbed = lla_absorbed;
  cache.share_kv_layers = share_kv_layers;
  return cache;
}

// The cache flags' own ranges, checked before any data is read or memory sized.
void check_cache_flags(const train::LoadedModel& m, int share_kv_layers, const std::string& lla, bool lla_absorbed) {
  const int layers = m.model->config().num_hidden_layers;
  if (share_kv_layers < 1 || share_kv_layers > layers)
    throw Error("--share-kv-layers must be in [1, " + std::to_string(layers) + "] (1: off; at most the model's " +
                std::to_string(layers) + " layers), got " + std::to_string(share_kv_layers));
  if (lla_absorbed && lla.empty()) throw Error("--lla-absorbed reads an LLA codec's history; give the codec with --lla DIR");
}

// A document module is evaluated on its own query splits, not on text windows, so the options that
// shape the text evaluation would be ignored with it: naming one is an error, as is --document
// (read only with a module) alone. Options left at EvalRequest's defaults pass.
void check_document_module_flags(const EvalRequest& r) {
  if (r.document_module.empty()) {
    if (!r.document.empty())
      throw Error("--document is the text of a Nectar module; give the module with --document-module DIR, or drop --document");
    return;
  }
  const EvalRequest defaults;
  std::vector<std::string> ignored;
  if (text::parse_split(r.split) != text::parse_split(defaults.split)) ignored.push_back("--split");
  if (r.data_dir != defaults.data_dir) ignored.push_back("--data-dir");
  if (r.sources != defaults.sources) ignored.push_back("--sources");
  if (r.seq_len != defaults.seq_len) ignored.push_back("--seq-len");
  if (r.max_windows != defaults.max_windows) ignored.push_back("--max-windows");
  if (r.batch != defaults.batch) ignored.push_back("--batch");
  if (!r.kv_cache.empty()) ignored.push_back("--kv-cache");
  if (!r.evict.empty()) ignored.push_back("--evict");
  if (!r.lla.empty()) ignored.push_back("--lla");
  if (r.lla_absorbed) ignored.push_back("--lla-absorbed");
  if (r.share_kv_layers != defaults.share_kv_layers) ignored.push_back("--share-kv-layers");
  if (!r.mqar.empty()) ignored.push_back("--mqar");
  if (r.mqar_symbols != defaults.mqar_symbols) ignored.push_back("--mqar-symbols");
  if (r.mqar_sequences != defaults.mqar_sequences) ignored.push_back("--mqar-sequences");
  if (ignored.empty()) return;
  std::string names;
  for (const auto& f : ignored) names += (names.empty() ? "" : ", ") + f;
  throw Error("--document-module evaluates the module on its own test and challenge queries, so " + names +
              " would be ignored; drop " + (ignored.size() > 1 ? "them" : "it") +
              ", or evaluate the model on text without --document-module");
}

}  // namespace

GenerateOutput generate_text(train::LoadedModel& m, const GenerateRequest& r,
                             const std::function<void(const std::string&)>& on_piece) {
  // The tokens the tokenizer's post_processor puts before a sequence (Llama 3's BOS, as HF's
  // tokenizer adds by default); not after it (an EOS would end the text to continue), nor after a
  // Nectar document (the prompt continues it, and the module never saw a BOS there).
  std::vector<int32_t> prompt = r.document_module.empty() ? m.tokenizer.special_prefix() : std::vector<int32_t>{};
  const auto text = m.tokenizer.encode(r.prompt);
  prompt.insert(prompt.end(), text.begin(), text.end());
  const auto& config = m.model->config();
  const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
  model::check_generation(config, prompt_tokens, r.max_new, {r.temperature, r.top_p});
  check_cache_flags(m, r.share_kv_layers, r.lla, r.lla_absorbed);
  auto cache = cache_options(m, r.kv_cache, r.evict, r.reference, r.lla, r.lla_absorbed, r.share_kv_layers);
  if (!r.document_module.empty()) {
    const auto module = compress::DocumentModule::load(r.document_module, m.model);
    cache.document = module.decode_set();
    model::check_generation(config, prompt_tokens, r.max_new, {r.temperature, r.top_p}, module.config.document_tokens);
    std::fprintf(stderr, "[document module %s: %lld document tokens answered by %.1f KiB of module weights, no document KV]\n",
                 r.document_module.c_str(), static_cast<long long>(module.config.document_tokens), module.bytes() / 1024.0);
  }
  // The cache as asked: its element type, and at most sink + window tokens with eviction.
  int64_t cached = prompt_tokens + r.max_new;
  if (cache.evict.enabled()) cached = std::min(cached, cache.evict.sink + cache.evict.window);
  model::require_memory(model::inference_memory(config, 1, prompt_tokens, cached, m.model->kv_bytes_per_token(cache.type)),
                        model::available_memory_bytes(), "generation",
                        "shorten the prompt, lower max_new, or hold less KV (--kv-cache q8|q4, --evict sink=S,window=W)");
  GenerateOutput out;
  out.prompt_tokens = static_cast<int64_t>(prompt.size());
  out.cache = cache.describe();
  out.stats = model::generate(m.model, prompt, r.max_new, {r.temperature, r.top_p}, r.seed, [&](int32_t id) {
    std::string piece = m.tokenizer.token_bytes(id);
    out.text += piece;
    if (on_piece) on_piece(piece);
  }, cache);
  return out;
}

nlohmann::json evaluate_model(train::LoadedModel& m, const EvalRequest& r) {
  check_document_module_flags(r);
  if (!r.document_module.empty()) return compress::evaluate_module_dir(m.model, m.tokenizer, r.document_module, r.document);
  if (r.batch < 1) throw Error("batch must be >= 1 (got " + std::to_string(r.batch) + ")");
  if (r.max_windows < 0) throw Error("max_windows must be >= 0 (0: all windows; got " + std::to_string(r.max_windows) + ")");
  if (r.seq_len < 0) throw Error("seq_len must be >= 1 (0: the model's context; got " + std::to_string(r.seq_len) + ")");
  if (!r.mqar.empty() && r.mqar_sequences < 1)
    throw Error("mqar_sequences must be >= 1 (sequences per pair count; got " + std::to_string(r.mqar_sequences) + ")");
  check_cache_flags(m, r.share_kv_layers, r.lla, r.lla_absorbed);
  const std::string dir = r.data_dir.empty() ? text::default_data_dir() : r.data_dir;
  auto sources = split_list(r.sources);
  auto split = text::parse_split(r.split);
  const int seq_len = r.seq_len > 0 ? r.seq_len : m.model->config().max_position_embeddings;
  if (seq_len > m.model->config().max_position_embeddings)
    throw Error("seq_len " + std::to_string(seq_len) + " exceeds the model's context limit of " +
                std::to_string(m.model->config().max_position_embeddings) + "; give a shorter one");
  // MQAR pair counts, checked against this context before the cross-entropy evaluation runs
  std::vector<int> mqar_pairs;
  for (const auto& p : split_list(r.mqar)) {
    const int n = whole_int(p).value_or(0);
    if (n < 1) throw Error("mqar: '" + p + "' is not a pair count; give positive integers, e.g. 1,4,16");
    train::mqar_spec(m.model->config().vocab_size, n, seq_len, r.mqar_symbols);
    mqar_pairs.push_back(n);
  }
  std::optional<attention::CacheOptions> cache;  // the decode cache asked for, if any
  if (!r.kv_cache.empty() || !r.evict.empty() || !r.lla.empty() || r.share_kv_layers > 1)
    cache = cache_options(m, r.kv_cache.empty() ? "f32" : r.kv_cache, r.evict, false, r.lla, r.lla_absorbed, r.share_kv_layers);
  if (cache && cache->evict.enabled() && cache->evict.sink + cache->evict.window >= seq_len)
    throw Error("--evict sink=" + std::to_string(cache->evict.sink) + ",window=" + std::to_string(cache->evict.window) +
                " keeps every token of the " + std::to_string(seq_len) + "-token windows evaluated, so nothing would be evicted; " +
                "give sink + window below " + std::to_string(seq_len) + " (or a longer --seq-len)");
  model::require_memory(model::inference_memory(m.model->config(), r.batch, seq_len, seq_len, m.model->kv_bytes_per_token()),
                        model::available_memory_bytes(), "evaluation", "lower --seq-len or --batch");
  auto tokens = train::load_split_tokens(dir, sources, m.tokenizer, split);
  auto train_tokens = train::load_split_tokens(dir, sources, m.tokenizer, text::Split::Train);
  // Each window starts as the tokenizer starts a sequence (an imported Llama 3: its BOS), as HF
  // scores text; a kvx tokenizer puts nothing there.
  // (evaluation_batches caps the count at the windows the text holds)
  const std::vector<int32_t>& prefix = m.tokenizer.special_prefix();
  const int windows = r.max_windows > 0 ? r.max_windows : std::numeric_limits<int>::max();
  auto batches = train::evaluation_batches(tokens.tokens, windows, r.batch, seq_len, prefix);
  auto t0 = std::chrono::steady_clock::now();
  auto q = evaluate_lm(m.model, batches, m.tokenizer);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto u = unigram_quality(train_tokens.tokens, m.model->config().vocab_size, batches, m.tokenizer);
  nlohmann::json j = {{"model", m.dir},
                      {"split", text::split_name(split)},
                      {"sources", sources},
                      {"seq_len", seq_len},
                      {"window_prefix", prefix},
                      {"tokens", q.tokens},
                      {"bytes", q.bytes},
                      {"cross_entropy", q.cross_entropy},
                      {"perplexity", q.perplexity},
                      {"bits_per_byte", q.bits_per_byte},
                      {"unigram_cross_entropy", u.cross_entropy},
                      {"unigram_bits_per_byte", u.bits_per_byte},
                      {"kv_bytes_per_token", m.model->kv_bytes_per_token()},
                      {"kv_cache", "f32"},
                      {"parameters", m.model->num_parameters()},
                      {"seconds", secs}};
  if (cache) {
    // Codes are committed after a token's loops: one token per step, so history is read from codes.
    auto c = evaluate_lm_cached(m.model, batches, m.tokenizer, *cache, cache->lla ? 1 : 0);
    j["cache"] = {{"kv_cache", cache->describe()},
                  {"bytes_per_token", c.cache_bytes_per_token},
                  {"held_bytes_per_token", c.held_bytes_per_token},
                  {"cross_entropy", c.quality.cross_entropy},
                  {"bits_per_byte", c.quality.bits_per_byte},
                  {"kl_vs_f32", c.kl_vs_full},
                  {"top1_agreement", c.top1_agreement}};
  }
  if (!mqar_pairs.empty()) {
    auto accuracy = [&](const attention::CacheOptions* through) {
      nlohmann::json acc = nlohmann::json::array();
      for (const auto& p : mqar_accuracy(m.model, mqar_pairs, r.mqar_sequences, seq_len, r.mqar_symbols, 1234, through))
        acc.push_back({{"pairs", p.pairs}, {"accuracy", p.accuracy}, {"queries", p.queries}});
      return acc;
    };
    j["mqar_accuracy"] = accuracy(nullptr);
    // also through the cache (prefilled at once: LLA codes, committed a token at a time, are left out)
    if (cache && !cache->lla) j["cache"]["mqar_accuracy"] = accuracy(&*cache);
  }
  return j;
}

}  // namespace kvx::eval
