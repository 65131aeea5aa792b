// Byte-level BPE: hand-written GPT-2 pre-tokeniser, incremental trainer, cached encoder.
//
// Deviations from Hugging Face `tokenizers` (ByteLevel pre-tokenizer + BPE model):
//  - Input is raw bytes, not a Rust str: invalid UTF-8 bytes are single "other"
//    characters (HF cannot see such input at all).
//  - \p{L}, \p{N} and \s come from ICU's Unicode database (ICU 72 on Debian
//    12), which may differ from the Unicode version of HF's regex engine for
//    characters added in between.
//  - Trained tokenizers use byte-value order for ids 0..255 (HF uses the
//    bytes_to_unicode character order); loaded files keep their own ids.
//  - The only normalizer is NFC (Qwen2/3), applied to the valid UTF-8 runs of the
//    input before added tokens are matched (HF matches non-normalized added
//    tokens first; NFC leaves the ASCII special tokens unchanged either way).
//  - added_tokens with lstrip, rstrip or single_word are rejected; the others
//    are matched in the (normalised) text before pre-tokenisation.
//  - Rejected at load time: other normalizers, pre-tokenizers other than
//    ByteLevel or Split(GPT-2 / Llama 3 / Qwen2 pattern) + ByteLevel, dropout,
//    byte_fallback and prefixes/suffixes.
//  - ignore_merges (Llama 3): a pre-token that is itself a vocabulary entry is that token, before
//    any merge (HF's BPE does the same lookup first).
//  - post_processor: encode is HF's encode(text, add_special_tokens=False);
//    encode_with_special_tokens adds what the post_processor puts around a single sequence
//    (TemplateProcessing, as Llama 3's <|begin_of_text|>; Bert/RobertaProcessing's cls and sep;
//    ByteLevel, which only moves offsets; a Sequence of them). Other kinds are rejected at load.
#include "text/bpe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <queue>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include "io/atomic_file.h"
#include "util/error.h"

namespace kvx::text {
namespace {

// ---------------------------------------------------------------- characters

enum Cls : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };

// \s is the White_Space property, \p{L} and \p{N} the general categories L* and N*, from
// ICU's Unicode database (what Hugging Face's regex engine consults).
Cls classify_cp(uint32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  if (u_isUWhiteSpace(c)) return kSpace;
  const uint32_t mask = U_GET_GC_MASK(c);
  if (mask & U_GC_L_MASK) return kLetter;
  if (mask & U_GC_N_MASK) return kNumber;
  return kOther;
}

struct AsciiTable {
  uint8_t cls[128];
  AsciiTable() {
    for (int c = 0; c < 128; ++c) {
      Cls k = kOther;
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) k = kLetter;
      else if (c >= '0' && c <= '9') k = kNumber;
      else if (c == ' ' || (c >= 9 && c <= 13)) k = kSpace;
      cls[c] = k;
    }
  }
};
const AsciiTable kAscii;

