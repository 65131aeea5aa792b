"""kvx's attention operators on NumPy arrays or torch tensors.

Inputs may be NumPy arrays, torch tensors (CPU; converted without a copy where possible) or
nested lists; outputs are NumPy arrays, or torch tensors when any input was one. float64
inputs stay float64 in the libtorch operators; the fused kernels work in float32.

Fused decode kernels (one query token, all heads; `reference=True` runs the plain reference):
  decode_attention   dense MHA/GQA/MQA over a cache of f32/bf16/q8/q4 rows, sink + window eviction,
                     an optional extra (logit, value) pair per head (Nectar's document pair)
  lrkv_decode        LRKV factored decode (seed 000 Eq. 7): (out_s, out_r); lrkv_attention finishes it
  mla_decode         MLA absorbed decode over [c | k_R] rows; mla_attention composes it
  LlaStore           LLA: history kept as cross-loop codes, read by the reconstruct-on-read kernel
libtorch operators:
  causal_attention, rope, gdn (recurrent | chunked | fused), natsl_routes, natsl_softmax,
  natsl_gdn, nectar_exact, nectar_compose, LlaCodec
"""
import functools
import sys

import numpy as np

from . import _kvx

__all__ = ["decode_attention", "lrkv_decode", "lrkv_attention", "mla_decode", "mla_attention", "causal_attention",
           "rope", "gdn", "l2_normalize", "natsl_routes", "natsl_softmax", "natsl_gdn", "nectar_exact",
           "nectar_compose", "LlaCodec", "LlaStore"]


def _is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _numpy(x):
    if x is None or isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        x = x.detach().cpu()
        if not x.dtype.is_floating_point or x.dtype in (sys.modules["torch"].float32, sys.modules["torch"].float64):
            return x.numpy()
        return x.float().numpy()  # bf16/f16: float32
    return np.asarray(x)


def _to_torch(x):
    torch = sys.modules["torch"]
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, tuple):
        return tuple(_to_torch(v) for v in x)
    return x


def _like(template, out):
    """`out` as torch tensors when `template` (an input or a list of inputs) holds one."""
    items = template if isinstance(template, (list, tuple)) else [template]
    return _to_torch(out) if any(_is_torch(t) for t in items) else out


