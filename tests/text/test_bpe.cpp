#include "text/bpe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "util/error.h"

using kvx::text::BpeTokenizer;
using kvx::text::BpeTrainOptions;

namespace {

// Deterministic English-like corpus with some UTF-8, digits and odd spacing.
std::string synthetic_corpus(size_t n_words, uint32_t seed) {
  static const char* kSyl[] = {"th", "e", "an", "in", "er", "on", "re", "at", "st", "ing",
                               "qu", "ou", "al", "ed", "is", "or", "ké", "ñó", "ж", "中"};
  static const char* kSep[] = {" ", " ", " ", " ", ", ", ". ", "\n", "  ", "'s ", "\t", " 42 ", "!\n\n"};
  std::mt19937 rng(seed);
  std::string s;
  for (size_t i = 0; i < n_words; ++i) {
    int k = 1 + int(rng() % 4);
    for (int j = 0; j < k; ++j) s += kSyl[rng() % (sizeof(kSyl) / sizeof(*kSyl))];
    s += kSep[rng() % (sizeof(kSep) / sizeof(*kSep))];
  }
  return s;
}

const BpeTokenizer& trained() {
  static const BpeTokenizer tok = [] {
    BpeTrainOptions o;
    o.vocab_size = 600;
    return BpeTokenizer::train(synthetic_corpus(20000, 7), o);
  }();
  return tok;
}

std::vector<std::string> tricky_strings() {
  std::vector<std::string> v = {
      "",
      std::string(1, '\0'),
      std::string("a\0b\0\0c", 6),
      std::string(1000, ' '),
      "   x   \n\n\t  y  ",
      "\xff\xfe\xc0\xaf\xed\xa0\x80\xf4\x90\x80\x80",  // invalid / overlong / surrogate
      "caf\xc3",                                       // truncated UTF-8 at the end
      "naïve café — 中文 text, don't we'll I'd 123 ²³ \u3000x\u00a0y",
      std::string(300, 'a') + std::string(200, '!'),
  };
  std::mt19937 rng(123);
  for (int i = 0; i < 200; ++i) {
    std::string s(rng() % 200, '\0');
    const int mode = i % 3;
    for (auto& c : s) {
      if (mode == 0) c = char(rng() & 0xFF);                      // any bytes
      else if (mode == 1) c = " \n'asdb\xc3\xa9\x80"[rng() % 10];  // spaces, quotes, partial UTF-8
      else c = char('a' + rng() % 3);                             // long mergeable runs
    }
    v.push_back(s);
  }
  return v;
}

// Naive reference: merge the lowest-rank pair (leftmost) until none applies.
std::vector<int32_t> naive_encode(const BpeTokenizer& t, std::string_view text) {
  std::map<std::pair<int32_t, int32_t>, size_t> rank;
  for (size_t r = t.merges().size(); r-- > 0;) rank[t.merges()[r]] = r;
  std::vector<int32_t> out;
  for (auto w : BpeTokenizer::pretokenize(text)) {
    std::vector<int32_t> s;
    for (unsigned char c : w) s.push_back(t.byte_token(c));
    for (;;) {
      size_t best_i = 0, best_r = SIZE_MAX;
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        auto it = rank.find({s[i], s[i + 1]});
        if (it != rank.end() && it->second < best_r) {
          best_r = it->second;
          best_i = i;
        }
      }
      if (best_r == SIZE_MAX) break;
      s[best_i] = t.merge_result(best_r);
      s.erase(s.begin() + long(best_i) + 1);
    }
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

std::string tmp_path(const std::string& name) { return ::testing::TempDir() + "kvx_bpe_" + name; }

std::string expect_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const kvx::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected kvx::Error, got std::exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected kvx::Error, nothing thrown";
  return "";
}

}  // namespace

TEST(Bpe, DefaultIsByteLevel) {
  BpeTokenizer t;
  EXPECT_EQ(t.vocab_size(), 256);
  EXPECT_EQ(t.encode("ab"), (std::vector<int32_t>{97, 98}));
  EXPECT_EQ(t.encode(std::string_view("a\0", 2)), (std::vector<int32_t>{97, 0}));
  EXPECT_EQ(t.token_bytes(32), " ");
  EXPECT_TRUE(t.encode("").empty());
  EXPECT_EQ(t.decode({}), "");
}

