// One decode token of Gated DeltaNet (SPEC 1.2) for all heads of a layer, in place on the state:
// per head, S [K x V] row-major,
//   S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T (scale q)
// q and k are already L2-normalised. The state is read twice and written once: the first pass
// forms S^T k and S^T q together, so the output needs no pass of its own:
//   o = exp(g) S_old^T (scale q) + u (k . scale q).
// Threads split the heads. The reference does the four steps literally in double.
#pragma once

namespace kvx::kernels {

// state [heads][K][V]; q, k [heads][K]; v [heads][V]; g, beta [heads]; out [heads][V].
// threads <= 0: all OpenMP threads.
void gdn_decode_step(float* state, const float* q, const float* k, const float* v, const float* g, const float* beta,
                     int heads, int key_dim, int value_dim, float scale, float* out, int threads);
void gdn_decode_step_reference(float* state, const float* q, const float* k, const float* v, const float* g,
                               const float* beta, int heads, int key_dim, int value_dim, float scale, float* out);

}  // namespace kvx::kernels
