// Byte-level BPE tokenizer (GPT-2 / Hugging Face `tokenizers` style), torch-free.
//
// Base alphabet: all 256 bytes. A freshly constructed or trained tokenizer gives
// byte b the id b (byte-value order); merged tokens follow in merge order.
// Loaded tokenizer.json files may use any dense id order (e.g. GPT-2's).
// Pre-tokenisation is a hand-written split pattern: GPT-2's (what kvx trains), or the
// Llama-3 / Qwen2 one when a loaded tokenizer.json names it (a Split pre-tokenizer before a
// ByteLevel one); see bpe.cpp for the (small) deviations from Hugging Face. encode/decode
// round-trip any bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvx::text {

struct BpeTrainOptions {
  int vocab_size = 4096;   // total tokens incl. the 256 bytes (values < 256 mean no merges)
  int min_frequency = 2;   // stop when the best pair occurs fewer times than this
  bool verbose = false;    // progress on stderr
};

class BpeTokenizer {
 public:
  BpeTokenizer();  // 256 byte tokens, no merges

  static BpeTokenizer train(std::string_view corpus, const BpeTrainOptions& opt);
  static BpeTokenizer from_json(const std::string& json_text);  // HF tokenizer.json
  static BpeTokenizer load(const std::string& path);
  std::string to_json() const;
  void save(const std::string& path) const;  // atomic (io::write_file_atomic)

  // Default: single thread for small inputs, up to hardware_concurrency threads
  // for inputs of several MB. num_threads = 1 forces single-threaded encoding;
  // 0 means automatic. The result does not depend on the thread count.
  std::vector<int32_t> encode(std::string_view bytes) const;
  std::vector<int32_t> encode(std::string_view bytes, int num_threads) const;
  // HF's encode(text, add_special_tokens=True) for one sequence: encode() wrapped in the special
  // tokens of tokenizer.json's post_processor (Llama 3's <|begin_of_text|> before it; generate puts
  // the prefix before a prompt). Tokenizers kvx trains have none, so this equals encode().
  std::vector<int32_t> encode_with_special_tokens(std::string_view bytes) const;
  const std::vector<int32_t>& special_prefix() const { return special_prefix_; }
  const std::vector<int32_t>& special_suffix() const { return special_suffix_; }

  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode(const int32_t* ids, size_t n) const;

  int vocab_size() const;  // every id, added tokens included

  // Added tokens (tokenizer.json "added_tokens", e.g. <|endoftext|>, <|im_start|>): matched
  // literally in the raw text before pre-tokenisation, leftmost then longest, never split or
  // merged; decoded to their content. Ids may lie past the BPE vocabulary (as Qwen's do).
  struct AddedToken {
    int32_t id = 0;
    std::string content;
    bool special = false;
    bool in_vocab = false;  // also an entry of model.vocab (GPT-2's <|endoftext|>)
  };
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  std::string token_bytes(int32_t id) const;  // raw bytes of a token
  int32_t byte_token(uint8_t b) const { return byte_id_[b]; }
  // Merges in rank order as (left id, right id); merge_result(i) is the produced id.
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merges_; }
  int32_t merge_result(size_t i) const { return merge_result_[i]; }

  // The pre-tokens of `text` (views into it) under GPT-2's pattern, and under this tokenizer's own.
  static std::vector<std::string_view> pretokenize(std::string_view text);
  std::vector<std::string_view> pre_tokens(std::string_view text) const;
  // "gpt2", "llama3" (digits in runs of up to 3) or "qwen2" (single digits).
  std::string split_pattern() const;
  // Unicode NFC of the valid UTF-8 runs of `bytes` (other bytes kept): the "NFC" normalizer.
  static std::string nfc(std::string_view bytes);
  bool normalizes() const { return nfc_; }
  // GPT-2's bytes_to_unicode mapping of a byte string (UTF-8), and its inverse.
  // unicode_to_bytes returns false if a character is outside the mapping.
  static std::string bytes_to_unicode(std::string_view bytes);
  static bool unicode_to_bytes(std::string_view text, std::string* out);

 private:
  static BpeTokenizer from_parsed_json(const void* json);  // nlohmann::json*
  void build_tables();  // rebuilds the pair table from merges_/merge_result_
  void encode_range(std::string_view text, std::vector<int32_t>* out) const;
  std::vector<int32_t> encode_normalized(std::string_view bytes, int num_threads) const;  // after NFC
  std::vector<int32_t> encode_plain(std::string_view bytes, int num_threads) const;       // no added tokens
  void bpe_word(std::string_view word, std::vector<int32_t>* out) const;
  bool ignore_merges_ = false;                        // Llama 3: whole vocabulary words first
  std::unordered_map<std::string, int32_t> whole_word_;  // their bytes -> id (only with ignore_merges_)
  // (a,b) -> (rank << 32 | result); returns false if (a,b) is not a merge.
  bool find_pair(int32_t a, int32_t b, uint64_t* val) const;

  std::string tok_bytes_;           // all token bytes, concatenated
  std::vector<uint32_t> tok_off_;   // token i = tok_bytes_[tok_off_[i], tok_off_[i+1])
  int32_t byte_id_[256];
  std::vector<std::pair<int32_t, int32_t>> merges_;
  std::vector<int32_t> merge_result_;
  std::vector<uint64_t> pair_keys_;  // open addressing; empty slot = ~0
  std::vector<uint64_t> pair_vals_;
  uint64_t pair_mask_ = 0;
  std::vector<AddedToken> added_;  // longest content first
  int split_digits_ = 0;           // 0: GPT-2's pattern; 3: Llama 3's; 1: Qwen2's
  bool nfc_ = false;               // normalizer NFC (Qwen2/3): encode composes the text first
  std::string post_processor_;     // tokenizer.json's post_processor, kept for saving
  std::vector<int32_t> special_prefix_, special_suffix_;  // what it puts around one sequence
  bool added_first_byte_[256] = {};
};

}  // namespace kvx::text
