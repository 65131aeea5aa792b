"""kvx from Python: load, train, generate, evaluate and compare models with smaller KV caches,
and call kvx's attention operators (kvx.ops) on NumPy arrays or torch tensors.

    import kvx
    m = kvx.load("runs/compare/arms/<key>")
    print(m.generate("And it came to pass", max_new=20, temperature=0))
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep instead of spinning

from . import _kvx  # noqa: E402
from ._kvx import KvxError  # noqa: E402
from . import ops  # noqa: E402
from .ops import _numpy  # noqa: E402

__all__ = ["KvxError", "Tokenizer", "Model", "load", "train", "preset", "presets", "experiment", "experiments", "compare",
           "import_hf", "export_hf", "ops"]


def _names(x):
    """A name or a sequence of names -> a list of names."""
    return [x] if isinstance(x, str) else list(x)


def _ids(ids):
    return [int(i) for i in _numpy(ids).reshape(-1)] if not isinstance(ids, (list, tuple)) else [int(i) for i in ids]


class Tokenizer:
    """A byte-level BPE tokenizer.json: kvx's own, or a Hugging Face model's (merges, added and special
    tokens, the GPT-2 / Llama 3 / Qwen2 split patterns, NFC)."""

    def __init__(self, path_or_native):
        self._t = path_or_native if isinstance(path_or_native, _kvx.Tokenizer) else _kvx.Tokenizer(os.fspath(path_or_native))

    @staticmethod
    def train(vocab, sources=("brown", "kjv"), data_dir=None):
        """A BPE of `vocab` tokens (the 256 bytes included) on the corpora's training split."""
        return Tokenizer(_kvx.Tokenizer.train(vocab, _names(sources), os.fspath(data_dir) if data_dir else ""))

    @property
    def vocab_size(self):
        return self._t.vocab_size

    def encode(self, text, add_special_tokens=False):
        """Token ids of text. add_special_tokens=True also adds what tokenizer.json's post_processor
        puts around one sequence (Llama 3's <|begin_of_text|> before it); the default is False, unlike
        HF's True. generate() puts the tokens before a sequence in front of its prompt."""
        return self._t.encode(text, add_special_tokens)

    def decode(self, ids):
        return self._t.decode(_ids(ids)).decode("utf-8", errors="replace")

    def save(self, path):
        self._t.save(os.fspath(path))

    def to_json(self):
        return self._t.to_json()