// Length of the valid UTF-8 sequence at p (2..4) with its code point, or 0.
inline int decode_utf8(const uint8_t* p, const uint8_t* e, uint32_t* cp) {
  uint8_t c = p[0];
  auto cont = [](uint8_t x) { return (x & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) {
    if (e - p < 2 || !cont(p[1])) return 0;
    *cp = ((c & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    return 2;
  }
  if (c >= 0xE0 && c <= 0xEF) {
    if (e - p < 3 || !cont(p[1]) || !cont(p[2])) return 0;
    if (c == 0xE0 && p[1] < 0xA0) return 0;  // overlong
    if (c == 0xED && p[1] > 0x9F) return 0;  // surrogate
    *cp = ((c & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (e - p < 4 || !cont(p[1]) || !cont(p[2]) || !cont(p[3])) return 0;
    if (c == 0xF0 && p[1] < 0x90) return 0;
    if (c == 0xF4 && p[1] > 0x8F) return 0;
    *cp = ((c & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
    return 4;
  }
  return 0;
}

inline Cls classify(const uint8_t* p, const uint8_t* e, int* len) {
  if (*p < 0x80) {
    *len = 1;
    return static_cast<Cls>(kAscii.cls[*p]);
  }
  uint32_t cp;
  int n = decode_utf8(p, e, &cp);
  if (n == 0) {
    *len = 1;
    return kOther;
  }
  *len = n;
  return classify_cp(cp);
}

// End of the run of characters of class k starting at p.
inline const uint8_t* run_end(const uint8_t* p, const uint8_t* e, Cls k) {
  while (p < e) {
    if (*p < 0x80) {
      if (kAscii.cls[*p] != k) break;
      ++p;
      continue;
    }
    int l;
    if (classify(p, e, &l) != k) break;
    p += l;
  }
  return p;
}

// Calls f(begin, end) (byte offsets) for every pre-token of the GPT-2 pattern
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
template <class F>
void for_each_pretoken(std::string_view text, F&& f) {
  const uint8_t* const b = reinterpret_cast<const uint8_t*>(text.data());
  const uint8_t* const e = b + text.size();
  const uint8_t* p = b;
  while (p < e) {
    const uint8_t c = *p;
    if (c == '\'' && e - p >= 2) {
      const uint8_t c1 = p[1];
      int n = 0;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') n = 2;
      else if (e - p >= 3 && ((c1 == 'r' && p[2] == 'e') || (c1 == 'v' && p[2] == 'e') ||
                              (c1 == 'l' && p[2] == 'l')))
        n = 3;
      if (n) {
        f(p - b, p + n - b);
        p += n;
        continue;
      }
    }
    if (c == ' ' && e - p >= 2) {
      int l;
      Cls k = classify(p + 1, e, &l);
      if (k != kSpace) {
        const uint8_t* q = run_end(p + 1 + l, e, k);
        f(p - b, q - b);
        p = q;
        continue;
      }
    }
    int l;
    Cls k = classify(p, e, &l);
    if (k != kSpace) {
      const uint8_t* q = run_end(p + l, e, k);
      f(p - b, q - b);
      p = q;
      continue;
    }
    // Whitespace: \s+(?!\S) leaves the last space before a non-space; \s+ otherwise.
    const uint8_t* q = p + l;
    const uint8_t* last = p;
    while (q < e) {
      int l2;
      if (classify(q, e, &l2) != kSpace) break;
      last = q;
      q += l2;
    }
    if (q < e && last > p) q = last;
    f(p - b, q - b);
    p = q;
  }
}

// The Llama-3 / Qwen2 pattern (GPT-4's cl100k family), D = 3 (Llama 3) or 1 (Qwen2/3):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Alternatives are tried in order at each position, as the regex engine does.
template <class F>
void for_each_pretoken_gpt4(std::string_view text, int max_digits, F&& f) {
  const uint8_t* const b = reinterpret_cast<const uint8_t*>(text.data());
  const uint8_t* const e = b + text.size();
  const uint8_t* p = b;
  const auto newline = [](uint8_t c) { return c == '\r' || c == '\n'; };
  const auto lower = [](uint8_t c) { return uint8_t(c >= 'A' && c <= 'Z' ? c + 32 : c); };
  const auto emit = [&](const uint8_t* q) {
    f(p - b, q - b);
    p = q;
  };
  while (p < e) {
    const uint8_t c = *p;
    if (c == '\'' && e - p >= 2) {  // contractions, any case
      const uint8_t c1 = lower(p[1]);
      int n = 0;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') n = 2;
      else if (e - p >= 3 && ((c1 == 'r' && lower(p[2]) == 'e') || (c1 == 'v' && lower(p[2]) == 'e') ||
                              (c1 == 'l' && lower(p[2]) == 'l')))
        n = 3;
      if (n) {
        emit(p + n);
        continue;
      }
    }
    int l;
    const Cls k = classify(p, e, &l);
    if (k == kLetter) {  // \p{L}+
      emit(run_end(p + l, e, kLetter));
      continue;
    }
    if (k != kNumber && !newline(c) && p + l < e) {  // [^\r\n\p{L}\p{N}]\p{L}+
      int l2;
      if (classify(p + l, e, &l2) == kLetter) {
        emit(run_end(p + l + l2, e, kLetter));
        continue;
      }
    }
    if (k == kNumber) {  // \p{N}{1,D}
      const uint8_t* q = p + l;
      for (int i = 1; i < max_digits && q < e; ++i) {
        int l2;
        if (classify(q, e, &l2) != kNumber) break;
        q += l2;
      }
      emit(q);
      continue;
    }
    {  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
      const uint8_t* s = p;
      int ls = l;
      if (c == ' ' && p + 1 < e) {
        int l2;
        if (classify(p + 1, e, &l2) == kOther) s = p + 1, ls = l2;
      }
      if ((s == p ? k : kOther) == kOther) {
        const uint8_t* q = run_end(s + ls, e, kOther);
        while (q < e && newline(*q)) ++q;
        emit(q);
        continue;
      }
    }
    // Whitespace. \s*[\r\n]+: up to the run's last CR/LF.
    const uint8_t* w = p;
    const uint8_t* last_newline = nullptr;
    const uint8_t* last = p;
    while (w < e) {
      int l2;
      if (classify(w, e, &l2) != kSpace) break;
      if (newline(*w)) last_newline = w;
      last = w;
      w += l2;
    }
    if (last_newline) {
      emit(last_newline + 1);
      continue;
    }
    // \s+(?!\S) leaves the last space before a non-space; \s+ otherwise.
    emit(w < e && last > p ? last : w);
  }
}

// ------------------------------------------------------------ bytes_to_unicode

struct ByteUnicode {
  uint32_t cp[256];
  int16_t inv[512];
  ByteUnicode() {
    std::fill(std::begin(inv), std::end(inv), int16_t(-1));
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      cp[b] = printable ? uint32_t(b) : uint32_t(256 + n++);
      inv[cp[b]] = int16_t(b);
    }
  }
};
const ByteUnicode kByteUnicode;

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(char(cp));
  } else {  // the mapping only produces code points < 0x800
    out->push_back(char(0xC0 | (cp >> 6)));
    out->push_back(char(0x80 | (cp & 0x3F)));
  }
}

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
}
inline uint64_t pair_hash(uint64_t key) {
  key *= 0x9E3779B97F4A7C15ull;
  return key ^ (key >> 31);
}

// The split patterns as tokenizer.json spells them (Split pre-tokenizer regexes).
const char* const kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const char* kRetrain = "re-train the tokenizer with `kvx tokenizer train`";

std::string OrRetrain(const char* fix) { return std::string(fix) + " or " + kRetrain; }

[[noreturn]] void bad_json(const std::string& what, const std::string& fix = kRetrain) {
  throw Error("tokenizer.json: " + what + "; " + fix);
}

// The special-token ids a tokenizer.json post_processor puts before (prefix) and after (suffix)
// a single sequence, HF's add_special_tokens=True. Returns whether it adds any. A Sequence may
// hold one processor that adds tokens (HF's template would see the pieces a previous one made as
// a pair), among ByteLevel ones.
bool post_processor_tokens(const nlohmann::json& pp, size_t vocab, std::vector<int32_t>* prefix, std::vector<int32_t>* suffix,
                           int depth = 0) {
  using json = nlohmann::json;
  const auto fix = OrRetrain("remove the post_processor (prompts then get no special tokens)");
  auto string_at = [](const json& o, const char* key) {  // o[key] if o is an object holding a string there, else ""
    return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].get<std::string>() : std::string();
  };
  const std::string type = string_at(pp, "type");
  std::vector<int32_t> before, after;
  auto token_id = [&](const json& id, const std::string& what) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
      bad_json("'post_processor' " + what + " has id " + id.dump().substr(0, 40) + ", not a token id", fix);
    if (static_cast<size_t>(id.get<int64_t>()) >= vocab)
      bad_json("'post_processor' adds token id " + id.dump() + ", outside the vocabulary of " + std::to_string(vocab) + " tokens",
               OrRetrain("correct its ids, or remove the post_processor"));
    return static_cast<int32_t>(id.get<int64_t>());
  };
  auto pair_id = [&](const char* key) {  // ["<s>", 0]
    const json p = pp.value(key, json());
    if (!p.is_array() || p.size() != 2)
      bad_json("'post_processor' " + type + " needs '" + key + "' as [token, id], got " + p.dump().substr(0, 80), fix);
    return token_id(p[1], type + " " + key);
  };
  if (type == "ByteLevel") return false;  // offsets only
  if (type == "Sequence") {
    const auto procs = pp.find("processors");
    if (procs == pp.end() || !procs->is_array()) bad_json("'post_processor' Sequence needs a 'processors' array", fix);
    if (depth >= 8) bad_json("'post_processor' nests Sequences more than 8 deep", fix);
    int adding = 0;
    for (const json& p : *procs) adding += post_processor_tokens(p, vocab, prefix, suffix, depth + 1);
    if (adding > 1)
      bad_json("'post_processor' Sequence holds " + std::to_string(adding) +
                   " processors that add tokens; kvx applies one (HF's later template would see the earlier one's pieces as a pair)",
               fix);
    return adding > 0;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    before = {pair_id("cls")};
    after = {pair_id("sep")};
  } else if (type == "TemplateProcessing") {
    const auto single = pp.find("single");
    if (single == pp.end() || !single->is_array()) bad_json("'post_processor' TemplateProcessing needs a 'single' template array", fix);
    const auto specials = pp.find("special_tokens");
    bool sequence = false;
    for (const json& piece : *single) {
      const auto seq = piece.is_object() ? piece.find("Sequence") : piece.end();
      if (piece.is_object() && seq != piece.end()) {
        const std::string id = seq->is_object() && seq->contains("id") ? string_at(*seq, "id") : "A";
        if (sequence || id != "A")
          bad_json("'post_processor' single template must hold sequence A once, got " + single->dump().substr(0, 120), fix);
        sequence = true;
        continue;
      }
      const std::string name = piece.is_object() && piece.contains("SpecialToken") ? string_at(piece["SpecialToken"], "id") : "";
      if (name.empty())
        bad_json("'post_processor' template piece " + piece.dump().substr(0, 80) + " is neither a Sequence nor a SpecialToken", fix);
      const json* ids = nullptr;  // special_tokens[name].ids
      if (specials != pp.end() && specials->is_object())
        if (const auto entry = specials->find(name); entry != specials->end() && entry->is_object())
          if (const auto i = entry->find("ids"); i != entry->end() && i->is_array()) ids = &*i;
      if (!ids) bad_json("'post_processor' special token \"" + name + "\" has no 'ids' list in its 'special_tokens'", fix);
      for (const json& id : *ids) (sequence ? after : before).push_back(token_id(id, "special token \"" + name + "\""));
    }
    if (!sequence) bad_json("'post_processor' single template has no sequence A", fix);
  } else {
    bad_json("'post_processor' " + pp.dump().substr(0, 80) +
                 " is not supported (kvx applies TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel and a "
                 "Sequence of them)",
             fix);
  }
  *prefix = std::move(before);  // the only processor that adds tokens (a Sequence refuses two)
  *suffix = std::move(after);
  return true;
}

}  // namespace

