#include "kernels/kv_store.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "util/error.h"

namespace kvx::kernels {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kHeadRun = size_t{1} << 20;  // contiguous bytes per head and stream in a large store

// Tiled16 q8/q4 (kv_store.h): code bytes a row; where code byte i of lane t's key sits in its
// group of 16; where slot t's value codes start in its run (byte i then 2 i on: slot pairs).
size_t tiled_code_bytes(KVType type, int d) { return type == KVType::Q4 ? d / 2 : d; }
size_t tiled_key_byte(size_t i, int lane) { return 512 * (i / 32) + 64 * (i % 32 / 4) + 4 * lane + i % 4; }
size_t tiled_value_start(size_t c, int t) { return 2 * c * (t / 2) + t % 2; }
uint8_t tiled_key_flip(KVType type) { return type == KVType::Q8 ? 0x80 : 0; }  // (q8: unsigned)
}

std::string kv_layout_name(KVLayout layout) { return layout == KVLayout::Tiled16 ? "tiled16" : "rows"; }

KVLayout parse_kv_layout(const std::string& name) {
  if (name == "rows") return KVLayout::Rows;
  if (name == "tiled16") return KVLayout::Tiled16;
  throw Error("unknown KV store layout '" + name + "'; valid: rows, tiled16");
}

void KVStore::MemFree::operator()(uint8_t* p) const { std::free(p); }

KVStore::KVStore(KVType type, int kv_heads, int head_dim, Eviction evict, int page_tokens, bool values_are_keys,
                 KVLayout layout)
    : type_(type), kv_heads_(kv_heads), head_dim_(head_dim), evict_(evict), page_tokens_(page_tokens),
      values_are_keys_(values_are_keys), layout_(layout) {
  if (kv_heads < 1) throw Error("KVStore: kv_heads must be >= 1, got " + std::to_string(kv_heads));
  if (page_tokens < 1)
    throw Error("KVStore: page_tokens must be >= 1, got " + std::to_string(page_tokens) + " (default 256)");
  if (evict.sink < 0 || evict.window < 0)
    throw Error("KVStore: eviction sink and window must be >= 0, got sink " + std::to_string(evict.sink) +
                ", window " + std::to_string(evict.window));
  constexpr int64_t kMaxTokens = int64_t{1} << 40;  // past any context; sink + window cannot overflow
  if (evict.sink > kMaxTokens || evict.window > kMaxTokens)
    throw Error("KVStore: eviction sink " + std::to_string(evict.sink) + " / window " + std::to_string(evict.window) +
                " exceeds 2^40 tokens, longer than any context; give the tokens to keep");
  if (evict.sink > 0 && evict.window == 0)
    throw Error("KVStore: eviction sink " + std::to_string(evict.sink) +
                " without a window keeps everything; set window > 0 or sink = 0");
  row_bytes_ = kernels::row_bytes(type, head_dim);  // validates head_dim for the type
  if (layout == KVLayout::Tiled16 && (type == KVType::F32 || page_tokens % 16 != 0 || values_are_keys || head_dim % 2 != 0))
    throw Error("KVStore: layout tiled16 needs a q8, q4 or bf16 store with page_tokens % 16 == 0, an even head_dim and separate "
                "values; got " +
                kv_type_name(type) + ", page_tokens " + std::to_string(page_tokens) + ", head_dim " + std::to_string(head_dim) +
                (values_are_keys ? ", values_are_keys" : "") + " (use layout rows)");
  half_page_bytes_ = static_cast<size_t>(kv_heads) * page_tokens * row_bytes_;
  if (layout == KVLayout::Tiled16) tile_row_.resize(row_bytes_);
}

KVStore::~KVStore() = default;
KVStore::KVStore(KVStore&&) noexcept = default;
KVStore& KVStore::operator=(KVStore&&) noexcept = default;

int64_t KVStore::stored() const {
  return evict_.enabled() ? std::min(length_, evict_.sink + evict_.window) : length_;
}

int64_t KVStore::bytes() const { return stored() * (values_are_keys_ ? 1 : 2) * kv_heads_ * static_cast<int64_t>(row_bytes_); }

int64_t KVStore::reserved_bytes() const { return static_cast<int64_t>(reserved_); }

