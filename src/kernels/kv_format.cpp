#include "kernels/kv_format.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__)
#include "kernels/simd_avx2.h"
#endif

#include "util/error.h"

namespace kvx::kernels {

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void check_finite(bool ok, KVType t) {
  if (!ok)
    throw Error("quantize_row(" + kv_type_name(t) +
                "): a K/V row holds NaN or inf; the model produced invalid activations, fix the "
                "forward pass (or its input) before caching it");
}

void check_scale(float d, KVType t) {
  if (!(std::fabs(d) <= 65504.0f))
    throw Error("quantize_row(" + kv_type_name(t) + "): block scale " + std::to_string(d) +
                " exceeds the fp16 range (65504); K/V values this large need an f32 or bf16 cache");
}

// A block scale in fp16, rounded away from zero so that no code exceeds its range (a scale
// rounded down, most in fp16's subnormal range, clamped the largest values: at max|x| = 1e-4 a
// q8 code rounded to 129 and lost 4 times the stated bound).
uint16_t block_scale_fp16(float d) {
  uint16_t h = float_to_fp16(d);
  if (std::fabs(fp16_to_float(h)) < std::fabs(d)) ++h;  // sign-magnitude: the next larger magnitude
  return h;
}

// x ~ q * d with d = max|x| / 127 (fp16, block_scale_fp16), q in [-127, 127].
void quantize_q8(const float* x, int n, uint8_t* dst) {
  const int nb = n / kQBlock;
  int8_t* qs = reinterpret_cast<int8_t*>(dst + 2 * nb);
  for (int b = 0; b < nb; ++b, x += kQBlock, qs += kQBlock) {
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < kQBlock; ++i) {
      const float a = std::fabs(x[i]);
      finite &= a <= FLT_MAX;
      amax = std::max(amax, a);
    }
    check_finite(finite, KVType::Q8);
    const float d = amax / 127.0f;
    check_scale(d, KVType::Q8);
    const uint16_t dh = block_scale_fp16(d);
    const float d16 = fp16_to_float(dh);
    const float id = d16 > 0.0f ? 1.0f / d16 : 0.0f;
    store_u16(dst + 2 * b, dh);
    for (int i = 0; i < kQBlock; ++i) {
      const float r = std::nearbyint(x[i] * id);
      qs[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
    }
  }
}

// x ~ (q - 8) * d with d = m / -8 (fp16, block_scale_fp16), m the value of largest magnitude; q in [0, 15].
void quantize_q4(const float* x, int n, uint8_t* dst) {
  const int nb = n / kQBlock;
  uint8_t* qs = dst + 2 * nb;
  for (int b = 0; b < nb; ++b, x += kQBlock, qs += kQBlock / 2) {
    float amax = 0.0f, m = 0.0f;
    bool finite = true;
    for (int i = 0; i < kQBlock; ++i) {
      const float a = std::fabs(x[i]);
      finite &= a <= FLT_MAX;
      if (a > amax) {
        amax = a;
        m = x[i];
      }
    }
    check_finite(finite, KVType::Q4);
    const float d = m / -8.0f;
    check_scale(d, KVType::Q4);
    const uint16_t dh = block_scale_fp16(d);
    const float d16 = fp16_to_float(dh);
    const float id = d16 != 0.0f ? 1.0f / d16 : 0.0f;
    store_u16(dst + 2 * b, dh);
    uint8_t q[kQBlock];
    for (int i = 0; i < kQBlock; ++i) {
      const float r = std::nearbyint(x[i] * id) + 8.0f;
      q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, r)));
    }
    for (int j = 0; j < kQBlock / 2; ++j) qs[j] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
  }
}

}  // namespace

namespace {
inline uint16_t bf16_of(float x) {  // float_to_bf16, inlined where a loop calls it (it vectorises)
  const uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
}  // namespace

uint16_t float_to_bf16(float x) { return bf16_of(x); }

uint16_t float_to_fp16(float x) {
#if defined(__F16C__)
  return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;       // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;      // >= 65520 rounds to inf
  if (a < 0x38800000u) {                           // below 2^-14: fp16 subnormal or zero
    if (a <= 0x33000000u) return sign;             // <= 2^-25 rounds to zero
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, s = 126 - e;
    uint32_t q = m >> s;
    const uint32_t rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = ((a >> 23) - 112) << 10 | ((a & 0x7fffffu) >> 13);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return static_cast<uint16_t>(sign | r);
#endif
}

float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112) << 23) | (m << 13));
#endif
}

KVType parse_kv_type(const std::string& name) {
  if (name == "f32") return KVType::F32;
  if (name == "bf16") return KVType::BF16;
  if (name == "q8") return KVType::Q8;
  if (name == "q4") return KVType::Q4;
  throw Error("unknown KV cache type '" + name + "'; valid types are f32, bf16, q8, q4");
}

std::string kv_type_name(KVType t) {
  switch (t) {
    case KVType::F32: return "f32";
    case KVType::BF16: return "bf16";
    case KVType::Q8: return "q8";
    case KVType::Q4: return "q4";
  }
  throw Error("kv_type_name: invalid KVType value " + std::to_string(static_cast<int>(t)));
}

double bits_per_value(KVType t) {
  switch (t) {
    case KVType::F32: return 32.0;
    case KVType::BF16: return 16.0;
    case KVType::Q8: return 8.0 * kQ8BlockBytes / kQBlock;  // 8.5
    case KVType::Q4: return 8.0 * kQ4BlockBytes / kQBlock;  // 4.5
  }
  throw Error("bits_per_value: invalid KVType value " + std::to_string(static_cast<int>(t)));
}