// ================================================================ BpeTokenizer

BpeTokenizer::BpeTokenizer() {
  tok_bytes_.resize(256);
  tok_off_.resize(257);
  for (int b = 0; b < 256; ++b) {
    tok_bytes_[b] = char(b);
    tok_off_[b] = uint32_t(b);
    byte_id_[b] = b;
  }
  tok_off_[256] = 256;
  build_tables();
}

int BpeTokenizer::vocab_size() const { return int(tok_off_.size()) - 1; }

std::string BpeTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw Error("token id " + std::to_string(id) + " is out of range [0, " +
                std::to_string(vocab_size()) + "); use ids produced by this tokenizer");
  return tok_bytes_.substr(tok_off_[id], tok_off_[id + 1] - tok_off_[id]);
}

void BpeTokenizer::build_tables() {
  size_t cap = 16;
  while (cap < merges_.size() * 2 + 2) cap <<= 1;
  pair_keys_.assign(cap, ~uint64_t(0));
  pair_vals_.assign(cap, 0);
  pair_mask_ = cap - 1;
  for (size_t r = 0; r < merges_.size(); ++r) {
    uint64_t key = pair_key(merges_[r].first, merges_[r].second);
    size_t h = pair_hash(key) & pair_mask_;
    while (pair_keys_[h] != ~uint64_t(0) && pair_keys_[h] != key) h = (h + 1) & pair_mask_;
    if (pair_keys_[h] == key) continue;  // duplicate merge: the first (lowest rank) wins
    pair_keys_[h] = key;
    pair_vals_[h] = (uint64_t(r) << 32) | uint32_t(merge_result_[r]);
  }
}

inline bool BpeTokenizer::find_pair(int32_t a, int32_t b, uint64_t* val) const {
  const uint64_t key = pair_key(a, b);
  size_t h = pair_hash(key) & pair_mask_;
  for (;;) {
    const uint64_t k = pair_keys_[h];
    if (k == key) {
      *val = pair_vals_[h];
      return true;
    }
    if (k == ~uint64_t(0)) return false;
    h = (h + 1) & pair_mask_;
  }
}