double KVStore::bytes_per_token() const { return (values_are_keys_ ? 1.0 : 2.0) * kv_heads_ * static_cast<double>(row_bytes_); }

void KVStore::clear() { length_ = 0; }

void KVStore::truncate(int64_t length) {
  if (evict_.enabled()) throw Error("KVStore::truncate: a store with sink + window eviction cannot drop its newest tokens");
  if (length < 0 || length > length_)
    throw Error("KVStore::truncate: length " + std::to_string(length) + " is outside [0, " + std::to_string(length_) + "]");
  length_ = length;
}

int64_t KVStore::slot_of(int64_t position) const {
  if (position < 0 || position >= length_)
    throw Error("KVStore::slot_of: position " + std::to_string(position) + " is outside [0, " +
                std::to_string(length_) + ")");
  if (!evict_.enabled() || position < evict_.sink) return position;
  if (position < length_ - evict_.window) return -1;  // evicted
  return evict_.sink + (position - evict_.sink) % evict_.window;
}

int64_t KVStore::position_of(int64_t slot) const {
  if (slot < 0 || slot >= stored())
    throw Error("KVStore::position_of: slot " + std::to_string(slot) + " is outside [0, " +
                std::to_string(stored()) + ")");
  if (!evict_.enabled() || slot < evict_.sink) return slot;
  const int64_t r = slot - evict_.sink, n = length_ - evict_.sink;  // n > r
  return evict_.sink + r + (n - 1 - r) / evict_.window * evict_.window;
}

KVStore::Page KVStore::new_page() {
  const int streams = values_are_keys_ ? 1 : 2;
  const size_t run_bytes = static_cast<size_t>(page_tokens_) * row_bytes_;  // one head's rows of one page
  const size_t page_bytes = streams * half_page_bytes_;
  if (chunk_pages_left_ == 0) {
    // Small stores get one page at a time; large ones huge-page-backed chunks of at least
    // 2 MiB, growing with the store (at most doubling it) until a head's run reaches 1 MiB.
    size_t pages = 1, align = 64;
    if (page_bytes >= kHugePage || reserved_ >= kHugePage) {
      const size_t run_pages = (kHeadRun + run_bytes - 1) / run_bytes;
      pages = std::max((kHugePage + page_bytes - 1) / page_bytes, std::min(run_pages, pages_.size()));
      align = kHugePage;
    }
    const size_t n = pages * page_bytes;
    void* mem = nullptr;
    if (posix_memalign(&mem, align, n) != 0 || mem == nullptr)
      throw Error("KVStore: out of memory allocating " + std::to_string(n) + " bytes of pages after " +
                  std::to_string(length_) + " tokens; use a smaller cache type (q8/q4) or eviction");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == kHugePage) madvise(mem, n, MADV_HUGEPAGE);
#endif
    chunks_.emplace_back(static_cast<uint8_t*>(mem));
    reserved_ += n;
    chunk_next_ = static_cast<uint8_t*>(mem);
    chunk_pages_ = chunk_pages_left_ = static_cast<int>(pages);
  }
  // Chunk layout: per stream (K, V) and head, the chunk's pages' rows back to back.
  // (K and V runs stay whole 1 MiB runs apart: skewing V by 2112 bytes, and stores' bases by 4288,
  // ran LRKV f32 r = 8 decode 0.80-0.92x; 16K, caches emptied, A/B in one process.)
  const Page page{chunk_next_, static_cast<size_t>(chunk_pages_) * run_bytes};
  chunk_next_ += run_bytes;
  --chunk_pages_left_;
  // Tiled16: a page's last K group may hold fewer than 16 tokens, and decode loads all 16 lanes
  // (masking the rest), and q8/q4 V pairs both slots (the missing one weighed 0), so its runs
  // start as zeros rather than uninitialised memory.
  if (layout_ == KVLayout::Tiled16)
    for (int h = 0; h < streams * kv_heads_; ++h) std::memset(page.base + h * page.head_stride, 0, run_bytes);
  return page;
}

const KVStore::Page& KVStore::page_for_slot(int64_t slot) {
  const int64_t p = slot / page_tokens_;
  while (static_cast<int64_t>(pages_.size()) <= p) pages_.push_back(new_page());
  return pages_[p];
}

