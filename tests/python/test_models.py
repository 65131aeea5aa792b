# Models from Python: train, load, logits, generate, eval, HF interchange and the compare runner,
# each checked against another path to the same number.
import json

import numpy as np
import pytest
import torch

import kvx
from conftest import MICRO


def test_train_writes_a_resumable_run(micro_run, tmp_path):
    out, summary = micro_run
    assert summary["step"] == 6 and np.isfinite(summary["val_cross_entropy"])
    assert summary["model"].startswith(str(out))
    # Resuming a finished run trains nothing more and reports the same step.
    again = kvx.train(out, "tiny", MICRO, resume=True)
    assert again["step"] == 6
    with pytest.raises(kvx.KvxError, match="num_hidden_layers|layers"):
        kvx.train(tmp_path / "bad", "tiny", {"model": {"num_hidden_layers": 0}})
    with pytest.raises(kvx.KvxError, match="finite numbers only"):  # json.dumps wrote NaN, which nlohmann refused raw
        kvx.train(tmp_path / "nan", "tiny", {"train": {"lr": float("nan")}})
    with pytest.raises(kvx.KvxError, match="tiny"):
        kvx.preset("no-such-preset")
    assert "tiny" in kvx.presets() and kvx.preset("tiny")["model"]["hidden_size"] > 0


def test_load_config_tokenizer(micro_model):
    assert micro_model.config["num_key_value_heads"] == 2
    assert micro_model.parameters > 0
    # 2 (K, V) x 2 layers x 2 KV heads x 32 x 4 bytes; q8: 34 bytes per 32 values.
    assert micro_model.kv_bytes_per_token() == 2 * 2 * 2 * 32 * 4
    assert micro_model.kv_bytes_per_token("q8") == 2 * 2 * 2 * 34
    ids = micro_model.encode("In the beginning")
    assert micro_model.decode(ids) == "In the beginning"
    assert "2 layers" in repr(micro_model)
    with pytest.raises(kvx.KvxError):
        kvx.load("/nonexistent/kvx-model")


def test_logits_agree_with_greedy_generation(micro_model):
    prompt = "And God said"
    ids = micro_model.encode(prompt)
    logits = micro_model.logits(ids)
    assert logits.shape == (len(ids), 256) and logits.dtype == np.float32
    out = micro_model.generate(prompt, max_new=8, temperature=0, return_stats=True)
    assert len(out["tokens"]) == 8 and out["prompt_tokens"] == len(ids)
    assert out["tokens"][0] == int(logits[-1].argmax())
    # Teacher-forcing the generated tokens gives the same argmax at every step.
    full = micro_model.logits(ids + out["tokens"][:-1])
    assert full[len(ids) - 1:].argmax(-1).tolist() == out["tokens"]
    assert out["text"] == micro_model.decode(out["tokens"])
    # The fused decode path and the libtorch reference produce the same greedy tokens.
    ref = micro_model.generate(prompt, max_new=8, temperature=0, reference=True, return_stats=True)
    assert ref["tokens"] == out["tokens"]
    assert out["cache_bytes"] == (len(ids) + 7) * micro_model.kv_bytes_per_token()
    tl = micro_model.logits(torch.tensor(ids))
    assert isinstance(tl, torch.Tensor) and torch.equal(tl, torch.from_numpy(logits))


def test_generate_options_and_errors(micro_model):
    q8 = micro_model.generate("Jesus wept", max_new=5, kv_cache="q8", evict="sink=2,window=6", return_stats=True)
    assert q8["cache"].startswith("q8") and q8["cache_bytes_per_token"] == micro_model.kv_bytes_per_token("q8")
    assert isinstance(micro_model.generate("Jesus wept", max_new=3, seed=3), str)
    pieces = []
    text = micro_model.generate("Jesus wept", max_new=12, temperature=0, stream=pieces.append)
    assert "".join(pieces) == text and len(pieces) >= 1

    def stop(piece):
        raise KeyboardInterrupt("stop")
    with pytest.raises(KeyboardInterrupt):
        micro_model.generate("Jesus wept", max_new=12, stream=stop)
    # A callback calling back into the same model is refused (it deadlocked), and the model stays usable.
    with pytest.raises(kvx.KvxError, match="called back into the same Model"):
        micro_model.generate("Jesus wept", max_new=3, stream=lambda piece: micro_model.logits([1, 2]))
    assert micro_model.logits([1, 2]).shape[0] == 2
    with pytest.raises(kvx.KvxError, match="prompt is empty"):
        micro_model.generate("", max_new=3)
    with pytest.raises(kvx.KvxError, match="f32"):
        micro_model.generate("x", kv_cache="fp8")
    with pytest.raises(kvx.KvxError, match="context limit"):
        micro_model.logits([1] * 129)
    with pytest.raises(kvx.KvxError, match="outside the vocabulary"):
        micro_model.logits([256])