// Applies merges to one pre-token: always the lowest-rank pair, leftmost first
// (same result as HF's BPE word merge).
void BpeTokenizer::bpe_word(std::string_view word, std::vector<int32_t>* out) const {
  if (ignore_merges_) {
    const auto it = whole_word_.find(std::string(word));
    if (it != whole_word_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const size_t n0 = word.size();
  const auto* w = reinterpret_cast<const uint8_t*>(word.data());
  constexpr size_t kShort = 64;
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  if (n0 <= kShort) {
    int32_t sym[kShort];
    uint32_t rank[kShort];
    int32_t res[kShort];
    size_t n = n0;
    for (size_t i = 0; i < n; ++i) sym[i] = byte_id_[w[i]];
    auto set = [&](size_t i) {
      uint64_t v;
      if (find_pair(sym[i], sym[i + 1], &v)) {
        rank[i] = uint32_t(v >> 32);
        res[i] = int32_t(uint32_t(v));
      } else {
        rank[i] = kNone;
      }
    };
    for (size_t i = 0; i + 1 < n; ++i) set(i);
    while (n > 1) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < n; ++i)
        if (rank[i] < rank[best]) best = i;
      if (rank[best] == kNone) break;
      sym[best] = res[best];
      std::memmove(sym + best + 1, sym + best + 2, (n - best - 2) * sizeof(int32_t));
      if (best + 2 < n) {
        std::memmove(rank + best + 1, rank + best + 2, (n - best - 2) * sizeof(uint32_t));
        std::memmove(res + best + 1, res + best + 2, (n - best - 2) * sizeof(int32_t));
      }
      --n;
      if (best > 0) set(best - 1);
      if (best + 1 < n) set(best);
    }
    out->insert(out->end(), sym, sym + n);
    return;
  }
  // Long word: linked list + min-heap of (rank, position), validated lazily.
  const uint32_t n = uint32_t(n0);
  std::vector<int32_t> sym(n);
  std::vector<uint32_t> prev(n), next(n);
  for (uint32_t i = 0; i < n; ++i) {
    sym[i] = byte_id_[w[i]];
    prev[i] = i - 1;  // wraps to kNone for i == 0
    next[i] = i + 1;  // n means none
  }
  std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<uint64_t>> heap;
  auto push = [&](uint32_t i) {
    uint64_t v;
    if (find_pair(sym[i], sym[next[i]], &v)) heap.push((v >> 32 << 32) | i);
  };
  for (uint32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const uint64_t top = heap.top();
    heap.pop();
    const uint32_t i = uint32_t(top);
    if (sym[i] < 0 || next[i] >= n) continue;
    uint64_t v;
    if (!find_pair(sym[i], sym[next[i]], &v) || (v >> 32) != (top >> 32)) continue;
    const uint32_t j = next[i];
    sym[i] = int32_t(uint32_t(v));
    sym[j] = -1;
    next[i] = next[j];
    if (next[i] < n) prev[next[i]] = i;
    if (prev[i] != kNone) push(prev[i]);
    if (next[i] < n) push(i);
  }
  for (uint32_t i = 0; i < n; i = next[i]) out->push_back(sym[i]);
}

void BpeTokenizer::encode_range(std::string_view text, std::vector<int32_t>* out) const {
  // Per-call cache: pre-token (a view into `text`) -> ids stored in `arena`.
  std::unordered_map<std::string_view, uint64_t> cache;
  cache.reserve(std::min<size_t>(text.size() / 16 + 16, size_t(1) << 16));
  std::vector<int32_t> arena;
  constexpr size_t kMaxCached = 256;
  constexpr size_t kMaxEntries = size_t(1) << 20;
  constexpr size_t kMaxArena = size_t(1) << 24;
  const auto word = [&](size_t b, size_t e) {
    if (e - b == 1) {
      out->push_back(byte_id_[uint8_t(text[b])]);
      return;
    }
    std::string_view w = text.substr(b, e - b);
    if (w.size() > kMaxCached) {
      bpe_word(w, out);
      return;
    }
    auto it = cache.find(w);
    if (it != cache.end()) {
      const int32_t* ids = arena.data() + (it->second >> 32);
      out->insert(out->end(), ids, ids + uint32_t(it->second));
      return;
    }
    if (cache.size() >= kMaxEntries || arena.size() >= kMaxArena) {
      cache.clear();
      arena.clear();
    }
    const size_t off = arena.size();
    bpe_word(w, &arena);
    const size_t len = arena.size() - off;
    cache.emplace(w, (uint64_t(off) << 32) | len);
    out->insert(out->end(), arena.begin() + off, arena.end());
  };
  if (split_digits_ == 0)
    for_each_pretoken(text, word);
  else
    for_each_pretoken_gpt4(text, split_digits_, word);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view bytes) const { return encode(bytes, 0); }

std::string BpeTokenizer::nfc(std::string_view bytes) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* nfc = unorm2_getNFCInstance(&status);
  if (U_FAILURE(status)) throw Error(std::string("ICU NFC normaliser unavailable: ") + u_errorName(status));
  std::string out;
  out.reserve(bytes.size());
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const auto* e = p + bytes.size();
  std::vector<UChar> in16, out16;
  while (p < e) {
    // A maximal valid UTF-8 run; ASCII needs no work.
    const uint8_t* q = p;
    bool ascii = true;
    while (q < e) {
      if (*q < 0x80) {
        ++q;
        continue;
      }
      uint32_t cp;
      const int l = decode_utf8(q, e, &cp);
      if (l == 0) break;
      ascii = false;
      q += l;
    }
    if (ascii) {
      out.append(reinterpret_cast<const char*>(p), q - p);
    } else {
      int32_t n16 = 0;
      status = U_ZERO_ERROR;
      in16.resize(static_cast<size_t>(q - p) + 1);
      u_strFromUTF8(in16.data(), int32_t(in16.size()), &n16, reinterpret_cast<const char*>(p), int32_t(q - p), &status);
      out16.resize(static_cast<size_t>(n16) * 3 + 16);
      const int32_t m16 = unorm2_normalize(nfc, in16.data(), n16, out16.data(), int32_t(out16.size()), &status);
      int32_t n8 = 0;
      std::string run(static_cast<size_t>(m16) * 3 + 4, '\0');
      u_strToUTF8(run.data(), int32_t(run.size()), &n8, out16.data(), m16, &status);
      if (U_FAILURE(status)) throw Error(std::string("NFC normalisation failed: ") + u_errorName(status));
      out.append(run.data(), n8);
    }
    p = q;
    if (p < e && *p >= 0x80) {  // an invalid byte: kept as it is
      uint32_t cp;
      if (decode_utf8(p, e, &cp) == 0) out.push_back(char(*p++));
    }
  }
  return out;
}

std::vector<int32_t> BpeTokenizer::encode_with_special_tokens(std::string_view bytes) const {
  std::vector<int32_t> out = special_prefix_;
  const auto text = encode(bytes);
  out.insert(out.end(), text.begin(), text.end());
  out.insert(out.end(), special_suffix_.begin(), special_suffix_.end());
  return out;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view bytes, int num_threads) const {
  if (nfc_) return encode_normalized(nfc(bytes), num_threads);
  return encode_normalized(bytes, num_threads);
}

