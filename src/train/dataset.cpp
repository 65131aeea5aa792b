#include "train/dataset.h"

#include <chrono>
#include <cstring>
#include <iostream>
#include <sstream>

#include "io/atomic_file.h"
#include "util/error.h"

namespace kvx::train {

namespace {
std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

std::string split_text(const std::string& data_dir, const std::vector<std::string>& sources, text::Split split) {
  std::vector<text::Document> docs;
  for (auto& d : text::load_documents(data_dir))
    for (const auto& s : sources)
      if (d.source == s) docs.push_back(std::move(d));
  std::string t = text::join_split(docs, split);
  if (t.empty())
    throw Error("the " + text::split_name(split) + " split of sources [" + join(sources, ",") + "] in " + data_dir +
                " is empty; run `kvx data fetch` (or check data.sources)");
  return t;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

text::BpeTokenizer load_or_train_tokenizer(const std::string& data_dir, const std::vector<std::string>& sources,
                                           int vocab_size) {
  for (const auto& s : sources) text::check_source(s, "tokenizer");
  const std::string path = data_dir + "/tokenizers/bpe-" + join(sources, "+") + "-" + std::to_string(vocab_size) + ".json";
  if (io::file_exists(path)) {
    try {
      return text::BpeTokenizer::load(path);
    } catch (const Error& e) {  // a cache: made again (its advice to retrain pointed back at this same file)
      std::cerr << "warning: the cached tokenizer is damaged (" << e.what() << "); training it again\n";
    }
  }
  std::string corpus = split_text(data_dir, sources, text::Split::Train);
  std::cerr << "training a " << vocab_size << "-token byte-level BPE on " << corpus.size() / 1e6 << " MB ..." << std::flush;
  auto t0 = std::chrono::steady_clock::now();
  text::BpeTrainOptions opt;
  opt.vocab_size = vocab_size;
  auto tok = text::BpeTokenizer::train(corpus, opt);
  std::cerr << " done in " << seconds_since(t0) << " s (" << tok.vocab_size() << " tokens)\n";
  tok.save(path);
  return tok;
}

TokenizedText load_split_tokens(const std::string& data_dir, const std::vector<std::string>& sources,
                                const text::BpeTokenizer& tokenizer, text::Split split) {
  // Checked before the cache path is built: a misspelled source would read as an empty split.
  if (sources.empty()) throw Error("no data sources given; name one or more of brown, kjv (e.g. --sources brown,kjv)");
  for (const auto& s : sources) text::check_source(s, "sources");
  const std::string tag = text::sha256_hex(tokenizer.to_json()).substr(0, 16);
  const std::string path = data_dir + "/tokens/" + join(sources, "+") + "-" + text::split_name(split) + "-" + tag + ".bin";
  static const char kMagic[8] = {'K', 'V', 'X', 'T', 'O', 'K', '1', '\0'};
  TokenizedText out;
  if (io::file_exists(path)) {
    std::string b = io::read_file(path);
    uint64_t n = 0;
    int64_t bytes = 0;
    if (b.size() >= 24 && std::memcmp(b.data(), kMagic, 8) == 0) {
      std::memcpy(&n, b.data() + 8, 8);
      std::memcpy(&bytes, b.data() + 16, 8);
    }
    if (b.size() >= 24 && n == (b.size() - 24) / 4 && (b.size() - 24) % 4 == 0) {
      out.tokens.resize(n);
      std::memcpy(out.tokens.data(), b.data() + 24, n * 4);
      out.bytes = bytes;
      return out;
    }
    std::cerr << "warning: token cache " << path << " is damaged; re-tokenising\n";
  }
  std::string t = split_text(data_dir, sources, split);
  out.tokens = tokenizer.encode(t);
  out.bytes = static_cast<int64_t>(t.size());
  std::string b(kMagic, 8);
  uint64_t n = out.tokens.size();
  b.append(reinterpret_cast<const char*>(&n), 8);
  b.append(reinterpret_cast<const char*>(&out.bytes), 8);
  b.append(reinterpret_cast<const char*>(out.tokens.data()), n * 4);
  io::write_file_atomic(path, b);
  return out;
}

text::MqarSpec mqar_spec(int vocab_size, int pairs, int length, int symbols) {
  return text::MqarSpec::for_vocab(vocab_size, pairs, std::max(1, (length - 2 * pairs) / 2), length, symbols);
}

BatchSampler::BatchSampler(const std::vector<int32_t>* tokens, int batch, int seq_len, uint64_t seed, MqarMix mix,
                           DataShards shards)
    : batch_(batch), seq_len_(seq_len), mix_(mix) {
  if (mix_.fraction > 0) mqar_spec(mix_.vocab_size, mix_.max_pairs, seq_len + 1, mix_.symbols);  // validates
  if (shards.total < 1 || shards.count < 1 || shards.first < 0 || shards.first + shards.count > shards.total)
    throw Error("data shards [" + std::to_string(shards.first) + ", " + std::to_string(shards.first + shards.count) +
                ") do not lie within the " + std::to_string(shards.total) + " shards");
  if (batch % shards.count != 0)
    throw Error("batch_size " + std::to_string(batch) + " does not split evenly over " + std::to_string(shards.count) +
                " data shards");
  const int64_t n = static_cast<int64_t>(tokens->size());
  for (int s = shards.first; s < shards.first + shards.count; ++s) {
    const int64_t lo = n * s / shards.total, hi = n * (s + 1) / shards.total;
    if (hi - lo < seq_len + 1)
      throw Error("training split has " + std::to_string(hi - lo) + " tokens" +
                  (shards.total > 1 ? " per data shard (" + std::to_string(shards.total) + " shards)" : std::string()) +
                  ", fewer than seq_len + 1 = " + std::to_string(seq_len + 1) + "; use more data or a shorter seq_len");
    // One shard keeps the plain seed (runs before sharding existed sample the same windows).
    const uint64_t shard_seed = shards.total == 1 ? seed : seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(s + 1);
    shards_.push_back({tokens->data() + lo, hi - lo, std::mt19937_64(shard_seed)});
  }
}

std::pair<torch::Tensor, torch::Tensor> BatchSampler::next() {
  auto x = torch::empty({batch_, seq_len_}, torch::kLong);
  auto y = torch::empty({batch_, seq_len_}, torch::kLong);
  int64_t* px = x.data_ptr<int64_t>();
  int64_t* py = y.data_ptr<int64_t>();
  const int rows = batch_ / static_cast<int>(shards_.size());
  for (int b = 0; b < batch_; ++b) {
    Shard& sh = shards_[b / rows];
    auto& rng = sh.rng;
    if (mix_.fraction > 0 && static_cast<double>(rng() % 1000000) < mix_.fraction * 1e6) {
      const int pairs = 1 + static_cast<int>(rng() % static_cast<uint64_t>(mix_.max_pairs));
      auto seq = text::make_mqar(mqar_spec(mix_.vocab_size, pairs, seq_len_ + 1, mix_.symbols), rng);
      for (int t = 0; t < seq_len_; ++t) {
        px[b * seq_len_ + t] = seq.tokens[t];
        py[b * seq_len_ + t] = seq.answer[t] >= 0 ? seq.answer[t] : kIgnoreTarget;
      }
      continue;
    }
    const int64_t span = sh.size - seq_len_ - 1;
    int64_t start = span > 0 ? static_cast<int64_t>(rng() % static_cast<uint64_t>(span + 1)) : 0;
    const int32_t* src = sh.tokens + start;
    for (int t = 0; t < seq_len_; ++t) {
      px[b * seq_len_ + t] = src[t];
      py[b * seq_len_ + t] = src[t + 1];
    }
  }
  return {x, y};
}

std::string BatchSampler::state() const {
  std::ostringstream ss;
  for (size_t i = 0; i < shards_.size(); ++i) ss << (i ? "|" : "") << shards_[i].rng;
  return ss.str();
}

void BatchSampler::set_state(const std::string& s) {
  std::vector<std::string> parts;
  std::istringstream all(s);
  for (std::string one; std::getline(all, one, '|');) parts.push_back(one);
  if (parts.size() != shards_.size())
    throw Error("checkpoint: the data sampler state is for " + std::to_string(parts.size()) + " data shards, this run has " +
                std::to_string(shards_.size()) + "; resume with the number of workers (--nproc) it was trained with");
  for (size_t i = 0; i < parts.size(); ++i) {
    std::istringstream ss(parts[i]);
    ss >> shards_[i].rng;
    if (ss.fail()) throw Error("checkpoint: the data sampler state is corrupt; the checkpoint cannot be resumed");
  }
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> evaluation_batches(const std::vector<int32_t>& tokens, int count,
                                                                        int batch, int seq_len,
                                                                        const std::vector<int32_t>& prefix) {
  const int p = static_cast<int>(prefix.size());
  if (p >= seq_len)
    throw Error("windows of " + std::to_string(seq_len) + " tokens leave no room for text after the tokenizer's " +
                std::to_string(p) + " leading special tokens; use longer windows");
  const int text = seq_len - p;                 // text tokens in an input
  const int targets = p > 0 ? text + 1 : text;  // the prefix's last token also predicts
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n < text + 1)
    throw Error("the text to evaluate has " + std::to_string(n) + " tokens, fewer than one window of " +
                std::to_string(text) + " + 1; use shorter windows or sources with more text");
  const int64_t max_windows = (n - 1) / text;
  count = static_cast<int>(std::min<int64_t>(count, max_windows));
  const double stride = count > 1 ? static_cast<double>(n - text - 1) / (count - 1) : 0.0;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  for (int first = 0; first < count; first += batch) {
    const int rows = std::min(batch, count - first);
    auto x = torch::empty({rows, seq_len}, torch::kLong);
    auto y = torch::empty({rows, targets}, torch::kLong);
    int64_t* px = x.data_ptr<int64_t>();
    int64_t* py = y.data_ptr<int64_t>();
    for (int r = 0; r < rows; ++r) {
      const int64_t start = static_cast<int64_t>((first + r) * stride);
      for (int t = 0; t < p; ++t) px[r * seq_len + t] = prefix[t];
      for (int t = 0; t < text; ++t) px[r * seq_len + p + t] = tokens[start + t];
      for (int t = 0; t < targets; ++t) py[r * targets + t] = tokens[start + t + (p > 0 ? 0 : 1)];
    }
    out.emplace_back(x, y);
  }
  return out;
}

}  // namespace kvx::train