TEST(Bpe, PretokenizeFollowsGpt2Pattern) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(BpeTokenizer::pretokenize("Hello world's  end\n\n x"),
            (V{"Hello", " world", "'s", " ", " end", "\n\n", " x"}));
  EXPECT_EQ(BpeTokenizer::pretokenize("I'm 123abc!! 'Re'll"), (V{"I", "'m", " 123", "abc", "!!", " '", "Re", "'ll"}));
  EXPECT_EQ(BpeTokenizer::pretokenize("a \t"), (V{"a", " \t"}));
  EXPECT_EQ(BpeTokenizer::pretokenize("naïve café 中文 x²"), (V{"naïve", " café", " 中文", " x", "²"}));
  EXPECT_EQ(BpeTokenizer::pretokenize("a\u3000\u3000b"), (V{"a", "\u3000", "\u3000", "b"}));
  EXPECT_EQ(BpeTokenizer::pretokenize("\xff\xfe a"), (V{"\xff\xfe", " a"}));
  EXPECT_TRUE(BpeTokenizer::pretokenize("").empty());
}

TEST(Bpe, RoundTripRandomBytes) {
  BpeTokenizer base;
  for (const auto& s : tricky_strings()) {
    EXPECT_EQ(base.decode(base.encode(s)), s);
    EXPECT_EQ(trained().decode(trained().encode(s)), s);
  }
}

TEST(Bpe, RoundTripAfterTraining) {
  const auto& t = trained();
  EXPECT_EQ(t.vocab_size(), 600);
  const std::string held_out = synthetic_corpus(3000, 99);
  EXPECT_EQ(t.decode(t.encode(held_out)), held_out);
  for (int32_t id = 0; id < t.vocab_size(); ++id) EXPECT_FALSE(t.token_bytes(id).empty());
}

TEST(Bpe, MatchesNaiveReference) {
  const auto& t = trained();
  std::vector<std::string> texts = tricky_strings();
  texts.push_back(synthetic_corpus(300, 5));
  texts.push_back(std::string(150, 'e') + " " + std::string(70, ' ') + "thththththeeeeerererer" +
                  std::string(100, 't') + std::string(100, 'h'));
  for (const auto& s : texts) EXPECT_EQ(t.encode(s), naive_encode(t, s)) << s.substr(0, 60);
}

TEST(Bpe, MergesCompress) {
  const std::string text = synthetic_corpus(20000, 7);
  const auto ids = trained().encode(text);
  EXPECT_LT(ids.size() * 2, text.size());
}

TEST(Bpe, TrainingIsDeterministic) {
  BpeTrainOptions o;
  o.vocab_size = 400;
  const std::string corpus = synthetic_corpus(5000, 3);
  const auto a = BpeTokenizer::train(corpus, o);
  const auto b = BpeTokenizer::train(corpus, o);
  EXPECT_EQ(a.to_json(), b.to_json());
}

TEST(Bpe, HandCheckedTinyCase) {
  // One pre-token "aaabdaaabac": pairs aa:4 ab:2 ... -> merge (a,a)=256;
  // then (a,b) and (aa,a) tie at 2 -> smaller pair (a,b)=257; then (aa,ab)=258.
  BpeTrainOptions o;
  o.vocab_size = 1000;
  o.min_frequency = 2;
  const auto t = BpeTokenizer::train("aaabdaaabac", o);
  ASSERT_EQ(t.vocab_size(), 259);
  ASSERT_EQ(t.merges().size(), 3u);
  EXPECT_EQ(t.merges()[0], std::make_pair(97, 97));
  EXPECT_EQ(t.merges()[1], std::make_pair(97, 98));
  EXPECT_EQ(t.merges()[2], std::make_pair(256, 257));
  EXPECT_EQ(t.token_bytes(258), "aaab");
  EXPECT_EQ(t.encode("aaabdaaabac"), (std::vector<int32_t>{258, 100, 258, 97, 99}));
  EXPECT_EQ(t.encode("aa aab"), (std::vector<int32_t>{256, 32, 256, 98}));
  // Pairs never span pre-token boundaries: "a1a1..." is all 1-byte pre-tokens.
  EXPECT_EQ(BpeTokenizer::train("a1a1a1a1a1a1", o).vocab_size(), 256);

  o.vocab_size = 257;  // vocab limit stops after one merge
  EXPECT_EQ(BpeTokenizer::train("aaabdaaabac", o).vocab_size(), 257);
  o.vocab_size = 1000;
  o.min_frequency = 5;  // nothing occurs 5 times
  EXPECT_EQ(BpeTokenizer::train("aaabdaaabac", o).vocab_size(), 256);
}