std::vector<int32_t> BpeTokenizer::encode_normalized(std::string_view bytes, int num_threads) const {
  if (added_.empty()) return encode_plain(bytes, num_threads);
  // Cut at the added tokens (leftmost, then longest: added_ is sorted longest first), BPE between.
  std::vector<int32_t> out;
  size_t start = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (!added_first_byte_[uint8_t(bytes[i])]) continue;
    for (const auto& a : added_) {
      if (bytes.compare(i, a.content.size(), a.content) != 0) continue;
      const auto part = encode_plain(bytes.substr(start, i - start), num_threads);
      out.insert(out.end(), part.begin(), part.end());
      out.push_back(a.id);
      start = i + a.content.size();
      i = start - 1;
      break;
    }
  }
  const auto rest = encode_plain(bytes.substr(start), num_threads);
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

std::vector<int32_t> BpeTokenizer::encode_plain(std::string_view bytes, int num_threads) const {
  if (bytes.empty()) return {};
  constexpr size_t kMinChunk = size_t(2) << 20;
  if (num_threads <= 0) {
    num_threads = int(std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()),
                                       bytes.size() / kMinChunk));
    num_threads = std::min(num_threads, 16);
  }
  std::vector<int32_t> out;
  if (num_threads <= 1 || bytes.size() < 2 * 1024) {
    out.reserve(bytes.size() / 3 + 16);
    encode_range(bytes, &out);
    return out;
  }
  // Split where the pattern always has a boundary: after "X\n" with X and the
  // next byte ASCII non-space, the "\n" is its own pre-token in both halves.
  auto safe = [&](size_t i) {
    auto ok = [](uint8_t c) { return c < 0x80 && kAscii.cls[c] != kSpace; };
    return i >= 2 && i < bytes.size() && bytes[i - 1] == '\n' && ok(uint8_t(bytes[i - 2])) &&
           ok(uint8_t(bytes[i]));
  };
  std::vector<size_t> cuts{0};
  for (int t = 1; t < num_threads; ++t) {
    size_t i = std::max(cuts.back() + 1, bytes.size() * size_t(t) / size_t(num_threads));
    const size_t limit = std::min(bytes.size(), i + bytes.size() / size_t(num_threads) / 2);
    while (i < limit && !safe(i)) ++i;
    if (i < limit) cuts.push_back(i);
  }
  cuts.push_back(bytes.size());
  const size_t parts = cuts.size() - 1;
  std::vector<std::vector<int32_t>> res(parts);
  std::vector<std::thread> threads;
  for (size_t t = 1; t < parts; ++t)
    threads.emplace_back([&, t] {
      res[t].reserve((cuts[t + 1] - cuts[t]) / 3 + 16);
      encode_range(bytes.substr(cuts[t], cuts[t + 1] - cuts[t]), &res[t]);
    });
  res[0].reserve(cuts[1] / 3 + 16);
  encode_range(bytes.substr(0, cuts[1]), &res[0]);
  for (auto& th : threads) th.join();
  size_t total = 0;
  for (auto& r : res) total += r.size();
  out = std::move(res[0]);
  out.reserve(total);
  for (size_t t = 1; t < parts; ++t) out.insert(out.end(), res[t].begin(), res[t].end());
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  return decode(ids.data(), ids.size());
}

std::string BpeTokenizer::decode(const int32_t* ids, size_t n) const {
  std::string out;
  out.reserve(n * 4);
  const uint32_t v = uint32_t(vocab_size());
  for (size_t i = 0; i < n; ++i) {
    const uint32_t id = uint32_t(ids[i]);
    if (id >= v)
      throw Error("decode: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                  " is out of range [0, " + std::to_string(v) +
                  "); decode with the tokenizer that produced the ids");
    out.append(tok_bytes_.data() + tok_off_[id], tok_off_[id + 1] - tok_off_[id]);
  }
  return out;
}

std::vector<std::string_view> BpeTokenizer::pretokenize(std::string_view text) {
  std::vector<std::string_view> out;
  for_each_pretoken(text, [&](size_t b, size_t e) { out.push_back(text.substr(b, e - b)); });
  return out;
}

std::vector<std::string_view> BpeTokenizer::pre_tokens(std::string_view text) const {
  if (split_digits_ == 0) return pretokenize(text);
  std::vector<std::string_view> out;
  for_each_pretoken_gpt4(text, split_digits_, [&](size_t b, size_t e) { out.push_back(text.substr(b, e - b)); });
  return out;
}

std::string BpeTokenizer::split_pattern() const {
  return split_digits_ == 0 ? "gpt2" : split_digits_ == 3 ? "llama3" : "qwen2";
}

std::string BpeTokenizer::bytes_to_unicode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) append_utf8(kByteUnicode.cp[c], &out);
  return out;
}

bool BpeTokenizer::unicode_to_bytes(std::string_view text, std::string* out) {
  out->clear();
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const auto* e = p + text.size();
  while (p < e) {
    uint32_t cp;
    int l = 1;
    if (*p < 0x80) cp = *p;
    else if ((l = decode_utf8(p, e, &cp)) == 0) return false;
    if (cp >= 512 || kByteUnicode.inv[cp] < 0) return false;
    out->push_back(char(kByteUnicode.inv[cp]));
    p += l;
  }
  return true;
}

// ==================================================================== training

namespace {

struct HeapEntry {
  int64_t count;
  uint64_t key;
  // Max-heap on count; ties: the smallest (left id, right id) pair first.
  bool operator<(const HeapEntry& o) const {
    return count != o.count ? count < o.count : key > o.key;
  }
};

}  // namespace

