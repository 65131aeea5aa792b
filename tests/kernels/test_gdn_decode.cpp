// The fused GDN decode step against its literal double-precision reference: odd widths, head
// counts, 1 and 2 threads, many steps in a row (the state carries), strong and weak decays.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/gdn_decode.h"

using namespace kvx::kernels;

namespace {

std::vector<float> randn(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

void l2_normalise_rows(std::vector<float>& x, int rows, int w) {
  for (int r = 0; r < rows; ++r) {
    double s = 0;
    for (int i = 0; i < w; ++i) s += static_cast<double>(x[r * w + i]) * x[r * w + i];
    for (int i = 0; i < w; ++i) x[r * w + i] = static_cast<float>(x[r * w + i] / std::sqrt(s + 1e-6));
  }
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
  return d;
}

}  // namespace

TEST(GdnDecodeKernel, MatchesTheLiteralRecurrenceOverManySteps) {
  for (int H : {1, 3, 4})
    for (int K : {5, 16, 64})
      for (int V : {7, 32, 48})
        for (int threads : {1, 2}) {
          const std::string what = "H" + std::to_string(H) + " K" + std::to_string(K) + " V" + std::to_string(V) + " t" +
                                   std::to_string(threads);
          std::mt19937 rng(H * 1000 + K * 10 + V);
          std::vector<float> fused(static_cast<size_t>(H) * K * V, 0.f), ref = fused;
          const float scale = 1.0f / std::sqrt(static_cast<float>(K));
          std::uniform_real_distribution<float> unit(0.f, 1.f);
          for (int step = 0; step < 37; ++step) {
            auto q = randn(static_cast<size_t>(H) * K, rng), k = randn(static_cast<size_t>(H) * K, rng);
            auto v = randn(static_cast<size_t>(H) * V, rng);
            l2_normalise_rows(q, H, K);
            l2_normalise_rows(k, H, K);
            std::vector<float> g(H), beta(H);
            for (int h = 0; h < H; ++h) {
              g[h] = step % 5 == 0 ? -3.0f * unit(rng) : -0.05f * unit(rng);
              beta[h] = unit(rng);
            }
            std::vector<float> out_f(static_cast<size_t>(H) * V), out_r(out_f.size());
            gdn_decode_step(fused.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), H, K, V, scale, out_f.data(),
                            threads);
            gdn_decode_step_reference(ref.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), H, K, V, scale,
                                      out_r.data());
            ASSERT_LT(max_abs_diff(out_f, out_r), 2e-5) << what << " step " << step;
            ASSERT_LT(max_abs_diff(fused, ref), 2e-5) << what << " state after step " << step;
          }
        }
}