class Model:
    """A kvx model directory (or a run directory: its latest checkpoint) and its tokenizer."""

    def __init__(self, path):
        self._m = _kvx.Model(os.fspath(path))
        self._tokenizer = Tokenizer(self._m.tokenizer)

    @property
    def dir(self):
        return self._m.dir

    @property
    def config(self):
        """The model config as a dict (the `model` section of a run config)."""
        return self._m.config

    @property
    def parameters(self):
        return self._m.parameters

    def kv_bytes_per_token(self, kv_cache="f32"):
        """Decode-cache bytes per token, all layers, for a cache element type (f32, bf16, q8, q4)."""
        return self._m.kv_bytes_per_token(kv_cache)

    @property
    def tokenizer(self):
        return self._tokenizer

    def encode(self, text, add_special_tokens=False):
        """Token ids of text (Tokenizer.encode). generate() also puts the post_processor's leading
        tokens (Llama 3's BOS) before its prompt (not after a document module); for a template with
        tokens only before the text, add_special_tokens=True gives logits() the same ids."""
        return self._tokenizer.encode(text, add_special_tokens)

    def decode(self, ids):
        return self._tokenizer.decode(ids)

    def logits(self, ids):
        """Next-token logits [n, vocab] of a token sequence (a list, array or tensor of ids)."""
        out = self._m.logits(_ids(ids))
        return ops._like(ids, out)

    def generate(self, prompt, max_new=100, temperature=0.8, top_p=0.95, seed=0, kv_cache="f32", evict=None,
                 reference=False, lla=None, lla_absorbed=False, share_kv_layers=1, document_module=None,
                 return_stats=False, stream=None):
        """Continue `prompt` through the decode cache (temperature 0: greedy). Returns the text, or
        with return_stats a dict: text, tokens, prompt_tokens, prefill/decode seconds, cache bytes.
        stream: a callable given each new piece of text as it is generated (pieces split inside a
        UTF-8 character arrive whole with the next one)."""
        r = _kvx.GenerateRequest()
        r.prompt, r.max_new, r.temperature, r.top_p, r.seed = prompt, max_new, temperature, top_p, seed
        r.kv_cache, r.evict, r.reference = kv_cache, evict or "", reference
        r.lla, r.lla_absorbed, r.share_kv_layers = os.fspath(lla) if lla else "", lla_absorbed, share_kv_layers
        r.document_module = os.fspath(document_module) if document_module else ""
        on_piece = None
        if stream is not None:
            pending = bytearray()

            def on_piece(piece):
                pending.extend(piece)
                try:
                    text = pending.decode("utf-8")
                except UnicodeDecodeError as e:
                    if e.reason != "unexpected end of data":
                        text = pending.decode("utf-8", errors="replace")
                    else:
                        return  # a character continues in the next token
                pending.clear()
                stream(text)
        out = self._m.generate(r, on_piece)
        if stream is not None and pending:
            stream(pending.decode("utf-8", errors="replace"))
        out["text"] = out["text"].decode("utf-8", errors="replace")
        return out if return_stats else out["text"]

    def eval(self, split="test", seq_len=0, max_windows=0, batch=8, sources="brown,kjv", data_dir=None,
             kv_cache=None, evict=None, lla=None, lla_absorbed=False, share_kv_layers=1, mqar=None,
             mqar_symbols=0, mqar_sequences=64, document_module=None, document=None):
        """What `kvx eval --json` reports: cross-entropy, perplexity, bits/byte, the unigram baseline
        (each window starts with the tokenizer's leading special tokens, `window_prefix`: an imported
        Llama 3's BOS; none for a kvx tokenizer); through a decode cache (kv_cache/evict/lla/share_kv_layers) CE and KL vs f32; MQAR accuracy;
        or a Nectar document module's report (with document_module, the other options stay at their defaults;
        document without document_module is an error)."""
        r = _kvx.EvalRequest()
        r.split, r.seq_len, r.max_windows, r.batch = split, seq_len, max_windows, batch
        r.sources = ",".join(_names(sources))
        r.data_dir = os.fspath(data_dir) if data_dir else ""
        r.kv_cache, r.evict = kv_cache or "", evict or ""
        r.lla, r.lla_absorbed, r.share_kv_layers = os.fspath(lla) if lla else "", lla_absorbed, share_kv_layers
        if mqar:
            r.mqar = mqar if isinstance(mqar, str) else ",".join(str(p) for p in mqar)
        r.mqar_symbols, r.mqar_sequences = mqar_symbols, mqar_sequences
        r.document_module = os.fspath(document_module) if document_module else ""
        r.document = os.fspath(document) if document else ""
        return self._m.evaluate(r)

    def __repr__(self):
        c = self.config
        return (f"kvx.Model({self.dir!r}: {c['num_hidden_layers']} layers, d {c['hidden_size']}, "
                f"{c['num_attention_heads']} heads, {self.parameters} parameters)")


def load(path):
    """A trained model: a model directory or a run directory (its latest checkpoint)."""
    return Model(path)


def preset(name="tiny"):
    """A built-in run config as a dict (what `kvx train --preset NAME --print-config` prints)."""
    return _kvx.preset(name)


def presets():
    return _kvx.presets()


def train(out, preset="tiny", patch=None, resume=False):
    """Train a run config (a preset changed by a JSON merge patch, e.g.
    {"train": {"steps": 50}, "model": {"num_key_value_heads": 2}}) into `out`; atomic checkpoints,
    resumable. Returns the summary; summary["model"] is the trained model's directory."""
    return _kvx.train(os.fspath(out), preset, patch, resume)


def experiments():
    return _kvx.experiments()


def experiment(name, preset="tiny", patch=None, arms=(), document=None):
    """A built-in comparison experiment as a dict: its base run config, evaluation settings,
    metric groups and arms, after an optional merge patch and arm selection."""
    return _kvx.experiment(name, preset, patch, _names(arms), os.fspath(document) if document else "")


def compare(name, preset="tiny", patch=None, arms=(), document=None, out_dir="runs/compare", data_dir=None,
            verbose=True):
    """Run a comparison experiment (what `kvx compare NAME` runs): trains or reuses each arm, computes
    its metrics (cached by content hash), writes report.md and plots under out_dir. Returns
    results.json's content plus "report" (the markdown table) and "dir"."""
    return _kvx.compare(name, preset, patch, _names(arms), os.fspath(document) if document else "",
                        os.fspath(out_dir), os.fspath(data_dir) if data_dir else "", verbose)


def import_hf(hf_dir, out):
    """A Hugging Face Llama, Qwen3 or Ouro (looped) directory -> a kvx model directory; returns the loaded model."""
    _kvx.import_hf(os.fspath(hf_dir), os.fspath(out))
    return Model(out)


def export_hf(model, out, dtype="f32"):
    """A kvx dense model (a Model or a directory) -> a Hugging Face directory (f32, bf16 or f16)."""
    _kvx.export_hf(model.dir if isinstance(model, Model) else os.fspath(model), os.fspath(out), dtype)