BpeTokenizer BpeTokenizer::train(std::string_view corpus, const BpeTrainOptions& opt) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int64_t min_freq = std::max(1, opt.min_frequency);
  const size_t target = size_t(std::max(256, opt.vocab_size));

  // 1. Unique pre-tokens with counts.
  std::unordered_map<std::string_view, int64_t> word_counts;
  word_counts.reserve(1 << 16);
  for_each_pretoken(corpus, [&](size_t b, size_t e) { ++word_counts[corpus.substr(b, e - b)]; });
  std::vector<std::pair<std::string_view, int64_t>> sorted(word_counts.begin(), word_counts.end());
  std::sort(sorted.begin(), sorted.end());  // fixed word order, independent of hashing
  word_counts = {};

  std::vector<std::vector<int32_t>> words(sorted.size());
  std::vector<int64_t> freq(sorted.size());
  for (size_t w = 0; w < sorted.size(); ++w) {
    words[w].assign(reinterpret_cast<const uint8_t*>(sorted[w].first.data()),
                    reinterpret_cast<const uint8_t*>(sorted[w].first.data()) + sorted[w].first.size());
    freq[w] = sorted[w].second;
  }
  sorted = {};

  // 2. Pair counts and pair -> words index.
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;
  for (size_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w];
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t k = pair_key(s[i], s[i + 1]);
      pair_count[k] += freq[w];
      auto& v = where[k];
      if (v.empty() || v.back() != int32_t(w)) v.push_back(int32_t(w));
    }
  }
  std::vector<HeapEntry> init;
  init.reserve(pair_count.size());
  for (auto& [k, c] : pair_count) init.push_back({c, k});
  std::priority_queue<HeapEntry> heap(std::less<HeapEntry>(), std::move(init));

  if (opt.verbose)
    std::fprintf(stderr, "bpe train: %zu bytes, %zu unique words, %zu pairs (%.2fs)\n",
                 corpus.size(), words.size(), pair_count.size(),
                 std::chrono::duration<double>(Clock::now() - t0).count());

  // 3. Greedy merges with incremental pair-count updates.
  std::vector<std::string> tok(256);
  std::unordered_map<std::string, int32_t> tok_id;
  for (int b = 0; b < 256; ++b) {
    tok[b] = std::string(1, char(b));
    tok_id[tok[b]] = b;
  }
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<int32_t> results;
  std::vector<int32_t> stamp(words.size(), -1);
  std::vector<uint64_t> touched;

  while (tok.size() < target && !heap.empty()) {
    const HeapEntry top = heap.top();
    heap.pop();
    auto pit = pair_count.find(top.key);
    if (pit == pair_count.end() || pit->second != top.count) continue;  // stale
    if (top.count < min_freq) break;
    const int32_t a = int32_t(top.key >> 32), b = int32_t(uint32_t(top.key));
    std::string nb = tok[a] + tok[b];
    int32_t x;
    auto tit = tok_id.find(nb);
    if (tit != tok_id.end()) {
      x = tit->second;  // same bytes as an existing token (HF reuses the id too)
    } else {
      x = int32_t(tok.size());
      tok_id.emplace(nb, x);
      tok.push_back(std::move(nb));
    }
    const int32_t m = int32_t(merges.size());
    merges.emplace_back(a, b);
    results.push_back(x);
    pair_count.erase(pit);
    std::vector<int32_t> wl = std::move(where[top.key]);
    where.erase(top.key);

    touched.clear();
    int32_t cur_w = 0;
    int64_t c = 0;
    auto add = [&](int32_t l, int32_t r, int64_t d) {
      const uint64_t k = pair_key(l, r);
      if (k == top.key) return;
      pair_count[k] += d;
      touched.push_back(k);
      if (d > 0) {
        auto& v = where[k];
        if (v.empty() || v.back() != cur_w) v.push_back(cur_w);
      }
    };
    for (int32_t w : wl) {
      if (stamp[w] == m) continue;
      stamp[w] = m;
      cur_w = w;
      c = freq[w];
      auto& s = words[w];
      const size_t n = s.size();
      size_t j = 0;
      for (size_t i = 0; i < n;) {
        if (i + 1 < n && s[i] == a && s[i + 1] == b) {
          if (j > 0) {
            add(s[j - 1], a, -c);
            add(s[j - 1], x, c);
          }
          if (i + 2 < n) {
            add(b, s[i + 2], -c);
            add(x, s[i + 2], c);
          }
          s[j++] = x;
          i += 2;
        } else {
          s[j++] = s[i++];
        }
      }
      s.resize(j);
    }
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (uint64_t k : touched) {
      auto it = pair_count.find(k);
      if (it == pair_count.end()) continue;
      if (it->second <= 0) {
        pair_count.erase(it);
        where.erase(k);
      } else {
        heap.push({it->second, k});
      }
    }
    if (opt.verbose && (merges.size() % 500 == 0))
      std::fprintf(stderr, "bpe train: %zu merges, vocab %zu, last count %lld (%.2fs)\n",
                   merges.size(), tok.size(), (long long)top.count,
                   std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (opt.verbose)
    std::fprintf(stderr, "bpe train: done, %zu merges, vocab %zu (%.2fs)\n", merges.size(), tok.size(),
                 std::chrono::duration<double>(Clock::now() - t0).count());

  BpeTokenizer t;
  t.tok_bytes_.clear();
  t.tok_off_.assign(1, 0);
  for (const auto& s : tok) {
    t.tok_bytes_ += s;
    t.tok_off_.push_back(uint32_t(t.tok_bytes_.size()));
  }
  t.merges_ = std::move(merges);
  t.merge_result_ = std::move(results);
  t.build_tables();
  return t;
}

// ======================================================================== JSON

std::string BpeTokenizer::to_json() const {
  using ojson = nlohmann::ordered_json;
  ojson vocab = ojson::object();
  std::vector<char> added_only(vocab_size(), 0);
  ojson added = ojson::array();
  for (const auto& a : added_) {
    added_only[a.id] = !a.in_vocab;
    added.push_back({{"id", a.id}, {"content", a.content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", a.special}});
  }
  std::sort(added.begin(), added.end(), [](const ojson& x, const ojson& y) { return x["id"] < y["id"]; });
  for (int32_t i = 0; i < vocab_size(); ++i)
    if (!added_only[i]) vocab[bytes_to_unicode(token_bytes(i))] = i;
  ojson merges = ojson::array();
  for (const auto& [a, b] : merges_)
    merges.push_back(bytes_to_unicode(token_bytes(a)) + " " + bytes_to_unicode(token_bytes(b)));
  ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                      {"trim_offsets", true}, {"use_regex", true}};
  ojson decoder = {{"type", "ByteLevel"}, {"add_prefix_space", true},
                   {"trim_offsets", true}, {"use_regex", true}};
  ojson model = {{"type", "BPE"},
                 {"dropout", nullptr},
                 {"unk_token", nullptr},
                 {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr},
                 {"fuse_unk", false},
                 {"byte_fallback", false},
                 {"ignore_merges", ignore_merges_},
                 {"vocab", std::move(vocab)},
                 {"merges", std::move(merges)}};
  if (split_digits_ != 0) {  // Split(regex) then ByteLevel without its own regex, as Llama 3 / Qwen2 ship it
    byte_level["use_regex"] = false;
    byte_level["trim_offsets"] = false;
    byte_level = {{"type", "Sequence"},
                  {"pretokenizers",
                   {{{"type", "Split"},
                     {"pattern", {{"Regex", split_digits_ == 3 ? kLlama3Regex : kQwen2Regex}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    byte_level}}};
  }
  ojson j = {{"version", "1.0"},
             {"truncation", nullptr},
             {"padding", nullptr},
             {"added_tokens", std::move(added)},
             {"normalizer", nfc_ ? ojson{{"type", "NFC"}} : ojson(nullptr)},
             {"pre_tokenizer", std::move(byte_level)},
             {"post_processor", post_processor_.empty() ? ojson(nullptr) : ojson::parse(post_processor_)},
             {"decoder", std::move(decoder)},
             {"model", std::move(model)}};
  return j.dump(2);
}

BpeTokenizer BpeTokenizer::from_json(const std::string& json_text) {
  using json = nlohmann::json;
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    bad_json(std::string("not valid JSON (") + e.what() +
             "); the file may be truncated or corrupt",
             OrRetrain("restore it from a good copy"));
  }
  try {
    return from_parsed_json(&j);
  } catch (const json::exception& e) {
    bad_json(std::string("unexpected structure (") + e.what() + ")");
  }
}

BpeTokenizer BpeTokenizer::from_parsed_json(const void* jp) {
  using json = nlohmann::json;
  const json& j = *static_cast<const json*>(jp);
  if (!j.is_object()) bad_json("top level is not a JSON object");

  auto is_set = [](const json& o, const char* key) {
    return o.contains(key) && !o[key].is_null();
  };
  bool nfc = false;
  if (is_set(j, "normalizer")) {
    const json& n = j["normalizer"];
    if (!n.is_object() || n.value("type", "") != "NFC")
      bad_json("'normalizer' " + n.dump().substr(0, 80) + " is not supported (kvx implements NFC only)", OrRetrain("remove it"));
    nfc = true;
  }
  int split_digits = 0;
  const std::string post_processor = is_set(j, "post_processor") ? j["post_processor"].dump() : "";
  if (is_set(j, "pre_tokenizer")) {
    const json* pt = &j["pre_tokenizer"];
    json byte_level;        // the ByteLevel step of a Sequence
    bool own_regex = true;  // ByteLevel splits with GPT-2's pattern itself
    if (pt->is_object() && pt->value("type", "") == "Sequence") {
      // Split(pattern, Isolated) then ByteLevel(use_regex false): Llama 3, Qwen2/3, or GPT-2's pattern spelled out.
      const json seq = pt->value("pretokenizers", json::array());
      if (!seq.is_array() || seq.size() != 2 || !seq[0].is_object() || seq[0].value("type", "") != "Split")
        bad_json("'pre_tokenizer' Sequence must be [Split, ByteLevel], got " + pt->dump().substr(0, 120));
      const json& split = seq[0];
      if (split.value("behavior", "") != "Isolated" || split.value("invert", false))
        bad_json("'pre_tokenizer' Split must be behavior Isolated, invert false");
      const std::string regex = split.contains("pattern") && split["pattern"].is_object()
                                    ? split["pattern"].value("Regex", "")
                                    : std::string();
      if (regex == kLlama3Regex) split_digits = 3;
      else if (regex == kQwen2Regex) split_digits = 1;
      else if (regex != kGpt2Regex)
        bad_json("'pre_tokenizer' Split pattern " + json(regex).dump().substr(0, 160) +
                 " is not one kvx implements (GPT-2's, Llama 3's, Qwen2's)");
      byte_level = seq[1];
      pt = &byte_level;
      own_regex = false;
    }
    if (!pt->is_object() || pt->value("type", "") != "ByteLevel")
      bad_json("'pre_tokenizer' must be ByteLevel (GPT-2 split) or Sequence[Split, ByteLevel], got " + pt->dump().substr(0, 80),
               OrRetrain("use a GPT-2 style tokenizer"));
    if (pt->value("add_prefix_space", false))
      bad_json("'pre_tokenizer.add_prefix_space' = true is not supported", OrRetrain("set it to false"));
    if (pt->value("use_regex", true) != own_regex)
      bad_json(own_regex ? "'pre_tokenizer.use_regex' = false is not supported (nothing would split the text)"
                         : "a ByteLevel pre-tokenizer after a Split must have use_regex = false");
  }
  if (!j.contains("model") || !j["model"].is_object()) bad_json("missing 'model' object");
  const json& model = j["model"];
  if (!model.contains("type") || !model["type"].is_string())
    bad_json("'model.type' is missing (expected \"BPE\")");
  if (model["type"].get<std::string>() != "BPE")
    bad_json("'model.type' is \"" + model["type"].get<std::string>() +
             "\" but only \"BPE\" models are supported");
  if (is_set(model, "dropout") && !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    bad_json("'model.dropout' is set but BPE dropout is not supported", OrRetrain("set it to null"));
  if (model.value("byte_fallback", false)) bad_json("'model.byte_fallback' = true is not supported");
  if (is_set(model, "ignore_merges") && !model["ignore_merges"].is_boolean())
    bad_json("'model.ignore_merges' must be true or false");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (is_set(model, k) && !(model[k].is_string() && model[k].get<std::string>().empty()))
      bad_json(std::string("'model.") + k + "' is set; word prefixes/suffixes are not supported");

  if (!model.contains("vocab") || !model["vocab"].is_object()) bad_json("'model.vocab' is missing or not an object");
  const json& vocab = model["vocab"];
  const size_t n = vocab.size();
  if (n > (size_t(1) << 30)) bad_json("'model.vocab' is too large");
  std::vector<std::string> tokens(n);
  std::vector<char> seen(n, 0);
  std::unordered_map<std::string, int32_t> key_id;
  key_id.reserve(n * 2);
  BpeTokenizer t;
  std::fill(std::begin(t.byte_id_), std::end(t.byte_id_), -1);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const std::string& key = it.key();
    if (!it.value().is_number_integer())
      bad_json("'model.vocab' entry \"" + key + "\" has a non-integer id");
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || uint64_t(id) >= n)
      bad_json("'model.vocab' entry \"" + key + "\" has id " + std::to_string(id) +
               ", but ids must be dense 0.." + std::to_string(n - 1));
    if (seen[id]) bad_json("'model.vocab' id " + std::to_string(id) + " is used twice (ids must be dense and unique)");
    seen[id] = 1;
    std::string bytes;
    if (!unicode_to_bytes(key, &bytes) || bytes.empty())
      bad_json("'model.vocab' entry \"" + key +
               "\" is not a byte-level token (characters outside GPT-2's bytes_to_unicode alphabet)");
    if (bytes.size() == 1) t.byte_id_[uint8_t(bytes[0])] = int32_t(id);
    tokens[id] = std::move(bytes);
    key_id.emplace(key, int32_t(id));
  }
  for (int b = 0; b < 256; ++b)
    if (t.byte_id_[b] < 0)
      bad_json("'model.vocab' lacks the single-byte token for byte " + std::to_string(b) + " (\"" +
               bytes_to_unicode(std::string(1, char(b))) + "\"); all 256 bytes must be present");
  t.ignore_merges_ = is_set(model, "ignore_merges") && model["ignore_merges"].get<bool>();
  if (t.ignore_merges_)
    for (size_t id = 0; id < n; ++id) t.whole_word_.emplace(tokens[id], int32_t(id));

  if (!model.contains("merges") || !model["merges"].is_array()) bad_json("'model.merges' is missing or not an array");
  const json& merges = model["merges"];
  t.merges_.clear();
  t.merge_result_.clear();
  t.merges_.reserve(merges.size());
  t.merge_result_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    std::string l, r;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        bad_json("'model.merges' entry " + std::to_string(i) + " (\"" + s + "\") is not of the form \"a b\"");
      }
      l = s.substr(0, sp);
      r = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      l = m[0].get<std::string>();
      r = m[1].get<std::string>();
    } else {
      bad_json("'model.merges' entry " + std::to_string(i) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto il = key_id.find(l), ir = key_id.find(r), ix = key_id.find(l + r);
    if (il == key_id.end() || ir == key_id.end() || ix == key_id.end())
      bad_json("'model.merges' entry " + std::to_string(i) + " (\"" + l + " " + r +
               "\") is not a pair of known tokens whose concatenation is in the vocab");
    t.merges_.emplace_back(il->second, ir->second);
    t.merge_result_.push_back(ix->second);
  }

  if (is_set(j, "added_tokens")) {
    const json& added = j["added_tokens"];
    if (!added.is_array()) bad_json("'added_tokens' is not an array");
    for (size_t i = 0; i < added.size(); ++i) {
      const json& a = added[i];
      const std::string where = "'added_tokens' entry " + std::to_string(i);
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
          !a["content"].is_string())
        bad_json(where + " needs an integer id and a string content");
      for (const char* flag : {"single_word", "lstrip", "rstrip"})
        if (a.value(flag, false)) bad_json(where + " sets " + flag + ", which kvx does not support");
      AddedToken tok;
      const int64_t id = a["id"].get<int64_t>();
      tok.content = a["content"].get<std::string>();
      tok.special = a.value("special", false);
      if (tok.content.empty()) bad_json(where + " has empty content");
      // dense ids: an added id past the vocabulary and the added tokens (1e9) made a huge allocation
      if (id < 0 || id >= static_cast<int64_t>(n + added.size()))
        bad_json(where + " has id " + std::to_string(id) + "; ids must be dense, below the " +
                 std::to_string(n + added.size()) + " tokens of the vocabulary and added_tokens");
      tok.id = int32_t(id);
      if (size_t(id) < n) {
        if (tokens[id] != tok.content)
          bad_json(where + " (\"" + tok.content + "\") reuses vocab id " + std::to_string(id) + " of another token");
        tok.in_vocab = true;
      } else {
        if (size_t(id) >= tokens.size()) tokens.resize(id + 1), seen.resize(id + 1, 0);
        if (seen[id]) bad_json(where + " reuses id " + std::to_string(id));
        seen[id] = 1;
        tokens[id] = tok.content;
      }
      for (const auto& other : t.added_)
        if (other.content == tok.content) bad_json(where + " repeats the content \"" + tok.content + "\"");
      t.added_.push_back(tok);
    }
    for (size_t id = n; id < tokens.size(); ++id)
      if (!seen[id]) bad_json("ids must be dense: " + std::to_string(id) + " is neither in 'model.vocab' nor in 'added_tokens'");
    std::stable_sort(t.added_.begin(), t.added_.end(),
                     [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
    for (const auto& a : t.added_) t.added_first_byte_[uint8_t(a.content[0])] = true;
  }

  t.split_digits_ = split_digits;
  t.nfc_ = nfc;
  t.post_processor_ = post_processor;
  if (is_set(j, "post_processor")) {
    post_processor_tokens(j["post_processor"], tokens.size(), &t.special_prefix_, &t.special_suffix_);
  }
  t.tok_bytes_.clear();
  t.tok_off_.assign(1, 0);
  for (const auto& s : tokens) {
    t.tok_bytes_ += s;
    t.tok_off_.push_back(uint32_t(t.tok_bytes_.size()));
  }
  t.build_tables();
  return t;
}

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  std::string text = io::read_file(path);
  try {
    return from_json(text);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

void BpeTokenizer::save(const std::string& path) const { io::write_file_atomic(path, to_json()); }

}  // namespace kvx::text
