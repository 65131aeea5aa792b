// KV-cache element types and their (de)quantisation. Torch-free: raw buffers in and out.
//
// Row formats (one row = one head_dim vector of one token):
//   f32   n floats.
//   bf16  n uint16: the upper 16 bits of the float, rounded to nearest even.
//   q8    blocks of 32 values (llama.cpp q8_0 numerics): d = max|x| / 127, q = round(x / d),
//         x ~ q * d. Row = [n/32 fp16 scales][n int8 q]: 34 bytes per block, 8.5 bits/value.
//   q4    blocks of 32 values (q4_0 numerics): m = the value of largest magnitude (sign kept),
//         d = m / -8, q = clamp(round(x / d) + 8, 0, 15), x ~ (q - 8) * d.
//         Row = [n/32 fp16 scales][n/2 bytes]: byte j holds value 2j in its low nibble and
//         value 2j+1 in its high nibble, so 32-bit word w holds values 8w..8w+7 at bit offsets
//         0, 4, ..., 28. 18 bytes per block, 4.5 bits/value.
//   The scales of a row come first (one load converts them all) and the quants are contiguous;
//   sizes and numerics are those of q8_0/q4_0, the byte order is ours.
// q8/q4 quantise with the stored fp16 scale d, rounded away from zero (never below the exact
// max|x| / 127 or |m| / 8 in magnitude, so the extreme codes never clamp):
//   q8: |x - x~| <= |d|/2.
//   q4: |x - x~| <= |d|/2, except values of the opposite sign to m with |x| > 7.5|d|,
//       which clamp to q = 15 and have |x - x~| <= |d|.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace kvx::kernels {

enum class KVType { F32, BF16, Q8, Q4 };

KVType parse_kv_type(const std::string& name);  // "f32", "bf16", "q8", "q4"
std::string kv_type_name(KVType t);
double bits_per_value(KVType t);                 // 32, 16, 8.5, 4.5
size_t row_bytes(KVType t, int n);               // q8/q4 need n % 32 == 0

constexpr int kQBlock = 32;          // values per q8/q4 block
constexpr size_t kQ8BlockBytes = 34;
constexpr size_t kQ4BlockBytes = 18;

// x: n floats (finite) -> dst: row_bytes(t, n) bytes.
void quantize_row(KVType t, const float* x, int n, uint8_t* dst);
void dequantize_row(KVType t, const uint8_t* src, int n, float* dst);

// A query for integer dot products against q8/q4 rows (llama.cpp's q8_0 query, with a float
// scale): per 32-block d = max|x| / 127, codes round(x / d) (nearest, ties to even), x ~ d q.
// n % 32 == 0; scales gets n / 32 floats (0 for an all-zero block).
void quantize_query_blocks(const float* x, int n, int8_t* codes, float* scales);
// The query the integer kernels compute with, as floats: out = dequantised
// quantize_query_blocks(x * scale) (n % 32 == 0; the references, and LRKV latents whose blocks
// straddle heads where they are read as f32).
void round_query_blocks(const float* x, int n, float scale, float* out);
// The query the decode kernels score a cache of type t with, as floats: out = x * scale, rounded to
// bf16 for bf16 caches (round to nearest even; the kernels multiply bf16 pairs exactly into fp32
// sums), through round_query_blocks for q8/q4.
void round_query(KVType t, const float* x, int n, float scale, float* out);

// Scalar helpers shared with the kernels and tests.
uint16_t float_to_bf16(float x);  // round to nearest even; NaN stays NaN
inline float bf16_to_float(uint16_t h) {  // inline: dequantize_row's loop vectorises (-fPIC keeps exported calls)
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
uint16_t float_to_fp16(float x);  // IEEE binary16, round to nearest even
float fp16_to_float(uint16_t h);

}  // namespace kvx::kernels