def test_eval_full_forward_and_decode_cache_agree(micro_model):
    r = micro_model.eval(seq_len=32, max_windows=2, batch=2)
    assert r["tokens"] == 2 * 32  # two windows of 32 predicted tokens
    assert 0 < r["cross_entropy"] < 6 and r["perplexity"] == pytest.approx(np.exp(r["cross_entropy"]), rel=1e-9)
    # The same windows through the fused f32 decode cache, token by token: the same CE.
    cached = micro_model.eval(seq_len=32, max_windows=2, batch=2, kv_cache="f32")
    assert cached["cache"]["cross_entropy"] == pytest.approx(r["cross_entropy"], abs=1e-5)
    assert cached["cache"]["kl_vs_f32"] == pytest.approx(0, abs=1e-6)
    assert cached["cache"]["top1_agreement"] == 1.0
    with pytest.raises(kvx.KvxError, match="batch must be"):
        micro_model.eval(batch=0)
    with pytest.raises(kvx.KvxError, match="pair count"):
        micro_model.eval(seq_len=32, max_windows=1, mqar="1,x")
    mqar = micro_model.eval(seq_len=32, max_windows=1, mqar=[1, 2], mqar_sequences=2)
    assert [p["pairs"] for p in mqar["mqar_accuracy"]] == [1, 2]
    # With a cache: the bytes held per token (eviction keeps 2 + 6 of 32) and MQAR through it too.
    evicted = micro_model.eval(seq_len=32, max_windows=1, kv_cache="f32", evict="sink=2,window=6", mqar=[1, 2],
                               mqar_sequences=2)
    c = evicted["cache"]
    assert c["bytes_per_token"] == micro_model.kv_bytes_per_token()
    assert c["held_bytes_per_token"] == pytest.approx(micro_model.kv_bytes_per_token() * 8 / 32)
    assert [p["pairs"] for p in c["mqar_accuracy"]] == [1, 2]
    exact = micro_model.eval(seq_len=32, max_windows=1, kv_cache="f32", mqar=[1, 2], mqar_sequences=2)
    assert [p["accuracy"] for p in exact["cache"]["mqar_accuracy"]] == [p["accuracy"] for p in mqar["mqar_accuracy"]]
    with pytest.raises(kvx.KvxError, match="pairs and"):  # checked before the cross-entropy runs
        micro_model.eval(seq_len=32, max_windows=1, mqar=[500])
    with pytest.raises(kvx.KvxError, match="context limit"):
        micro_model.eval(seq_len=4096)
    with pytest.raises(kvx.KvxError, match="nothing would be evicted"):  # sink + window >= the windows
        micro_model.eval(seq_len=32, max_windows=1, kv_cache="f32", evict="sink=2,window=30")
    with pytest.raises(kvx.KvxError, match="mqar_sequences must be"):  # an empty MQAR batch crashed the cache
        micro_model.eval(seq_len=32, max_windows=1, kv_cache="q8", mqar=[1], mqar_sequences=0)
    with pytest.raises(kvx.KvxError, match="unknown data source 'bronw'"):  # read as an empty split before
        micro_model.eval(seq_len=32, max_windows=1, sources="bronw")
    with pytest.raises(kvx.KvxError, match="--document is the text of a Nectar module"):
        micro_model.eval(seq_len=32, max_windows=1, document="doc.txt")