size_t row_bytes(KVType t, int n) {
  if (n <= 0) throw Error("KV row width (head_dim) must be positive, got " + std::to_string(n));
  switch (t) {
    case KVType::F32: return 4 * static_cast<size_t>(n);
    case KVType::BF16: return 2 * static_cast<size_t>(n);
    case KVType::Q8:
    case KVType::Q4:
      if (n % kQBlock != 0)
        throw Error(kv_type_name(t) + " KV cache needs rows of a multiple of 32 values (its blocks): a head's keys " +
                    "(head_dim), MLA's latent plus RoPE key (kv_lora_rank + qk_rope_head_dim), NAtS-L's per-head split, " +
                    "LRKV's latents of all heads (heads x rank); got a row of " + std::to_string(n) +
                    "; use an f32 or bf16 cache for this model");
      return static_cast<size_t>(n / kQBlock) * (t == KVType::Q8 ? kQ8BlockBytes : kQ4BlockBytes);
  }
  throw Error("row_bytes: invalid KVType value " + std::to_string(static_cast<int>(t)));
}

void quantize_query_blocks(const float* x, int n, int8_t* codes, float* scales) {
  if (n % kQBlock != 0)
    throw Error("quantize_query_blocks: n (" + std::to_string(n) + ") must be a multiple of " + std::to_string(kQBlock));
  for (int b = 0; b < n / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
#if defined(__AVX2__)
    // The scalar loop below, 8 lanes at a time (the same float operations, so the same codes):
    // it runs for every query head of every decode step.
    __m256 v[4], amax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(xb + 8 * k);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[k], abs_mask));
    }
    const float d = hmax(amax) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    scales[b] = d;
    __m256i c[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), r)));
    }
    // packs interleave 128-bit halves: [c0 lo, c1 lo, c2 lo, c3 lo | c0 hi, ...] in 4-byte groups
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kQBlock),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.0f;
    for (int i = 0; i < kQBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    scales[b] = d;
    for (int i = 0; i < kQBlock; ++i)
      codes[b * kQBlock + i] = static_cast<int8_t>(std::clamp(std::nearbyint(xb[i] * inv), -127.0f, 127.0f));
#endif
  }
}

void round_query_blocks(const float* x, int n, float scale, float* out) {
  std::vector<float> scaled(n), d(n / kQBlock);
  std::vector<int8_t> codes(n);
  for (int i = 0; i < n; ++i) scaled[i] = x[i] * scale;
  quantize_query_blocks(scaled.data(), n, codes.data(), d.data());
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(codes[i]) * d[i / kQBlock];
}

void round_query(KVType t, const float* x, int n, float scale, float* out) {
  switch (t) {
    case KVType::F32:
      for (int i = 0; i < n; ++i) out[i] = x[i] * scale;
      return;
    case KVType::BF16:
      for (int i = 0; i < n; ++i) out[i] = bf16_to_float(bf16_of(x[i] * scale));
      return;
    case KVType::Q8:
    case KVType::Q4: round_query_blocks(x, n, scale, out); return;
  }
}

void quantize_row(KVType t, const float* x, int n, uint8_t* dst) {
  row_bytes(t, n);  // validates n
  switch (t) {
    case KVType::F32: std::memcpy(dst, x, 4 * static_cast<size_t>(n)); return;
    case KVType::BF16:
      for (int i = 0; i < n; ++i) store_u16(dst + 2 * i, bf16_of(x[i]));
      return;
    case KVType::Q8: quantize_q8(x, n, dst); return;
    case KVType::Q4: quantize_q4(x, n, dst); return;
  }
}

void dequantize_row(KVType t, const uint8_t* src, int n, float* dst) {
  row_bytes(t, n);
  switch (t) {
    case KVType::F32: std::memcpy(dst, src, 4 * static_cast<size_t>(n)); return;
    case KVType::BF16:
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(load_u16(src + 2 * i));
      return;
    case KVType::Q8: {  // one scale per block, hoisted: the inner loops vectorise
      const int8_t* q = reinterpret_cast<const int8_t*>(src + 2 * (n / kQBlock));
      for (int b = 0; b < n / kQBlock; ++b) {
        const float d = fp16_to_float(load_u16(src + 2 * b));
        for (int i = 0; i < kQBlock; ++i) dst[b * kQBlock + i] = static_cast<float>(q[b * kQBlock + i]) * d;
      }
      return;
    }
    case KVType::Q4: {
      const uint8_t* q = src + 2 * (n / kQBlock);
      for (int b = 0; b < n / kQBlock; ++b) {
        const float d = fp16_to_float(load_u16(src + 2 * b));
#if defined(__AVX2__)
        // The scalar loop (#else), 8 lanes at a time (the same codes and products): the AVX2 LRKV
        // kernel dequantises q4 latents of r % 32 != 0 row by row every tile, where the scalar loop took 20% of the call.
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kQBlock / 2));
        const __m128i nibble = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, nibble), eight);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), eight);
        const __m128i codes[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  // values 0-15, 16-31
        const __m256 dv = _mm256_set1_ps(d);
        for (int k = 0; k < 4; ++k) {
          const __m128i c = k % 2 ? _mm_srli_si128(codes[k / 2], 8) : codes[k / 2];
          _mm256_storeu_ps(dst + b * kQBlock + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), dv));
        }
#else
        for (int j = 0; j < kQBlock / 2; ++j) {
          const uint8_t byte = q[b * kQBlock / 2 + j];
          dst[b * kQBlock + 2 * j] = static_cast<float>((byte & 0xf) - 8) * d;
          dst[b * kQBlock + 2 * j + 1] = static_cast<float>((byte >> 4) - 8) * d;
        }
#endif
      }
      return;
    }
  }
}

}  // namespace kvx::kernels