TEST(Bpe, SaveLoadGivesIdenticalEncodings) {
  const std::string path = tmp_path("saveload.json");
  trained().save(path);
  std::ifstream tmp(path + ".tmp");
  EXPECT_FALSE(tmp.good()) << "temporary file left behind";
  const auto t = BpeTokenizer::load(path);
  EXPECT_EQ(t.vocab_size(), trained().vocab_size());
  EXPECT_EQ(t.to_json(), trained().to_json());
  for (const auto& s : tricky_strings()) EXPECT_EQ(t.encode(s), trained().encode(s));
  const std::string text = synthetic_corpus(2000, 11);
  EXPECT_EQ(t.encode(text), trained().encode(text));
  std::remove(path.c_str());
}

TEST(Bpe, JsonFormat) {
  const auto j = nlohmann::json::parse(trained().to_json());
  EXPECT_EQ(j["version"], "1.0");
  EXPECT_TRUE(j["added_tokens"].is_array());
  EXPECT_TRUE(j["normalizer"].is_null());
  EXPECT_EQ(j["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(j["pre_tokenizer"]["add_prefix_space"], false);
  EXPECT_EQ(j["decoder"]["type"], "ByteLevel");
  const auto& m = j["model"];
  EXPECT_EQ(m["type"], "BPE");
  EXPECT_TRUE(m["dropout"].is_null());
  EXPECT_EQ(m["byte_fallback"], false);
  EXPECT_EQ(m["vocab"].size(), 600u);
  EXPECT_EQ(m["vocab"]["Ġ"], 32);   // byte 0x20
  EXPECT_EQ(m["vocab"]["Ċ"], 10);   // byte 0x0A
  EXPECT_EQ(m["vocab"]["a"], 97);
  EXPECT_EQ(m["vocab"]["Ā"], 0);    // byte 0x00
  EXPECT_EQ(m["merges"].size(), trained().merges().size());
  const std::string first = m["merges"][0];
  EXPECT_EQ(std::count(first.begin(), first.end(), ' '), 1);

  // The newer ["a", "b"] merge form loads to the same tokenizer.
  auto j2 = j;
  for (auto& e : j2["model"]["merges"]) {
    const std::string s = e;
    e = nlohmann::json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  const auto t2 = BpeTokenizer::from_json(j2.dump());
  EXPECT_EQ(t2.to_json(), trained().to_json());

  // GPT-2 style id order (ids not equal to byte values) is accepted.
  auto j3 = nlohmann::json::parse(BpeTokenizer().to_json());
  auto& v3 = j3["model"]["vocab"];
  v3["Ġ"] = 0;
  v3["Ā"] = 32;
  const auto t3 = BpeTokenizer::from_json(j3.dump());
  EXPECT_EQ(t3.encode(std::string_view(" \0", 2)), (std::vector<int32_t>{0, 32}));
  EXPECT_EQ(t3.decode({0, 32}), std::string(" \0", 2));
  EXPECT_EQ(BpeTokenizer::bytes_to_unicode(" \n!"), "ĠĊ!");
}

// Llama 3's ignore_merges: a pre-token that is a vocabulary entry is that entry, even where the
// merges would split it otherwise (HF's BPE looks the whole word up first).
TEST(Bpe, IgnoreMergesTakesWholeVocabularyWordsFirst) {
  auto j = nlohmann::json::parse(BpeTokenizer().to_json());
  auto& m = j["model"];
  m["vocab"]["ab"] = 256;
  m["vocab"]["abc"] = 257;  // in the vocabulary, but no merge makes it from "ab" + "c"
  m["merges"] = {"a b"};
  const auto merged = BpeTokenizer::from_json(j.dump());
  EXPECT_EQ(merged.encode("abc"), (std::vector<int32_t>{256, 'c'}));
  m["ignore_merges"] = true;
  const auto whole = BpeTokenizer::from_json(j.dump());
  EXPECT_EQ(whole.encode("abc"), (std::vector<int32_t>{257}));
  EXPECT_EQ(whole.encode("abcab"), (std::vector<int32_t>{256, 'c', 256}));  // not a vocabulary word: merged as usual
  EXPECT_EQ(whole.encode("ab abc"), (std::vector<int32_t>{256, ' ', 256, 'c'}));  // " abc" is not "abc"
  EXPECT_EQ(BpeTokenizer::from_json(whole.to_json()).encode("abc"), (std::vector<int32_t>{257}));  // kept on save
  m["ignore_merges"] = "yes";
  EXPECT_THROW(BpeTokenizer::from_json(j.dump()), kvx::Error);
  m["ignore_merges"] = nullptr;  // null: not set (was nlohmann's type error)
  EXPECT_EQ(BpeTokenizer::from_json(j.dump()).encode("abc"), (std::vector<int32_t>{256, 'c'}));
}

// tokenizer.json's post_processor: encode is HF's add_special_tokens=False, and
// encode_with_special_tokens (what prompts get) adds its tokens around one sequence; kept on save.
TEST(Bpe, PostProcessorWrapsOneSequenceWithItsSpecialTokens) {
  auto j = nlohmann::json::parse(BpeTokenizer().to_json());
  j["added_tokens"] = {{{"id", 256}, {"content", "<|begin_of_text|>"}, {"special", true}},
                       {{"id", 257}, {"content", "<|end|>"}, {"special", true}}};
  // Llama 3's: a Sequence of ByteLevel (offsets only) and a template with the BOS before sequence A.
  const nlohmann::json llama3 = {
      {"type", "Sequence"},
      {"processors",
       {{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}},
        {{"type", "TemplateProcessing"},
         {"single", {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
         {"pair", nlohmann::json::array()},
         {"special_tokens", {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {256}}, {"tokens", {"<|begin_of_text|>"}}}}}}}}}};
  j["post_processor"] = llama3;
  const auto t = BpeTokenizer::from_json(j.dump());
  EXPECT_EQ(t.encode("hi"), (std::vector<int32_t>{'h', 'i'}));
  EXPECT_EQ(t.encode_with_special_tokens("hi"), (std::vector<int32_t>{256, 'h', 'i'}));
  EXPECT_EQ(t.encode_with_special_tokens(""), (std::vector<int32_t>{256}));
  EXPECT_EQ(nlohmann::json::parse(t.to_json())["post_processor"], llama3);
  EXPECT_EQ(BpeTokenizer::from_json(t.to_json()).encode_with_special_tokens("hi"), (std::vector<int32_t>{256, 'h', 'i'}));
  // RoBERTa's and BERT's: cls before, sep after; a template with a token after A, one with two
  // ids for a token, one with none (HF adds nothing for it).
  j["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<|begin_of_text|>", 256}}, {"sep", {"<|end|>", 257}}};
  EXPECT_EQ(BpeTokenizer::from_json(j.dump()).encode_with_special_tokens("hi"), (std::vector<int32_t>{256, 'h', 'i', 257}));
  j["post_processor"]["type"] = "BertProcessing";
  EXPECT_EQ(BpeTokenizer::from_json(j.dump()).encode_with_special_tokens("hi"), (std::vector<int32_t>{256, 'h', 'i', 257}));
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<bos>"}}}}, {{"Sequence", {{"id", "A"}}}}, {{"SpecialToken", {{"id", "<none>"}}}}}},
                         {"special_tokens", {{"<bos>", {{"ids", {256, 257}}}}, {"<none>", {{"ids", nlohmann::json::array()}}}}}};
  const auto two = BpeTokenizer::from_json(j.dump());
  EXPECT_EQ(two.encode_with_special_tokens("hi"), (std::vector<int32_t>{256, 257, 'h', 'i'}));
  EXPECT_EQ(two.special_prefix(), (std::vector<int32_t>{256, 257}));
  EXPECT_TRUE(two.special_suffix().empty());
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"Sequence", {{"id", "A"}}}}, {{"SpecialToken", {{"id", "<|end|>"}}}}}},
                         {"special_tokens", {{"<|end|>", {{"ids", {257}}}}}}};
  EXPECT_EQ(BpeTokenizer::from_json(j.dump()).encode_with_special_tokens("hi"), (std::vector<int32_t>{'h', 'i', 257}));
  // A tokenizer without one (kvx trains none) adds nothing.
  EXPECT_EQ(BpeTokenizer().encode_with_special_tokens("hi"), BpeTokenizer().encode("hi"));
  // What kvx cannot apply is refused at load, naming the problem.
  auto refused = [&](const nlohmann::json& pp, const std::string& what) {
    j["post_processor"] = pp;
    try {
      BpeTokenizer::from_json(j.dump());
      ADD_FAILURE() << "accepted " << pp.dump();
    } catch (const kvx::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({{"type", "Template"}}, "not supported");
  refused({{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<s>"}}}}}}}, "no 'ids' list");
  // malformed pieces name the piece, not a JSON library error
  refused({{"type", "TemplateProcessing"}, {"single", {{{"Sequence", "A"}}, {{"SpecialToken", "x"}}}}}, "neither a Sequence");
  refused({{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<s>"}}}}}}, {"special_tokens", {{"<s>", 3}}}},
          "no 'ids' list");
  refused({{"type", 3}}, "not supported");
  // two processors that add tokens in one Sequence: HF's second template would see a pair
  const nlohmann::json roberta = {{"type", "RobertaProcessing"}, {"cls", {"<|begin_of_text|>", 256}}, {"sep", {"<|end|>", 257}}};
  refused({{"type", "Sequence"}, {"processors", {roberta, roberta}}}, "processors that add tokens");
  refused({{"type", "TemplateProcessing"},
           {"single", {{{"SpecialToken", {{"id", "<|end|>"}}}}}},
           {"special_tokens", {{"<|end|>", {{"ids", {257}}}}}}},
          "no sequence A");
  refused({{"type", "TemplateProcessing"},
           {"single", {{{"Sequence", {{"id", "A"}}}}, {{"SpecialToken", {{"id", "<|end|>"}}}}}},
           {"special_tokens", {{"<|end|>", {{"ids", {999}}}}}}},
          "outside the vocabulary");
  refused({{"type", "BertProcessing"}, {"cls", {"<s>", "zero"}}, {"sep", {"</s>", 2}}}, "not a token id");
}

TEST(Bpe, BadJsonThrowsUsefulErrors) {
  const std::string good = trained().to_json();
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(good);
    edit(j);
    return j.dump();
  };
  EXPECT_NE(expect_error([] { BpeTokenizer::from_json("this is not json"); }).find("JSON"), std::string::npos);
  EXPECT_NE(expect_error([] { BpeTokenizer::from_json("[1,2]"); }).find("object"), std::string::npos);
  std::string e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["type"] = "WordPiece"; })); });
  EXPECT_NE(e.find("BPE"), std::string::npos) << e;
  EXPECT_NE(e.find("kvx tokenizer train"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["merges"][3] = "Ġ zzzq"; })); });
  EXPECT_NE(e.find("merges"), std::string::npos) << e;
  EXPECT_NE(e.find("entry 3"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["merges"][0] = "abc"; })); });
  EXPECT_NE(e.find("\"a b\""), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["vocab"].erase("Ġ"); })); });
  EXPECT_NE(e.find("dense"), std::string::npos) << e;
  e = expect_error([&] {
    BpeTokenizer::from_json(with([](auto& j) {
      auto& v = j["model"]["vocab"];
      const int id = v["Ġ"];
      v.erase("Ġ");
      v["ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ"] = id;
    }));
  });
  EXPECT_NE(e.find("byte 32"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["vocab"]["a"] = 5; })); });
  EXPECT_NE(e.find("twice"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["vocab"]["a"] = "x"; })); });
  EXPECT_NE(e.find("integer"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"].erase("merges"); })); });
  EXPECT_NE(e.find("merges"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["pre_tokenizer"]["type"] = "Whitespace"; })); });
  EXPECT_NE(e.find("pre_tokenizer"), std::string::npos) << e;
  e = expect_error([&] { BpeTokenizer::from_json(with([](auto& j) { j["model"]["vocab"] = 3; })); });
  EXPECT_NE(e.find("vocab"), std::string::npos) << e;

  // Truncated file on disk.
  const std::string path = tmp_path("truncated.json");
  {
    std::ofstream out(path, std::ios::binary);
    out << good.substr(0, good.size() / 2);
  }
  e = expect_error([&] { BpeTokenizer::load(path); });
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find(path), std::string::npos) << e;
  std::remove(path.c_str());
  e = expect_error([&] { BpeTokenizer::load(tmp_path("does_not_exist.json")); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
}

TEST(Bpe, BadIdsThrow) {
  EXPECT_NE(expect_error([] { trained().decode({1, 600}); }).find("out of range"), std::string::npos);
  EXPECT_NE(expect_error([] { trained().decode({-1}); }).find("out of range"), std::string::npos);
  EXPECT_NE(expect_error([] { trained().token_bytes(9999); }).find("out of range"), std::string::npos);
}

TEST(Bpe, ThreadedEncodeMatchesSingleThread) {
  const std::string text = synthetic_corpus(40000, 21) + "end \n\n  \n" + synthetic_corpus(100, 1);
  const auto one = trained().encode(text, 1);
  for (int threads : {2, 3, 8}) EXPECT_EQ(trained().encode(text, threads), one) << threads;
  EXPECT_EQ(trained().encode(text), one);
}

// Added tokens (tokenizer.json "added_tokens"): matched in the raw text leftmost-longest, never
// split, ids past the BPE vocabulary (as Qwen's), one inside it (as GPT-2's <|endoftext|>);
// saved and loaded back; the options kvx does not implement are refused.
TEST(Bpe, AddedTokensAreMatchedWholeAndRoundTrip) {
  auto j = nlohmann::json::parse(kvx::text::BpeTokenizer().to_json());
  j["model"]["vocab"]["<|endoftext|>"] = 256;  // in the vocab, like GPT-2's
  j["added_tokens"] = {
      {{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}},
      {{"id", 257}, {"content", "<|im_start|>"}, {"special", true}, {"normalized", false}},
      {{"id", 258}, {"content", "<|im_start|>user"}, {"special", false}},
      {{"id", 259}, {"content", "<|im_end|>"}, {"special", true}}};
  const auto t = kvx::text::BpeTokenizer::from_json(j.dump());
  EXPECT_EQ(t.vocab_size(), 260);
  const std::string text = "hi<|im_start|>user x<|im_start|>a<|im_end|><|endoftext|><|im_";
  const auto ids = t.encode(text);
  std::vector<int32_t> want = {'h', 'i', 258, ' ', 'x', 257, 'a', 259, 256, '<', '|', 'i', 'm', '_'};
  EXPECT_EQ(ids, want);
  EXPECT_EQ(t.decode(ids), text);
  EXPECT_EQ(t.encode(""), std::vector<int32_t>{});
  const auto again = kvx::text::BpeTokenizer::from_json(t.to_json());
  EXPECT_EQ(again.encode(text), ids);
  EXPECT_EQ(again.added_tokens().size(), 4u);
  const auto bad = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto k = j;
    edit(k);
    EXPECT_THROW(kvx::text::BpeTokenizer::from_json(k.dump()), kvx::Error) << k["added_tokens"].dump();
  };
  bad([](nlohmann::json& k) { k["added_tokens"][1]["lstrip"] = true; });
  bad([](nlohmann::json& k) { k["added_tokens"][3]["id"] = 261; });               // a hole at 259/260
  bad([](nlohmann::json& k) { k["added_tokens"][1]["content"] = ""; });
  bad([](nlohmann::json& k) { k["added_tokens"][2]["id"] = 257; });               // the same id twice
  bad([](nlohmann::json& k) { k["added_tokens"][0]["content"] = "<|other|>"; });  // not its vocab entry
  bad([](nlohmann::json& k) { k["added_tokens"][3]["id"] = 1000000000; });        // allocated 1e9 tokens first
}

