// Internal to the decode kernels: what the ISA back ends of decode_attention share.
//
// decode_attention.cpp (AVX2, the project baseline) owns the driver: work split, threads and
// the log-sum-exp merge. decode_attention_avx512.cpp is compiled with AVX-512 flags and only
// called after a run-time CPU check. It must not use std:: templates or other inline code it
// shares with the AVX2 files: the linker keeps one copy of an inline function, and an AVX-512
// copy would crash AVX2-only machines. So the AVX-512 side gets raw buffers from the driver.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/kv_store.h"

namespace kvx::kernels::detail {

// KV head `head`, stored rows [r0, r1) (slots).
struct DecodePiece {
  int head;
  int64_t r0, r1;
};

// AVX-512 back end (AVX-512 F/BW/VL/DQ/VNNI), for head_dim % 32 == 0.
bool avx512_usable();
// Scaled queries in its layout, avx512_query_floats(d, type) floats per head: f32 [d]; bf16 as
// (even | odd) positions per 32 values; q8/q4 quantised to int8 blocks (integer dot products).
size_t avx512_query_floats(int d, KVType type);
void avx512_prepare_queries(const float* q, int heads, int d, float scale, KVType type, float* qs);
// Scratch floats one split needs.
size_t avx512_scratch_floats(int G, int d, KVType type);
// Pieces [p0, p1): part p = [m[G], l[G], acc[G][d]] at parts + p * part_size (natural order).
void avx512_run_split(const KVStore& kv, const DecodePiece* pieces, int p0, int p1, const float* qs, int G,
                      float* parts, size_t part_size, float* scratch);

}  // namespace kvx::kernels::detail
