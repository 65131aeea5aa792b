#include "kernels/gdn_decode.h"

#include <omp.h>

#include <cmath>
#include <vector>

namespace kvx::kernels {

namespace {

void one_head(float* __restrict S, const float* __restrict q, const float* __restrict k, const float* __restrict v,
              float g, float beta, int K, int V, float scale, float* __restrict out, float* __restrict sk,
              float* __restrict sq) {
  for (int j = 0; j < V; ++j) sk[j] = sq[j] = 0.f;
  float kq = 0.f;
  for (int i = 0; i < K; ++i) {  // pass 1: S^T k and S^T q
    const float* row = S + static_cast<size_t>(i) * V;
    const float ki = k[i], qi = q[i];
    kq += ki * qi;
    for (int j = 0; j < V; ++j) {
      sk[j] += row[j] * ki;
      sq[j] += row[j] * qi;
    }
  }
  const float decay = std::exp(g);
  for (int j = 0; j < V; ++j) {
    const float u = beta * (v[j] - decay * sk[j]);
    out[j] = scale * (decay * sq[j] + u * kq);
    sk[j] = u;  // reused as u below
  }
  for (int i = 0; i < K; ++i) {  // pass 2: S = exp(g) S + k u^T
    float* row = S + static_cast<size_t>(i) * V;
    const float ki = k[i];
    for (int j = 0; j < V; ++j) row[j] = decay * row[j] + ki * sk[j];
  }
}

}  // namespace

void gdn_decode_step(float* state, const float* q, const float* k, const float* v, const float* g, const float* beta,
                     int heads, int key_dim, int value_dim, float scale, float* out, int threads) {
  const int n = threads > 0 ? threads : omp_get_max_threads();
  const size_t per_head = static_cast<size_t>(key_dim) * value_dim;
#pragma omp parallel num_threads(n) if (n > 1 && heads > 1)
  {
    std::vector<float> scratch(2 * static_cast<size_t>(value_dim));
#pragma omp for schedule(static)
    for (int h = 0; h < heads; ++h)
      one_head(state + h * per_head, q + static_cast<size_t>(h) * key_dim, k + static_cast<size_t>(h) * key_dim,
               v + static_cast<size_t>(h) * value_dim, g[h], beta[h], key_dim, value_dim, scale,
               out + static_cast<size_t>(h) * value_dim, scratch.data(), scratch.data() + value_dim);
  }
}

void gdn_decode_step_reference(float* state, const float* q, const float* k, const float* v, const float* g,
                               const float* beta, int heads, int key_dim, int value_dim, float scale, float* out) {
  const int K = key_dim, V = value_dim;
  std::vector<double> S(static_cast<size_t>(K) * V), u(V);
  for (int h = 0; h < heads; ++h) {
    float* Sh = state + static_cast<size_t>(h) * K * V;
    const float *qh = q + static_cast<size_t>(h) * K, *kh = k + static_cast<size_t>(h) * K, *vh = v + static_cast<size_t>(h) * V;
    const double decay = std::exp(static_cast<double>(g[h]));
    for (size_t i = 0; i < S.size(); ++i) S[i] = decay * Sh[i];  // S = exp(g) S
    for (int j = 0; j < V; ++j) {                                 // u = beta (v - S^T k)
      double sk = 0;
      for (int i = 0; i < K; ++i) sk += S[static_cast<size_t>(i) * V + j] * kh[i];
      u[j] = beta[h] * (vh[j] - sk);
    }
    for (int i = 0; i < K; ++i)  // S += k u^T
      for (int j = 0; j < V; ++j) S[static_cast<size_t>(i) * V + j] += kh[i] * u[j];
    for (int j = 0; j < V; ++j) {  // o = S^T (scale q)
      double o = 0;
      for (int i = 0; i < K; ++i) o += S[static_cast<size_t>(i) * V + j] * scale * qh[i];
      out[static_cast<size_t>(h) * V + j] = static_cast<float>(o);
    }
    for (size_t i = 0; i < S.size(); ++i) Sh[i] = static_cast<float>(S[i]);
  }
}

}  // namespace kvx::kernels