// The Llama 3 / Qwen2 split pattern (a Split pre-tokenizer before ByteLevel), worked out by hand
// from the regex: case-insensitive contractions, one leading non-letter joined to a word, digits
// in runs of at most 3 (Qwen2: 1), punctuation keeping its trailing newlines, whitespace up to
// its last newline.
TEST(Bpe, Llama3AndQwen2SplitPatterns) {
  const std::string llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string qwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const auto with_split = [](const std::string& regex) {
    auto j = nlohmann::json::parse(kvx::text::BpeTokenizer().to_json());
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}};
    return kvx::text::BpeTokenizer::from_json(j.dump());
  };
  const std::string text = "Hello world's (test) 12345 \n\n  foo...\nbar\tbaz  ";
  const auto strs = [](const std::vector<std::string_view>& v) { return std::vector<std::string>(v.begin(), v.end()); };
  const auto t3 = with_split(llama3);
  EXPECT_EQ(t3.split_pattern(), "llama3");
  EXPECT_EQ(strs(t3.pre_tokens(text)),
            (std::vector<std::string>{"Hello", " world", "'s", " (", "test", ")", " ", "123", "45", " \n\n", " ", " foo", "...\n",
                                      "bar", "\tbaz", "  "}));
  EXPECT_EQ(strs(t3.pre_tokens("IT'S \"quoted\"\r\n")), (std::vector<std::string>{"IT", "'S", " \"", "quoted", "\"\r\n"}));
  const auto q2 = with_split(qwen2);
  EXPECT_EQ(q2.split_pattern(), "qwen2");
  EXPECT_EQ(strs(q2.pre_tokens(" 2024!")), (std::vector<std::string>{" ", "2", "0", "2", "4", "!"}));
  // GPT-2's own pattern, for contrast, and spelled out as a Split it is the same.
  EXPECT_EQ(strs(kvx::text::BpeTokenizer::pretokenize(" 2024!")), (std::vector<std::string>{" 2024", "!"}));
  const auto g = with_split(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  EXPECT_EQ(g.split_pattern(), "gpt2");
  // Saved and loaded, the pattern stays; any bytes round-trip.
  const auto back = kvx::text::BpeTokenizer::from_json(q2.to_json());
  EXPECT_EQ(back.split_pattern(), "qwen2");
  const std::string bytes = "Tab\there, caf\xc3\xa9 42\n\n\xff end";
  EXPECT_EQ(back.decode(back.encode(bytes)), bytes);
  size_t joined = 0;
  for (const auto& p : t3.pre_tokens(bytes)) joined += p.size();
  EXPECT_EQ(joined, bytes.size());
  EXPECT_THROW(with_split("\\w+"), kvx::Error);
}