def _operator(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        inputs = list(args) + list(kwargs.values())
        out = fn(*[_numpy(a) if _array_like(a) else a for a in args],
                 **{k: _numpy(v) if _array_like(v) else v for k, v in kwargs.items()})
        return _like(inputs, out)
    return wrapped


def _array_like(x):
    return isinstance(x, (np.ndarray, list, tuple)) or _is_torch(x)


@_operator
def decode_attention(q, k, v, scale=None, kv_cache="f32", sink=0, window=0, extra_logit=None, extra_value=None,
                     reference=False, threads=0):
    """out [H, d] = softmax(scale q k^T) v for one query token: q [H, d] (RoPE applied), k, v
    [tokens, Hkv, d] written into a kv_cache store (f32, bf16, q8, q4: quantised at write), keeping
    the first `sink` and last `window` tokens when window > 0. extra_logit [H] / extra_value [H, d]:
    one more row per head, already in scaled-score units. scale defaults to 1/sqrt(d)."""
    return _kvx.decode_attention(q, k, v, scale, kv_cache, sink, window, extra_logit, extra_value, reference, threads)


@_operator
def lrkv_decode(q, qb, k_shared, v_shared, r_k, r_v, scale=None, kv_cache="f32", reference=False, threads=0):
    """LRKV factored decode core: s_h,t = scale (q_h . K_s,t + qb_h . R^K_h,t), a_h = softmax(s_h);
    returns (out_s [H, d] = a_h V_s, out_r [H, r] = a_h R^V_h). q [H, d], qb [H, r] = q_h B^K_h,
    k_shared/v_shared [tokens, d], r_k/r_v [tokens, H, r]; qb, r_k, r_v None for rank 0."""
    return _kvx.lrkv_decode(q, qb, k_shared, v_shared, r_k, r_v, scale, kv_cache, reference, threads)


def lrkv_attention(q, k_shared, v_shared, r_k, r_v, b_k, b_v, kv_cache="f32", reference=False, threads=0):
    """LRKV decode for one token, finished: o_h = a_h V_s + (a_h R^V_h) B^V_h^T with
    qb_h = q_h B^K_h (seed 000 Eq. 7); b_k, b_v [H, d, r]. Historical per-head K/V are never formed."""
    qn, bk, bv = _numpy(q), _numpy(b_k), _numpy(b_v)
    qb = np.einsum("hd,hdr->hr", qn, bk)
    out_s, out_r = _kvx.lrkv_decode(qn, qb, _numpy(k_shared), _numpy(v_shared), _numpy(r_k), _numpy(r_v), None,
                                    kv_cache, reference, threads)
    return _like([q, k_shared, v_shared, r_k, r_v, b_k, b_v], out_s + np.einsum("hr,hdr->hd", out_r, bv).astype(np.float32))


@_operator
def mla_decode(q, latents, scale, kv_cache="f32", reference=False, threads=0):
    """MLA absorbed decode core: q [H, d_c + d_R] = [q_h W_UK,h | rope(q_R,h)] against rows
    latents [tokens, d_c + d_R] = [c | k_R] that are both keys and values; returns a_h [c | k_R]
    [H, d_c + d_R]. scale is the model's 1/sqrt(d_h + d_R)."""
    return _kvx.mla_decode(q, latents, scale, kv_cache, reference, threads)


def mla_attention(q_nope, q_rope, c, k_rope, w_uk, w_uv, kv_cache="f32", reference=False, threads=0):
    """MLA decode for one token, absorbed: scores (q_h W_UK,h) . c_t + q_R,h . k_R,t over
    sqrt(d_h + d_R), o_h = (a_h C) W_UV,h^T. q_nope [H, d_h], q_rope [H, d_R] (rotated), c
    [tokens, d_c], k_rope [tokens, d_R] (rotated), w_uk, w_uv [H, d_h, d_c]."""
    qn, qr, cn, kr, uk, uv = (_numpy(x) for x in (q_nope, q_rope, c, k_rope, w_uk, w_uv))
    d_h, d_r, d_c = qn.shape[1], qr.shape[1], cn.shape[1]
    qa = np.concatenate([np.einsum("hd,hdc->hc", qn, uk), qr], axis=1).astype(np.float32)
    rows = np.concatenate([cn, kr], axis=1).astype(np.float32)
    out = _kvx.mla_decode(qa, rows, 1.0 / np.sqrt(d_h + d_r), kv_cache, reference, threads)
    return _like([q_nope, q_rope, c, k_rope, w_uk, w_uv], np.einsum("hc,hdc->hd", out[:, :d_c], uv).astype(np.float32))


@_operator
def causal_attention(q, k, v, q_start=0):
    """softmax(q k^T / sqrt(d) + causal mask) v: q [B, H, T, d], k [B, Hkv, Tk, d], v [B, Hkv, Tk, dv];
    query i sits at position q_start + i. The libtorch reference the fused kernels are tested against."""
    return _kvx.causal_attention(q, k, v, q_start)


@_operator
def rope(x, start=0, theta=10000.0):
    """Rotary embedding, Llama "rotate half": x [..., T, d] at positions start .. start + T - 1."""
    return _kvx.rope(x, start, theta)


@_operator
def l2_normalize(x):
    """x / sqrt(sum x^2 + 1e-6) over the last axis (GDN's q and k)."""
    return _kvx.l2_normalize(x)


@_operator
def gdn(q, k, v, g, beta, scale=None, state=None, form="chunked", chunk=64, threads=0):
    """Gated DeltaNet (SPEC 1.2): S = e^g S; u = beta (v - S^T k); S += k u^T; o = S^T (scale q).
    q, k [B, H, T, K] (L2-normalised), v [B, H, T, V], g (log decay <= 0), beta [B, H, T], state
    [B, H, K, V] or None. form: recurrent (token by token), chunked (WY form, `chunk` tokens),
    fused (the torch-free decode kernel, f32). Returns (o [B, H, T, V], final state)."""
    return _kvx.gdn(q, k, v, g, beta, scale, state, form, chunk, threads)


@_operator
def natsl_routes(probs, fraction=1.0, max_blocks=0, last_forced=False):
    """NAtS-L routes [B, NB, H] (0: block kept as softmax KV, 1: folded into the GDN state) from
    router probabilities [B, NB, H, 2]: argmax, then the KV budget (at most floor(fraction x blocks
    so far), at most max_blocks), then the last block to GDN if last_forced."""
    return _kvx.natsl_routes(probs, fraction, max_blocks, last_forced)


@_operator
def natsl_softmax(q, k, v, routes, block, scale=None):
    """NAtS-L softmax branch: causal attention of q [B, HA, T, K] over the keys of the blocks routed
    to softmax (and the query's own block), routes [B, NB, H] for GDN head groups."""
    return _kvx.natsl_softmax(q, k, v, routes, block, scale)


@_operator
def natsl_gdn(q, k, v, g, beta, routes, block, scale=None, reference=False):
    """NAtS-L GDN branch: blocks routed to GDN (routes == 1) are committed to the state; every block
    reads the committed state plus its own writes. Block-parallel, or token-recurrent with
    reference. Returns (o, the committed state after the last block)."""
    return _kvx.natsl_gdn(q, k, v, g, beta, routes, block, scale, reference)


@_operator
def nectar_exact(q, doc_k, doc_v):
    """A document's exact response (Nectar, seed Eq. 3.1) for rotated queries q [B, H, T, d] against
    its post-RoPE keys/values [B or 1, Hkv, n, d]: (log_mass alpha [B, H, T], content A [B, H, T, d])."""
    return _kvx.nectar_exact(q, doc_k, doc_v)


@_operator
def nectar_compose(q, local_k, local_v, log_mass, content, q_start=0):
    """Causal attention over local keys/values with the document as one extra logit/value pair
    (seed Eqs. 3.4-3.5). local_k/local_v None: the document alone."""
    return _kvx.nectar_compose(q, local_k, local_v, log_mass, content, q_start)


class LlaCodec:
    """One LLA codec part: mu [G, W], down [G, W, r], up [G, W, r]; encode x [..., G, W] -> codes
    [..., G, r] = (x - mu) down, decode codes -> codes up^T + mu."""

    def __init__(self, mu, down, up):
        self._c = _kvx.LlaCodec(_numpy(mu), _numpy(down), _numpy(up))

    rank = property(lambda self: self._c.rank)
    groups = property(lambda self: self._c.groups)
    width = property(lambda self: self._c.width)

    def encode(self, x):
        return _like(x, self._c.encode(_numpy(x)))

    def decode(self, codes):
        return _like(codes, self._c.decode(_numpy(codes)))


class LlaStore:
    """One layer's LLA decode store (SPEC 1.3): each chunk of tokens runs its `loops` loops with its
    own K/V exact (set_pending per loop, attend per loop), then commit() encodes the chunk's stacked
    K/V as codes; later reads rebuild history keys from the codes tile by tile in the fused kernel
    (absorbed: scored in code space without RoPE). Optional sink + window eviction."""

    def __init__(self, keys, values, loops, kv_heads, head_dim, two_d=False, absorbed=False, sink=0, window=0,
                 rope_theta=10000.0, threads=0):
        self._s = _kvx.LlaStore(keys._c, values._c, loops, kv_heads, head_dim, two_d, absorbed, sink, window,
                                rope_theta, threads)

    committed = property(lambda self: self._s.committed)
    bytes = property(lambda self: self._s.bytes)

    def set_pending(self, loop, k, v):
        """Loop `loop`'s keys (before RoPE: codes hold unrotated keys) and values of the chunk in flight, [B, Hkv, n, d]."""
        self._s.set_pending(loop, _numpy(k), _numpy(v))

    def commit(self):
        self._s.commit()

    def attend(self, loop, q, k, v, q_pre=None):
        """Loop `loop`'s attention for the chunk through the fused kernel: q [B, H, n, d] (RoPE applied,
        at positions committed .. committed + n - 1) over the history rebuilt from the codes and the
        chunk's own k (RoPE applied), v [B, Hkv, n, d], causally. An absorbed store also needs q_pre,
        q before RoPE. The plain reference is history() with causal_attention (tests/python)."""
        return _like([q, k, v, q_pre], self._s.attend(loop, _numpy(q), _numpy(k), _numpy(v), _numpy(q_pre)))

    def history(self, loop):
        """Loop `loop`'s reconstructed history (k^, v^) [B, Hkv, committed, d] as NumPy, k^ before RoPE."""
        return self._s.history(loop)