def test_hf_export_import_roundtrip(micro_model, tmp_path):
    kvx.export_hf(micro_model, tmp_path / "hf", dtype="f32")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == 2
    back = kvx.import_hf(tmp_path / "hf", tmp_path / "kvx")
    ids = micro_model.encode("the word was with God")
    np.testing.assert_array_equal(back.logits(ids), micro_model.logits(ids))
    kvx.export_hf(micro_model.dir, tmp_path / "hf16", dtype="bf16")
    near = kvx.import_hf(tmp_path / "hf16", tmp_path / "kvx16")
    assert np.abs(near.logits(ids) - micro_model.logits(ids)).max() < 0.1
    with pytest.raises(kvx.KvxError, match="dtype|f32"):
        kvx.export_hf(micro_model, tmp_path / "bad", dtype="f8")


def test_compare_runner(tmp_path):
    patch = {"base": {**{k: v for k, v in MICRO.items() if k != "name"}, "data": {"mqar_max_pairs": 4}},
             "eval": {"test_windows": 2, "long_context_tokens": 64, "mqar_pairs": [1], "mqar_sequences": 2},
             "groups": ["quality"],
             "arms": [{"name": "mha", "kind": "train", "spec": {"model": {"num_key_value_heads": 4}}},
                      {"name": "mqa", "kind": "train", "spec": {"model": {"num_key_value_heads": 1}}},
                      {"name": "mha+q8", "kind": "posthoc", "spec": {"base": "mha", "kv_cache": "q8"}}]}
    e = kvx.experiment("posthoc", "tiny", patch)
    assert [a["name"] for a in e["arms"]] == ["mha", "mqa", "mha+q8"] and e["base"]["train"]["steps"] == 6
    r = kvx.compare("posthoc", "tiny", patch, out_dir=tmp_path, verbose=False)
    metrics = {(row["arm"], row["metric"]): row["value"] for row in r["rows"]}
    full = 2 * 2 * 4 * 32 * 4  # K, V x layers x Hkv x d_h x f32
    assert metrics[("mha", "kv_bytes_per_token")] == full
    assert metrics[("mqa", "kv_bytes_per_token")] == full / 4
    assert metrics[("mha+q8", "kv_bytes_per_token")] == 2 * 2 * 4 * 34
    assert 0 < metrics[("mha", "test_ce")] < 6 and 0 < metrics[("mqa", "test_ce")] < 6  # unigram over bytes: ~5.5
    assert 0 <= metrics[("mha+q8", "kl_vs_reference")] < 0.01 and metrics[("mha+q8", "top1_agreement")] > 0.9
    assert "mqa" in r["report"] and (tmp_path / "posthoc-tiny" / "report.md").exists()
    # A re-run finds every arm cached; only the selected arm (and its base) when arms are given.
    again = kvx.compare("posthoc", "tiny", patch, arms=["mha+q8"], out_dir=tmp_path, verbose=False)
    assert {a["name"] for a in again["arms"]} == {"mha", "mha+q8"}
    with pytest.raises(kvx.KvxError, match="unknown|known"):
        kvx.experiment("posthoc", "tiny", {"no_such_key": 1})


def test_eval_windows_start_with_the_tokenizers_bos(micro_model, tmp_path):
    # An imported model whose tokenizer.json puts a BOS before a sequence (as Llama 3's does) is
    # scored as HF scores text: each window is the BOS then text, the BOS predicting the first token.
    kvx.export_hf(micro_model, tmp_path / "hf", dtype="f32")
    tok_path = tmp_path / "hf" / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "special_tokens": {"<s>": {"id": "<s>", "ids": [10], "tokens": ["<s>"]}}}
    tok_path.write_text(json.dumps(tok))
    bos = kvx.import_hf(tmp_path / "hf", tmp_path / "kvx")
    plain = micro_model.eval(seq_len=32, max_windows=2, batch=2)
    r = bos.eval(seq_len=32, max_windows=2, batch=2, kv_cache="f32")
    assert plain["window_prefix"] == [] and r["window_prefix"] == [10]
    assert r["tokens"] == 2 * 32  # 31 text tokens after the BOS, and the BOS's prediction
    assert r["cross_entropy"] != pytest.approx(plain["cross_entropy"], abs=1e-6)
    assert r["cache"]["cross_entropy"] == pytest.approx(r["cross_entropy"], abs=1e-5)