// The NFC normalizer (Qwen2/3): decomposed and composed text encode alike; invalid bytes pass.
TEST(Bpe, NfcNormalizerComposesBeforeEncoding) {
  EXPECT_EQ(kvx::text::BpeTokenizer::nfc("cafe\xcc\x81 \xff ok"), "caf\xc3\xa9 \xff ok");
  EXPECT_EQ(kvx::text::BpeTokenizer::nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(kvx::text::BpeTokenizer::nfc("\xe1\x84\x80\xe1\x85\xa1"), "\xea\xb0\x80");  // Hangul jamo -> syllable
  auto j = nlohmann::json::parse(kvx::text::BpeTokenizer().to_json());
  j["normalizer"] = {{"type", "NFC"}};
  const auto t = kvx::text::BpeTokenizer::from_json(j.dump());
  EXPECT_TRUE(t.normalizes());
  EXPECT_EQ(t.encode("cafe\xcc\x81"), t.encode("caf\xc3\xa9"));
  EXPECT_EQ(t.decode(t.encode("cafe\xcc\x81\xff")), "caf\xc3\xa9\xff");
  EXPECT_TRUE(kvx::text::BpeTokenizer::from_json(t.to_json()).normalizes());
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_THROW(kvx::text::BpeTokenizer::from_json(j.dump()), kvx::Error);
}

// Letters, numbers and spaces of any script come from the Unicode database: Deseret letters and
// mathematical digits (outside the common scripts) classify like ASCII ones do.
TEST(Bpe, CharacterClassesCoverAllOfUnicode) {
  const auto strs = [](const std::vector<std::string_view>& v) { return std::vector<std::string>(v.begin(), v.end()); };
  // U+10400 and U+10428 (Deseret letters) join the word; U+1D7CE (MATHEMATICAL BOLD DIGIT ZERO) is a number.
  EXPECT_EQ(strs(kvx::text::BpeTokenizer::pretokenize("a\xf0\x90\x90\x80\xf0\x90\x90\xa8 x\xf0\x9d\x9f\x8e" "9")),
            (std::vector<std::string>{"a\xf0\x90\x90\x80\xf0\x90\x90\xa8", " x", "\xf0\x9d\x9f\x8e" "9"}));
  // U+3000 (ideographic space) is whitespace (only an ASCII space joins the next word in GPT-2's
  // pattern); U+00B7 (middle dot) is punctuation.
  EXPECT_EQ(strs(kvx::text::BpeTokenizer::pretokenize("a\xe3\x80\x80\xe3\x80\x80" "b\xc2\xb7")),
            (std::vector<std::string>{"a", "\xe3\x80\x80", "\xe3\x80\x80", "b", "\xc2\xb7"}));
}
