// Test allowances for kernels that weigh values with rounded softmax weights.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/kv_format.h"
#include "kernels/kv_store.h"

namespace kvx::testing {

// q8/q4 values weighed with 15-bit codes (decode_weighs_values_in_int16): out (heads rows of width
// kv.head_dim(), head h reading KV head h / (heads / kv_heads)) within largest[h] * max_t |d_t,b(i)| *
// sum_t |code_t,i| / 65534 of ref (q4's code: its nibble - 8), plus 1e-5 of the head's largest |ref|. largest: each head's
// largest softmax weight (the references' largest_weight). Returns the worst error over its
// allowance (<= 1 passes).
inline double worst_over_int16_weights(const std::vector<float>& out, const std::vector<float>& ref, const std::vector<float>& largest,
                                       const kernels::KVStore& kv, int heads) {
  const int d = kv.head_dim(), nb = d / kernels::kQBlock, G = heads / kv.kv_heads();
  double worst = 0;
  for (int kh = 0; kh < kv.kv_heads(); ++kh) {
    std::vector<double> scale_max(nb, 0.0), code_sum(d, 0.0);  // per block: max_t d_t; per value: sum_t |code_t,i|
    std::vector<uint8_t> row_bytes(kv.row_bytes());
    for (int64_t t = 0; t < kv.stored(); ++t) {
      kv.read_v_rows(t, 1, kh, row_bytes.data());
      const uint8_t* row = row_bytes.data();
      for (int b = 0; b < nb; ++b) {
        uint16_t h;
        std::memcpy(&h, row + 2 * b, 2);
        scale_max[b] = std::max(scale_max[b], std::fabs(static_cast<double>(kernels::fp16_to_float(h))));
      }
      const uint8_t* codes = row + 2 * nb;
      for (int i = 0; i < d; ++i)
        code_sum[i] += kv.type() == kernels::KVType::Q4 ? std::abs(((codes[i / 2] >> (4 * (i % 2))) & 15) - 8)
                                                         : std::abs(static_cast<int>(static_cast<int8_t>(codes[i])));
    }
    for (int h = kh * G; h < (kh + 1) * G; ++h) {
      double mag = 1e-30;
      for (int i = 0; i < d; ++i) mag = std::max(mag, std::fabs(static_cast<double>(ref[h * d + i])));
      for (int i = 0; i < d; ++i) {
        const double allowed = largest[h] * scale_max[i / kernels::kQBlock] * code_sum[i] / 65534 * (1 + 1e-5) + 1e-5 * mag;
        worst = std::max(worst, std::fabs(static_cast<double>(out[h * d + i]) - ref[h * d + i]) / allowed);
      }
    }
  }
  return worst;
}

// Kernels that round the softmax numerators to bf16 (decode_rounds_value_weights,
// lrkv_rounds_value_weights): a (rows of width w) within 2^-8 of sum_t a_t |v_t| of the reference b
// (b_abs: the reference over |v|, the same scores), plus 1e-5 of the row's largest |b|. Returns the
// worst error over its allowance (<= 1 passes).
inline double worst_over_rounding(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& b_abs,
                                  int rows, int w) {
  double worst = 0;
  for (int h = 0; h < rows; ++h) {
    double mag = 1e-30;
    for (int i = 0; i < w; ++i) mag = std::max(mag, std::fabs(static_cast<double>(b[h * w + i])));
    for (int i = 0; i < w; ++i) {
      const double allowed = std::ldexp(static_cast<double>(b_abs[h * w + i]), -8) * (1 + 1e-5) + 1e-5 * mag;
      worst = std::max(worst, std::fabs(static_cast<double>(a[h * w + i]) - b[h * w + i]) / allowed);
    }
  }
  return worst;
}

}  // namespace kvx::testing