void KVStore::append(const float* k, const float* v) {
  // Validate before writing: with eviction the target slot still holds a live row.
  const size_t n = static_cast<size_t>(kv_heads_) * head_dim_;
  if (values_are_keys_) v = k;
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::max(std::fabs(k[i]), std::fabs(v[i])));
  bool finite = amax <= std::numeric_limits<float>::max();
  for (size_t i = 0; i < n; ++i) finite &= (k[i] == k[i]) & (v[i] == v[i]);
  if (!finite)
    throw Error("KVStore::append: K/V holds NaN or inf at position " + std::to_string(length_) +
                "; the model produced invalid activations, fix the forward pass before caching");
  // q8/q4: the fp16 block scale times the largest code; bf16: the largest float that does not
  // round to inf (bits 0x7f7f8000 and up do)
  const uint32_t bf16_top_bits = 0x7f7f7fffu;
  float bf16_top;
  std::memcpy(&bf16_top, &bf16_top_bits, 4);
  const float limit = type_ == KVType::Q8   ? 65504.0f * 127.0f
                      : type_ == KVType::Q4 ? 65504.0f * 8.0f
                      : type_ == KVType::BF16 ? bf16_top
                                              : std::numeric_limits<float>::max();
  if (amax > limit)
    throw Error("KVStore::append: |K/V| reaches " + std::to_string(amax) + ", beyond what " +
                (type_ == KVType::BF16 ? std::string("bf16 can hold (it would round to inf); use an f32 cache")
                                       : "a " + kv_type_name(type_) + " block scale (fp16) can hold; use an f32 or bf16 cache"));
  int64_t slot = length_;
  if (evict_.enabled() && length_ >= evict_.sink) slot = evict_.sink + (length_ - evict_.sink) % evict_.window;
  const Page& page = page_for_slot(slot);
  const int in_page = static_cast<int>(slot % page_tokens_);
  const size_t row = static_cast<size_t>(in_page) * row_bytes_;
  if (layout_ == KVLayout::Rows) {
    for (int h = 0; h < kv_heads_; ++h) {
      quantize_row(type_, k + static_cast<size_t>(h) * head_dim_, head_dim_, page.base + h * page.head_stride + row);
      if (!values_are_keys_)
        quantize_row(type_, v + static_cast<size_t>(h) * head_dim_, head_dim_,
                     page.base + static_cast<size_t>(kv_heads_ + h) * page.head_stride + row);
    }
  } else {
    uint8_t* buf = tile_row_.data();
    for (int h = 0; h < kv_heads_; ++h) {
      quantize_row(type_, k + static_cast<size_t>(h) * head_dim_, head_dim_, buf);
      write_row(page.base + h * page.head_stride, in_page, buf, true);
      quantize_row(type_, v + static_cast<size_t>(h) * head_dim_, head_dim_, buf);
      write_row(page.base + static_cast<size_t>(kv_heads_ + h) * page.head_stride, in_page, buf, false);
    }
  }
  ++length_;
}

// Tiled16 (kv_store.h): a q8/q4 row [nb fp16 scales][c codes] or a bf16 row of slot t (in its
// page) into a run.
void KVStore::write_row(uint8_t* run, int t, const uint8_t* row, bool keys) const {
  const int d = head_dim_, nb = d / kQBlock, g = t / 16, lane = t % 16;
  const size_t c = tiled_code_bytes(type_, d);
  if (type_ == KVType::BF16) {
    if (!keys) {
      std::memcpy(run + static_cast<size_t>(t) * row_bytes_, row, row_bytes_);
      return;
    }
    uint8_t* group = run + 16 * row_bytes_ * g;
    for (int i = 0; i < d / 2; ++i) std::memcpy(group + 64 * i + 4 * lane, row + 4 * i, 4);
    return;
  }
  uint8_t* scales = run + page_tokens_ * c + 32 * (static_cast<size_t>(nb) * g);
  for (int b = 0; b < nb; ++b) std::memcpy(scales + 32 * b + 2 * lane, row + 2 * b, 2);
  const uint8_t* codes = row + 2 * nb;
  if (!keys) {  // slot pairs, byte-interleaved
    uint8_t* pair = run + tiled_value_start(c, t);
    for (size_t i = 0; i < c; ++i) pair[2 * i] = codes[i];
    return;
  }
  uint8_t* group = run + 16 * c * g;
  for (size_t i = 0; i < c; ++i) group[tiled_key_byte(i, lane)] = static_cast<uint8_t>(codes[i] ^ tiled_key_flip(type_));
}

