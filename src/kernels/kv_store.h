// Per-layer K/V storage for one sequence, in a KVType format, quantised at write.
//
// Rows live in pages of page_tokens slots allocated on demand, so growth never copies history.
// Pages are carved from chunks laid out [K, V][kv_heads][pages][page_tokens][row_bytes]: one
// head's rows are contiguous across the chunk's pages. Small stores take one page per chunk;
// once a store passes 2 MiB its chunks are 2 MiB-aligned, marked for transparent huge pages and
// hold at least 2 MiB, growing with the store (never past doubling it) until one head's run is
// 1 MiB. Decode streams each head's K and V rows: on this project's VM, runs of 1 MiB instead
// of one 256-token page (128 KiB at f32, d_h 128) read 6-11% faster when the memory is fast,
// and 4 KiB pages lose much of the software prefetch to TLB misses.
//
// Eviction (StreamingLLM): with window > 0 the store keeps the first `sink` tokens and the last
// `window` tokens, at most sink + window rows: sink tokens take slots [0, sink), later tokens a
// ring over slots [sink, sink + window); an evicted row is overwritten, never read. Keys keep
// the RoPE rotation of their original position (applied before append); a new query gets its
// true position (length()); nothing is re-rotated. Attention is permutation-invariant over
// keys, so kernels read the stored slots in slot order.
//
// Layouts of one page's run of rows (one head, K or V; page_tokens P):
//   Rows       P rows as kv_format writes them (every type).
//   Tiled16    q8, q4 or bf16, P % 16 == 0, d even, not values_are_keys. The AVX-512 decode loads a
//              group's word i (of block b) for its 16 tokens as one vector (and q8/q4's scales as
//              one) instead of transposing 16 rows or summing across lanes, and q8/q4 value pairs
//              by one widening (kernels/decode_attention_avx512.cpp: token_scores,
//              bf16_group_scores, int_value_pairs). Same bytes as Rows.
//              bf16: K words (values 2i, 2i + 1) token-interleaved, word i of slot 16 g + t at
//              32 d g + 64 i + 4 t; V as rows.
//              q8/q4: P c bytes of codes (c = d for q8, d / 2 for q4), then P d / 16 fp16
//              scales: per group of 16 slots g and 32-block b, the 16 slots' scales at
//              P c + 2 (16 nb g + 16 b + t) (nb = d / 32). K codes token-interleaved by 4-byte
//              words: code byte i of slot 16 g + t at 16 c g + 512 (i / 32) + 64 (i % 32 / 4) + 4 t
//              + i % 4, q8's stored as code + 128 (AVX-512's unsigned operand), q4's as stored (two
//              nibbles). V codes in slot pairs, byte-interleaved: byte i of slot 2 k + e at
//              2 c k + 2 i + e.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/kv_format.h"

namespace kvx::kernels {

enum class KVLayout { Rows, Tiled16 };
std::string kv_layout_name(KVLayout layout);         // "rows", "tiled16"
KVLayout parse_kv_layout(const std::string& name);  // an error lists the valid names

struct Eviction {
  int64_t sink = 0, window = 0;
  bool enabled() const { return window > 0; }
};

class KVStore {
 public:
  // values_are_keys: one row per token serves as both key and value (MLA's latent [c | k_R]):
  // V rows alias K rows, append ignores v, and bytes count the rows once.
  // layout Tiled16 needs q8, q4 or bf16, page_tokens % 16 == 0, an even head_dim and !values_are_keys
  // (an error names which).
  KVStore(KVType type, int kv_heads, int head_dim, Eviction evict = {}, int page_tokens = 256,
          bool values_are_keys = false, KVLayout layout = KVLayout::Rows);
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;
  KVStore(KVStore&&) noexcept;
  KVStore& operator=(KVStore&&) noexcept;

  // ONE token: k, v are [kv_heads][head_dim] floats (keys already RoPE-rotated; v unused, may be
  // null, when values_are_keys).
  void append(const float* k, const float* v);
  int64_t length() const { return length_; }  // tokens appended so far (the next position)
  int64_t stored() const;                     // rows held: length, or at most sink + window
  int64_t bytes() const;                      // exact bytes of the rows held (K and V, all heads)
  int64_t reserved_bytes() const;             // bytes allocated (pages)
  double bytes_per_token() const;             // 2 (1 if values_are_keys) * kv_heads * row_bytes(type, head_dim)
  bool values_are_keys() const { return values_are_keys_; }
  void clear();                               // length 0; pages are kept for reuse
  void truncate(int64_t length);              // drop the newest tokens past `length` (no eviction only)

  KVType type() const { return type_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return head_dim_; }
  const Eviction& eviction() const { return evict_; }
  size_t row_bytes() const { return row_bytes_; }
  KVLayout layout() const { return layout_; }

  // Read access. Stored rows are slots [0, stored()); slot s is row s % page_tokens of page
  // s / page_tokens. k_rows(p, h) points at page p's run for head h (page_tokens * row_bytes
  // bytes in layout()). read_k_rows / read_v_rows copy n slots' rows from slot s0 (in one page)
  // out in the Rows format (the references; the AVX2 back end on Tiled16 stores).
  int page_tokens() const { return page_tokens_; }
  int64_t pages() const { return static_cast<int64_t>(pages_.size()); }  // handed out so far
  const uint8_t* k_rows(int64_t page, int head) const;
  const uint8_t* v_rows(int64_t page, int head) const;
  void read_k_rows(int64_t s0, int n, int head, uint8_t* rows) const;
  void read_v_rows(int64_t s0, int n, int head, uint8_t* rows) const;
  int64_t slot_of(int64_t position) const;     // -1 if evicted; position < length()
  int64_t position_of(int64_t slot) const;     // the token position a stored slot holds

 private:
  struct MemFree {
    void operator()(uint8_t* p) const;
  };
  using Mem = std::unique_ptr<uint8_t[], MemFree>;
  struct Page {
    uint8_t* base;       // head 0's K rows
    size_t head_stride;  // bytes from one head's rows to the next's (V follows the kv_heads K runs)
  };
  const Page& page_for_slot(int64_t slot);
  Page new_page();
  void write_row(uint8_t* run, int slot_in_page, const uint8_t* row, bool keys) const;  // Rows-format row into a run
  void read_rows(int64_t s0, int n, int head, bool keys, uint8_t* rows) const;

  KVType type_;
  int kv_heads_, head_dim_;
  Eviction evict_;
  int page_tokens_;
  size_t row_bytes_;
  size_t half_page_bytes_;  // one of the K / V blocks of a page
  bool values_are_keys_ = false;
  KVLayout layout_ = KVLayout::Rows;
  std::vector<uint8_t> tile_row_;  // Tiled16: append's one quantised row before write_row spreads it
  int64_t length_ = 0;
  std::vector<Page> pages_;  // in slot order, pointing into chunks_
  std::vector<Mem> chunks_;  // allocations: one page each, or several once the store is large
  size_t reserved_ = 0;      // bytes of chunks_
  uint8_t* chunk_next_ = nullptr;  // the next page's head 0 K rows in the newest chunk
  int chunk_pages_ = 0, chunk_pages_left_ = 0;
};

// Appends `tokens` rows of N(0, 1) values to every head (a benchmark's history: decode speed does
// not depend on the values).
void append_random_rows(KVStore& store, int64_t tokens, uint32_t seed);

}  // namespace kvx::kernels
