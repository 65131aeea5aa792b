# Every kvx.ops operator against a plain NumPy reference written here (fp64 where the operator
# keeps it), on odd sizes and random inputs; torch tensors in give torch tensors out.
import json
import numpy as np
import pytest
import torch

import kvx
from kvx import ops

rng = np.random.default_rng(7)


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def softmax_attend(q, k, v, scale):
    """q [H, d], k [L, Hkv, d], v [L, Hkv, dv] -> [H, dv] in fp64."""
    H, Hkv = q.shape[0], k.shape[1]
    out = []
    for h in range(H):
        kh, vh = k[:, h // (H // Hkv)].astype(np.float64), v[:, h // (H // Hkv)].astype(np.float64)
        s = scale * kh @ q[h].astype(np.float64)
        a = np.exp(s - s.max())
        out.append(a @ vh / a.sum())
    return np.stack(out)


def causal_reference(q, k, v, q_start=0):
    """q [B, H, T, d], k/v [B, Hkv, Tk, d] -> [B, H, T, dv], fp64, query i at position q_start + i."""
    B, H, T, d = q.shape
    Hkv = k.shape[1]
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for b in range(B):
        for h in range(H):
            for i in range(T):
                n = q_start + i + 1
                s = k[b, h // (H // Hkv), :n] @ q[b, h, i] / np.sqrt(d)
                a = np.exp(s - s.max())
                out[b, h, i] = a @ v[b, h // (H // Hkv), :n] / a.sum()
    return out


def rope_reference(x, start, theta=10000.0):
    d = x.shape[-1]
    pos = np.arange(start, start + x.shape[-2])[:, None]
    inv = theta ** (-2.0 * np.arange(d // 2) / d)
    ang = pos * inv
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("length", [1, 37])
def test_decode_attention_matches_numpy(heads, kv_heads, length):
    q, k, v = randn(heads, 32), randn(length, kv_heads, 32), randn(length, kv_heads, 32)
    want = softmax_attend(q, k, v, 1 / np.sqrt(32))
    for reference in (False, True):
        got = ops.decode_attention(q, k, v, reference=reference)
        assert got.shape == (heads, 32) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache", ["bf16", "q8", "q4"])
def test_decode_attention_quantized_matches_its_reference(cache):
    q, k, v = randn(4, 64), randn(45, 2, 64), randn(45, 2, 64)
    fused = ops.decode_attention(q, k, v, kv_cache=cache)
    ref = ops.decode_attention(q, k, v, kv_cache=cache, reference=True)
    # The kernels round the query for the cache (round_query: int8 blocks for q8/q4, llama.cpp style;
    # bf16 for bf16) and the plain reference does not: about the cache's own error on the keys.
    tol = 2e-2 if cache in ("q8", "q4") else 1e-2
    np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol)
    exact = softmax_attend(q, k, v, 1 / 8)
    assert np.abs(fused - exact).max() < {"bf16": 0.02, "q8": 0.05, "q4": 0.3}[cache]


def test_decode_attention_eviction_and_extra_pair():
    q, k, v = randn(4, 32), randn(20, 2, 32), randn(20, 2, 32)
    kept = list(range(3)) + list(range(13, 20))  # sink 3, window 7
    want = softmax_attend(q, k[kept], v[kept], 0.2)
    np.testing.assert_allclose(ops.decode_attention(q, k, v, scale=0.2, sink=3, window=7), want, rtol=1e-4, atol=1e-5)
    # The extra pair is one more row per head with a given logit (Nectar's document).
    logit, value = randn(4), randn(4, 32)
    s = np.stack([0.2 * k[:, h // 2].astype(np.float64) @ q[h] for h in range(4)])  # [H, L]
    full = np.concatenate([s, logit[:, None]], 1)
    a = np.exp(full - full.max(1, keepdims=True))
    a /= a.sum(1, keepdims=True)
    want = np.stack([a[h, :-1] @ v[:, h // 2] + a[h, -1] * value[h] for h in range(4)])
    for reference in (False, True):
        got = ops.decode_attention(q, k, v, scale=0.2, extra_logit=logit, extra_value=value, reference=reference)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    alone = ops.decode_attention(q, k[:0], v[:0], extra_logit=logit, extra_value=value)
    np.testing.assert_allclose(alone, value, rtol=1e-6)


def test_decode_attention_errors_name_the_problem():
    with pytest.raises(kvx.KvxError, match="multiple of k's 4 KV heads"):
        ops.decode_attention(randn(6, 32), randn(5, 4, 32), randn(5, 4, 32))
    with pytest.raises(kvx.KvxError, match="v must be"):
        ops.decode_attention(randn(4, 32), randn(5, 4, 32), randn(6, 4, 32))
    with pytest.raises(kvx.KvxError, match="f32"):
        ops.decode_attention(randn(4, 32), randn(5, 4, 32), randn(5, 4, 32), kv_cache="int3")
    with pytest.raises(kvx.KvxError, match="no tokens"):
        ops.decode_attention(randn(4, 32), randn(0, 4, 32), randn(0, 4, 32))
    with pytest.raises(ValueError):  # KvxError is a ValueError
        ops.decode_attention(randn(4, 32), randn(5, 4, 32), randn(5, 4, 32), sink=2)


def test_torch_in_torch_out():
    q, k, v = torch.randn(4, 32), torch.randn(9, 2, 32), torch.randn(9, 2, 32)
    out = ops.decode_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (4, 32)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[None, :, None], k.transpose(0, 1).repeat_interleave(2, 0)[None], v.transpose(0, 1).repeat_interleave(2, 0)[None]
    )[0, :, 0] if hasattr(torch.nn.functional, "scaled_dot_product_attention") else None
    if want is None:
        want = torch.from_numpy(softmax_attend(q.numpy(), k.numpy(), v.numpy(), 1 / np.sqrt(32))).float()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert isinstance(ops.rope(torch.randn(3, 8), 2), torch.Tensor)
    assert isinstance(ops.gdn(*gdn_inputs(1, 2, 5, 4, 3, np.float64))[0], np.ndarray)


@pytest.mark.parametrize("rank", [0, 5, 32])
def test_lrkv_factored_matches_expanded(rank):
    H, d, L = 6, 32, 29
    q, ks, vs = randn(H, d), randn(L, d), randn(L, d)
    if rank == 0:
        out_s, out_r = ops.lrkv_decode(q, None, ks, vs, None, None)
        np.testing.assert_allclose(out_s, softmax_attend(q, ks[:, None], vs[:, None], 1 / np.sqrt(d)), rtol=1e-4, atol=1e-5)
        assert out_r.shape == (H, 0)
        return
    rk, rv, bk, bv = randn(L, H, rank), randn(L, H, rank), 0.3 * randn(H, d, rank), 0.3 * randn(H, d, rank)
    # Expanded per-head keys and values: K_h = K_s + R_h^K B_h^K^T (SPEC 1.1).
    k_full = ks[:, None] + np.einsum("lhr,hdr->lhd", rk, bk)
    v_full = vs[:, None] + np.einsum("lhr,hdr->lhd", rv, bv)
    want = softmax_attend(q, k_full, v_full, 1 / np.sqrt(d))
    for reference in (False, True):
        np.testing.assert_allclose(ops.lrkv_attention(q, ks, vs, rk, rv, bk, bv, reference=reference), want,
                                   rtol=1e-3, atol=1e-4)
    if rank % 32 == 0:  # quantised latents: the fused kernel against the reference over the same blocks
        for cache, tol in (("bf16", 2e-2), ("q8", 2e-2)):  # the kernels round q and qb for the cache (round_query)
            fused = ops.lrkv_attention(q, ks, vs, rk, rv, bk, bv, kv_cache=cache)
            ref = ops.lrkv_attention(q, ks, vs, rk, rv, bk, bv, kv_cache=cache, reference=True)
            np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol)
            assert np.abs(fused - want).max() < 0.1
    with pytest.raises(kvx.KvxError, match="multiple of 32"):
        ops.lrkv_decode(q, randn(H, 8), ks, vs, randn(L, H, 8), randn(L, H, 8), kv_cache="q8")


@pytest.mark.parametrize("cache", ["q8", "q4"])
def test_lrkv_quantised_latents_that_straddle_heads(cache):
    # H r = 32: one q8/q4 block holds all 8 heads' latents, scored per head segment by the fused kernel
    H, d, L, rank = 8, 32, 45, 4
    q, ks, vs = randn(H, d), randn(L, d), randn(L, d)
    rk, rv, bk, bv = randn(L, H, rank), randn(L, H, rank), 0.3 * randn(H, d, rank), 0.3 * randn(H, d, rank)
    fused = ops.lrkv_attention(q, ks, vs, rk, rv, bk, bv, kv_cache=cache)
    ref = ops.lrkv_attention(q, ks, vs, rk, rv, bk, bv, kv_cache=cache, reference=True)
    np.testing.assert_allclose(fused, ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(kvx.KvxError, match="exceeds head_dim"):
        big = d + 1
        ops.lrkv_decode(q, randn(H, big), ks, vs, randn(L, H, big), randn(L, H, big))


def test_mla_absorbed_matches_expanded():
    H, d_h, d_r, d_c, L = 4, 16, 8, 24, 13
    qn, qr, c, kr = randn(H, d_h), randn(H, d_r), randn(L, d_c), randn(L, d_r)
    w_uk, w_uv = 0.3 * randn(H, d_h, d_c), 0.3 * randn(H, d_h, d_c)
    # Expanded: k_h = [W_UK,h c | k_R], v_h = W_UV,h c, one query per head of width d_h + d_R.
    out = []
    for h in range(H):
        k = np.concatenate([c @ w_uk[h].T, kr], 1).astype(np.float64)
        v = (c @ w_uv[h].T).astype(np.float64)
        s = k @ np.concatenate([qn[h], qr[h]]) / np.sqrt(d_h + d_r)
        a = np.exp(s - s.max())
        out.append(a @ v / a.sum())
    for reference in (False, True):
        np.testing.assert_allclose(ops.mla_attention(qn, qr, c, kr, w_uk, w_uv, reference=reference), np.stack(out),
                                   rtol=1e-3, atol=1e-4)
    with pytest.raises(kvx.KvxError, match="scale"):
        ops.mla_decode(randn(H, d_c + d_r), randn(L, d_c + d_r), None)


def test_causal_attention_and_rope_fp64():
    q, k, v = randn(2, 6, 5, 8, dtype=np.float64), randn(2, 3, 9, 8, dtype=np.float64), randn(2, 3, 9, 7, dtype=np.float64)
    got = ops.causal_attention(q, k, v, q_start=4)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, causal_reference(q, k, v, 4), rtol=1e-12, atol=1e-12)
    x = randn(3, 7, 10, dtype=np.float64)
    np.testing.assert_allclose(ops.rope(x, 5, 500.0), rope_reference(x, 5, 500.0), rtol=1e-12, atol=1e-12)
    with pytest.raises(kvx.KvxError, match="need that many keys"):
        ops.causal_attention(q, k, v, q_start=5)


def gdn_inputs(B, H, T, K, V, dtype):
    q = ops.l2_normalize(randn(B, H, T, K, dtype=dtype))
    k = ops.l2_normalize(randn(B, H, T, K, dtype=dtype))
    v = randn(B, H, T, V, dtype=dtype)
    g = -np.abs(randn(B, H, T, dtype=dtype)) * 0.3
    beta = 1 / (1 + np.exp(-randn(B, H, T, dtype=dtype)))
    return q, k, v, g, beta


def gdn_reference(q, k, v, g, beta, scale, state=None):
    B, H, T, K = q.shape
    S = np.zeros((B, H, K, v.shape[3])) if state is None else state.copy()
    o = np.zeros(v.shape)
    for t in range(T):
        S = np.exp(g[:, :, t])[..., None, None] * S
        u = beta[:, :, t, None] * (v[:, :, t] - np.einsum("bhkv,bhk->bhv", S, k[:, :, t]))
        S = S + np.einsum("bhk,bhv->bhkv", k[:, :, t], u)
        o[:, :, t] = np.einsum("bhkv,bhk->bhv", S, scale * q[:, :, t])
    return o, S


def test_gdn_forms_agree_with_numpy():
    q, k, v, g, beta = gdn_inputs(2, 3, 11, 6, 5, np.float64)
    want_o, want_s = gdn_reference(q, k, v, g, beta, 0.4)
    for form, chunk in [("recurrent", 64), ("chunked", 4), ("chunked", 64)]:
        o, s = ops.gdn(q, k, v, g, beta, scale=0.4, form=form, chunk=chunk)
        np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(s, want_s, rtol=1e-10, atol=1e-10)
    o, s = ops.gdn(q, k, v, g, beta, scale=0.4, form="fused")
    np.testing.assert_allclose(o, want_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-4, atol=1e-5)
    # The state carries over: two calls equal one.
    o1, s1 = ops.gdn(q[:, :, :4], k[:, :, :4], v[:, :, :4], g[:, :, :4], beta[:, :, :4], scale=0.4)
    o2, s2 = ops.gdn(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], g[:, :, 4:], beta[:, :, 4:], scale=0.4, state=s1)
    np.testing.assert_allclose(np.concatenate([o1, o2], 2), want_o, rtol=1e-10, atol=1e-10)
    with pytest.raises(kvx.KvxError, match="unknown GDN form"):
        ops.gdn(q, k, v, g, beta, form="parallel")
    with pytest.raises(kvx.KvxError, match="g must be"):
        ops.gdn(q, k, v, g[:, :, :3], beta)


def test_natsl_routes_budget_and_branches():
    probs = np.zeros((1, 6, 2, 2))
    probs[..., 0] = 0.9  # every block prefers softmax KV
    probs[..., 1] = 0.1
    routes = ops.natsl_routes(probs, fraction=0.5)
    np.testing.assert_array_equal(routes.sum(1)[0], [3, 3])  # half the blocks over budget go to GDN
    np.testing.assert_array_equal(ops.natsl_routes(probs, max_blocks=2).sum(1)[0], [4, 4])
    assert ops.natsl_routes(probs, last_forced=True)[0, -1].tolist() == [1, 1]
    # All blocks softmax: plain causal attention.
    q, k, v = randn(1, 2, 10, 4, dtype=np.float64), randn(1, 2, 10, 4, dtype=np.float64), randn(1, 2, 10, 3, dtype=np.float64)
    keep_all = np.zeros((1, 4, 2), dtype=np.int64)
    np.testing.assert_allclose(ops.natsl_softmax(q, k, v, keep_all, block=3), causal_reference(q, k, v), rtol=1e-10,
                               atol=1e-10)
    # A block routed to GDN is hidden from later blocks' softmax; its own block still sees it.
    routes = np.array([[[1, 0], [0, 0], [0, 1], [0, 0]]], dtype=np.int64)
    got = ops.natsl_softmax(q, k, v, routes, block=3)
    want = causal_reference(q, k, v)
    np.testing.assert_allclose(got[:, :, :3], want[:, :, :3], rtol=1e-10, atol=1e-10)
    kept = [3, 4, 5]
    for t in range(3, 6):
        visible = kept[: t - 2]
        s = k[0, 0, visible] @ q[0, 0, t] / 2
        a = np.exp(s - s.max())
        np.testing.assert_allclose(got[0, 0, t], a @ v[0, 0, visible] / a.sum(), rtol=1e-10, atol=1e-10)
    # Head 1 keeps blocks 0 and 1 but not 2: block 3's queries see blocks 0, 1 and their own.
    np.testing.assert_allclose(got[:, 1, :9], want[:, 1, :9], rtol=1e-10, atol=1e-10)
    visible = [0, 1, 2, 3, 4, 5, 9]
    s = k[0, 1, visible] @ q[0, 1, 9] / 2
    a = np.exp(s - s.max())
    np.testing.assert_allclose(got[0, 1, 9], a @ v[0, 1, visible] / a.sum(), rtol=1e-10, atol=1e-10)
    with pytest.raises(kvx.KvxError, match="routes must be"):
        ops.natsl_softmax(q, k, v, np.zeros((1, 4, 0), dtype=np.int64), block=3)
    # GDN branch: every block committed is plain GDN; blocks and the recurrent reference agree.
    qg, kg, vg, gg, bg = gdn_inputs(1, 2, 10, 4, 3, np.float64)
    all_gdn = np.ones((1, 4, 2), dtype=np.int64)
    o, s = ops.natsl_gdn(qg, kg, vg, gg, bg, all_gdn, block=3, scale=0.5)
    want_o, want_s = gdn_reference(qg, kg, vg, gg, bg, 0.5)
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(s, want_s, rtol=1e-10, atol=1e-10)
    mixed = np.array([[[1, 0], [0, 1], [1, 1], [0, 0]]], dtype=np.int64)
    ob, sb = ops.natsl_gdn(qg, kg, vg, gg, bg, mixed, block=3, scale=0.5)
    orf, srf = ops.natsl_gdn(qg, kg, vg, gg, bg, mixed, block=3, scale=0.5, reference=True)
    np.testing.assert_allclose(ob, orf, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(sb, srf, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_nectar_split_and_composition_equal_full_attention(heads, kv_heads):
    n, m, d = 7, 5, 8
    doc_k, doc_v = randn(1, kv_heads, n, d, dtype=np.float64), randn(1, kv_heads, n, d, dtype=np.float64)
    loc_k, loc_v = randn(1, kv_heads, m, d, dtype=np.float64), randn(1, kv_heads, m, d, dtype=np.float64)
    q = randn(1, heads, 3, d, dtype=np.float64)  # local positions 2, 3, 4
    alpha, content = ops.nectar_exact(q, doc_k, doc_v)
    got = ops.nectar_compose(q, loc_k, loc_v, alpha, content, q_start=2)
    full = causal_reference(q, np.concatenate([doc_k, loc_k], 2), np.concatenate([doc_v, loc_v], 2), q_start=n + 2)
    np.testing.assert_allclose(got, full, rtol=1e-10, atol=1e-10)
    s = np.einsum("bhtd,bhnd->bhtn", q, np.repeat(doc_k, heads // kv_heads, 1)) / np.sqrt(d)
    np.testing.assert_allclose(alpha, np.log(np.exp(s).sum(-1)), rtol=1e-10)
    alone = ops.nectar_compose(q, None, None, alpha, content)
    np.testing.assert_allclose(alone, content, rtol=1e-12)
    with pytest.raises(kvx.KvxError, match="document is empty"):
        ops.nectar_exact(q, doc_k[:, :, :0], doc_v[:, :, :0])


def test_tokenizer_and_listing_bindings(tmp_path):
    assert set(kvx.experiments()) >= {"arch", "posthoc", "decode", "doc"}
    tok = kvx.Tokenizer.train(256)  # bytes only: no merges
    assert tok.encode("Ab") == [65, 98] and tok.vocab_size == 256
    tok.save(tmp_path / "t.json")
    assert kvx.Tokenizer(tmp_path / "t.json").encode("héllo") == tok.encode("héllo")
    assert tok.decode(tok.encode("héllo")) == "héllo"
    with pytest.raises(kvx.KvxError, match="outside the vocabulary"):
        tok.decode([300])
    # a post_processor's tokens (Llama 3's BOS) only with add_special_tokens=True
    j = json.loads(tok.to_json())
    j["added_tokens"] = [{"id": 256, "content": "<|begin_of_text|>", "special": True}]
    j["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<|begin_of_text|>"}}, {"Sequence": {"id": "A"}}],
                           "special_tokens": {"<|begin_of_text|>": {"ids": [256]}}}
    (tmp_path / "bos.json").write_text(json.dumps(j))
    bos = kvx.Tokenizer(tmp_path / "bos.json")
    assert bos.encode("Ab") == [65, 98] and bos.encode("Ab", add_special_tokens=True) == [256, 65, 98]


def test_lla_codec_roundtrip_and_encode():
    G, W, r = 2, 12, 12
    mu = randn(G, W, dtype=np.float64)
    basis = np.stack([np.linalg.qr(randn(W, W, dtype=np.float64))[0] for _ in range(G)])
    codec = ops.LlaCodec(mu, basis, basis)  # full rank, orthonormal: exact
    x = randn(3, 5, G, W, dtype=np.float64)
    codes = codec.encode(x)
    np.testing.assert_allclose(codes, np.einsum("btgw,gwr->btgr", x - mu, basis), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(codec.decode(codes), x, rtol=1e-10, atol=1e-10)
    low = ops.LlaCodec(mu, basis[:, :, :4], basis[:, :, :4])
    assert low.rank == 4 and low.encode(x).shape == (3, 5, G, 4)
    with pytest.raises(kvx.KvxError, match="groups"):
        codec.encode(randn(3, G + 1, W))


@pytest.mark.parametrize("two_d", [False, True])
def test_lla_store_reads_match_reconstructed_attention(two_d):
    loops, Hkv, H, d, r = 2, 2, 4, 32, 24
    G, W = (1, loops * d * Hkv) if two_d else (Hkv, loops * d)
    keys = ops.LlaCodec(0.1 * randn(G, W), 0.2 * randn(G, W, r), 0.2 * randn(G, W, r))
    values = ops.LlaCodec(0.1 * randn(G, W), 0.2 * randn(G, W, r), 0.2 * randn(G, W, r))
    store = ops.LlaStore(keys, values, loops, Hkv, d, two_d=two_d)
    # Chunk 1: 5 tokens, both loops, committed as codes.
    for t in range(loops):
        store.set_pending(t, randn(1, Hkv, 5, d), randn(1, Hkv, 5, d))
    store.commit()
    assert store.committed == 5 and store.bytes == 4 * G * 2 * r * 5
    # Chunk 2: 3 tokens at positions 5..7; loop 1 reads history reconstructed for loop 1.
    q_pre, k_pre, v = randn(1, H, 3, d), randn(1, Hkv, 3, d), randn(1, Hkv, 3, d)
    q, k = ops.rope(q_pre, 5), ops.rope(k_pre, 5)
    store.set_pending(0, k_pre, v)
    got = store.attend(1, q, k, v)
    hk, hv = store.history(1)
    keys_all = np.concatenate([rope_reference(hk.astype(np.float64), 0), k], 2)
    vals_all = np.concatenate([hv, v], 2)
    want = causal_reference(q.astype(np.float64), keys_all, vals_all.astype(np.float64), q_start=5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(kvx.KvxError, match="needs"):
        ops.LlaStore(keys, values, loops + 1, Hkv, d, two_d=two_d)


def attend_masked(q, keys, vals, visible, scale):
    """q [B, H, n, d], keys/vals [B, Hkv, L, d] fp64, visible[i]: the key indices query i sees;
    scale: a number, or scores(h, i) giving query (h, i)'s scaled scores over its visible keys."""
    B, H, n, d = q.shape
    G = H // vals.shape[1]
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(H):
            for i in range(n):
                s = scale(h, i) if callable(scale) else keys[b, h // G, visible[i]] @ q[b, h, i] * scale
                a = np.exp(s - s.max())
                out[b, h, i] = a @ vals[b, h // G, visible[i]] / a.sum()
    return out


def test_lla_store_eviction_and_absorbed_reads():
    loops, Hkv, H, d, r = 2, 2, 4, 32, 16
    codec = lambda: ops.LlaCodec(0.1 * randn(Hkv, loops * d), 0.2 * randn(Hkv, loops * d, r), 0.2 * randn(Hkv, loops * d, r))
    keys, values = codec(), codec()
    q_pre, k_pre, v = randn(1, H, 3, d), randn(1, Hkv, 3, d), randn(1, Hkv, 3, d)
    q, k = ops.rope(q_pre, 6), ops.rope(k_pre, 6)
    hist = [(randn(1, Hkv, 6, d), randn(1, Hkv, 6, d)) for _ in range(loops)]
    # Sink 2 + window 4: the query at position 6 + i sees positions 0, 1 and 3 + i .. 6 + i.
    store = ops.LlaStore(keys, values, loops, Hkv, d, sink=2, window=4)
    for t, (hk_in, hv_in) in enumerate(hist):
        store.set_pending(t, hk_in, hv_in)
    store.commit()
    got = store.attend(0, q, k, v)
    full = ops.LlaStore(keys, values, loops, Hkv, d)  # the same codes without eviction, for reference
    for t, (hk_in, hv_in) in enumerate(hist):
        full.set_pending(t, hk_in, hv_in)
    full.commit()
    full_k, full_v = full.history(0)
    keys_all = np.concatenate([rope_reference(full_k.astype(np.float64), 0), k], 2)
    vals_all = np.concatenate([full_v, v], 2).astype(np.float64)
    visible = [[0, 1] + list(range(3 + i, 7 + i)) for i in range(3)]
    want = attend_masked(q.astype(np.float64), keys_all, vals_all, visible, 1 / np.sqrt(d))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Absorbed: history keys scored without RoPE (q_pre . k^), the chunk's own keys exactly.
    absorbed = ops.LlaStore(keys, values, loops, Hkv, d, absorbed=True)
    for t, (hk_in, hv_in) in enumerate(hist):
        absorbed.set_pending(t, hk_in, hv_in)
    absorbed.commit()
    got = absorbed.attend(1, q, k, v, q_pre=q_pre)
    hk1, hv1 = absorbed.history(1)
    vals_all = np.concatenate([hv1, v], 2).astype(np.float64)
    scores = np.zeros((H, 3), dtype=object)
    for h in range(H):
        for i in range(3):
            hist_s = hk1[0, h // 2].astype(np.float64) @ q_pre[0, h, i]
            tail_s = k[0, h // 2, : i + 1].astype(np.float64) @ q[0, h, i]
            scores[h, i] = np.concatenate([hist_s, tail_s]) / np.sqrt(d)
    want = attend_masked(q.astype(np.float64), None, vals_all, [list(range(7 + i)) for i in range(3)],
                         lambda h, i: scores[h, i])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(kvx.KvxError, match="q_pre"):
        absorbed.attend(1, q, k, v)


def test_lla_store_batches_and_refuses_malformed_chunks():
    loops, Hkv, H, d, r = 2, 1, 2, 32, 8
    keys = ops.LlaCodec(0.1 * randn(Hkv, loops * d), 0.2 * randn(Hkv, loops * d, r), 0.2 * randn(Hkv, loops * d, r))
    values = ops.LlaCodec(0.1 * randn(Hkv, loops * d), 0.2 * randn(Hkv, loops * d, r), 0.2 * randn(Hkv, loops * d, r))
    store = ops.LlaStore(keys, values, loops, Hkv, d)
    for t in range(loops):
        store.set_pending(t, randn(2, Hkv, 4, d), randn(2, Hkv, 4, d))
    store.commit()
    q, k, v = randn(2, H, 2, d), randn(2, Hkv, 2, d), randn(2, Hkv, 2, d)
    got = store.attend(1, q, k, v)
    hk, hv = store.history(1)
    for b in range(2):  # each batch row reads its own codes
        want = causal_reference(q[b:b + 1].astype(np.float64),
                                np.concatenate([rope_reference(hk[b:b + 1].astype(np.float64), 0), k[b:b + 1]], 2),
                                np.concatenate([hv[b:b + 1], v[b:b + 1]], 2).astype(np.float64), q_start=4)
        np.testing.assert_allclose(got[b:b + 1], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(kvx.KvxError, match="store batch 2"):
        store.attend(1, q[:1], k[:1], v[:1])
    with pytest.raises(kvx.KvxError, match="LLA read"):
        store.attend(1, q, k, v[:, :, :1])
    with pytest.raises(kvx.KvxError, match="outside the model's 2 loops"):
        store.attend(2, q, k, v)
    with pytest.raises(kvx.KvxError, match="outside the model's 2 loops"):
        store.history(-1)
    with pytest.raises(kvx.KvxError, match="both the same"):
        store.set_pending(0, randn(2, Hkv, 3, d), randn(2, Hkv, 2, d))
    with pytest.raises(kvx.KvxError, match="batch 1"):
        store.set_pending(1, randn(1, Hkv, 3, d), randn(1, Hkv, 3, d))
    store.set_pending(0, randn(2, Hkv, 3, d), randn(2, Hkv, 3, d))
    with pytest.raises(kvx.KvxError, match="same tokens"):
        store.set_pending(1, randn(2, Hkv, 2, d), randn(2, Hkv, 2, d))
    absorbed = ops.LlaStore(keys, values, loops, Hkv, d, absorbed=True)
    with pytest.raises(kvx.KvxError, match="q_pre"):
        absorbed.attend(0, q, k, v, q_pre=q[:, :, :1])
    with pytest.raises(kvx.KvxError, match="even head_dim"):
        ops.LlaStore(keys, values, loops, 0, d)


def test_integer_and_list_inputs_are_floats():
    q = [[1, 0], [0, 1]]
    k = [[[1, 0]], [[0, 1]]]
    v = [[[2, 0]], [[0, 4]]]
    out = ops.decode_attention(np.array(q, dtype=np.float32), np.array(k, dtype=np.float32), np.array(v, dtype=np.float32))
    np.testing.assert_allclose(ops.decode_attention(q, k, v), out)
    np.testing.assert_allclose(ops.rope(np.ones((2, 4), dtype=np.int64), 1), rope_reference(np.ones((2, 4)), 1), rtol=1e-6)
    with pytest.raises(kvx.KvxError, match="at least one head"):
        ops.decode_attention(np.zeros((0, 32)), randn(3, 1, 32), randn(3, 1, 32))