const uint8_t* KVStore::k_rows(int64_t page, int head) const {
  return pages_[page].base + static_cast<size_t>(head) * pages_[page].head_stride;
}

const uint8_t* KVStore::v_rows(int64_t page, int head) const {
  if (values_are_keys_) return k_rows(page, head);
  return pages_[page].base + static_cast<size_t>(kv_heads_ + head) * pages_[page].head_stride;
}

namespace {
void check_slot(int64_t slot, int head, int64_t stored, int heads) {
  if (slot < 0 || slot >= stored || head < 0 || head >= heads)
    throw Error("KVStore: row (slot " + std::to_string(slot) + ", head " + std::to_string(head) +
                ") is outside the stored rows [0, " + std::to_string(stored) + ") x heads [0, " +
                std::to_string(heads) + ")");
}
}  // namespace

void KVStore::read_rows(int64_t s0, int n, int head, bool keys, uint8_t* rows) const {
  check_slot(s0, head, stored(), kv_heads_);
  if (n < 1 || s0 + n > stored() || s0 / page_tokens_ != (s0 + n - 1) / page_tokens_)
    throw Error("KVStore: rows [" + std::to_string(s0) + ", " + std::to_string(s0 + n) + ") are not stored rows of one page (" +
                std::to_string(stored()) + " stored, " + std::to_string(page_tokens_) + " a page)");
  const uint8_t* run = keys ? k_rows(s0 / page_tokens_, head) : v_rows(s0 / page_tokens_, head);
  const int t0 = static_cast<int>(s0 % page_tokens_);
  if (layout_ == KVLayout::Rows) {
    std::memcpy(rows, run + static_cast<size_t>(t0) * row_bytes_, static_cast<size_t>(n) * row_bytes_);
    return;
  }
  const int d = head_dim_, nb = d / kQBlock;
  const size_t c = tiled_code_bytes(type_, d);  // (q8/q4)
  for (int t = t0; t < t0 + n; ++t, rows += row_bytes_) {
    const int g = t / 16, lane = t % 16;
    if (type_ == KVType::BF16) {
      if (!keys) {
        std::memcpy(rows, run + static_cast<size_t>(t) * row_bytes_, row_bytes_);
        continue;
      }
      const uint8_t* group = run + 16 * row_bytes_ * g;
      for (int i = 0; i < d / 2; ++i) std::memcpy(rows + 4 * i, group + 64 * i + 4 * lane, 4);
      continue;
    }
    const uint8_t* scales = run + page_tokens_ * c + 32 * (static_cast<size_t>(nb) * g);
    for (int b = 0; b < nb; ++b) std::memcpy(rows + 2 * b, scales + 32 * b + 2 * lane, 2);
    uint8_t* codes = rows + 2 * nb;
    if (!keys) {
      const uint8_t* pair = run + tiled_value_start(c, t);
      for (size_t i = 0; i < c; ++i) codes[i] = pair[2 * i];
      continue;
    }
    const uint8_t* group = run + 16 * c * g;
    for (size_t i = 0; i < c; ++i) codes[i] = static_cast<uint8_t>(group[tiled_key_byte(i, lane)] ^ tiled_key_flip(type_));
  }
}

void KVStore::read_k_rows(int64_t s0, int n, int head, uint8_t* rows) const { read_rows(s0, n, head, true, rows); }

void KVStore::read_v_rows(int64_t s0, int n, int head, uint8_t* rows) const {
  read_rows(s0, n, head, values_are_keys_, rows);  // (MLA: the K rows)
}

void append_random_rows(KVStore& store, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t row = static_cast<size_t>(store.kv_heads()) * store.head_dim();
  std::vector<float> k(row), v(row);
  for (int64_t t = 0; t < tokens; ++t) {
    for (size_t i = 0; i < row; ++i) k[i] = normal(rng), v[i] = normal(rng);
    store.append(k.data(), v.data());
  }
}

}  // namespace kvx::kernels
