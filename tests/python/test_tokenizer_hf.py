# kvx's tokenizer.json BPE against Hugging Face's tokenizers.js (npm @huggingface/tokenizers, an
# independent implementation of the same format): the same ids for every text, for the GPT-2
# ByteLevel pattern, the Llama 3 and Qwen2 Split patterns, the NFC normalizer, added tokens, and
# post-processors (Llama 3's BOS template, RoBERTa's cls/sep) with add_special_tokens on.
import copy
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import tarfile
import unicodedata

import pytest

import kvx

PACKAGE = "@huggingface/tokenizers@0.2.0"
TARBALL = "huggingface-tokenizers-0.2.0.tgz"
SHA256 = "2800014c83b8186b2e4210c20672f1fb65a12cef85d7e95e0f2003e022611b4a"
HERE = pathlib.Path(__file__).resolve().parent

# The Split regexes Llama 3 and Qwen2 tokenizers ship (digits in runs of 1-3, or one at a time).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

TEXTS = [
    "Hello, world! It's 12:45 o'clock, and 1234567 + 89 = 1234656.",
    "  leading spaces\n\n\ttabs\t\tand   runs of   spaces  \n",
    "I'LL SAY IT'S THEIRS; we've, you'd, she'll, they're.",
    "naïve café — “quoted” ‘single’ Ünïcödé façade",
    "日本語のテキストと한국어 텍스트, 中文文本。",
    "emoji 🙂👍🏽 and flags 🇫🇷 with ZWJ 👩‍💻",
    "combining: e\u0301 a\u0308 o\u0302 (NFC composes them)",
    "Ⅻ ½ ٣٤٥ ०१२ — numbers of other scripts",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "a<|im_end|>b <|im_start|> c<|endoftext|",
    "",
    "\n",
    "x" * 300,
]


@pytest.fixture(scope="module")
def tokenizers_js():
    if shutil.which("node") is None:
        pytest.fail("node is missing; scripts/setup.sh installs npm (which brings node)")
    cache = pathlib.Path(os.environ["KVX_DATA_DIR"]) / "npm"
    lib = cache / "package" / "dist" / "tokenizers.mjs"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", PACKAGE, "--silent"], cwd=cache, check=True, capture_output=True, timeout=300)
        digest = hashlib.sha256((cache / TARBALL).read_bytes()).hexdigest()
        assert digest == SHA256, f"{TARBALL}: sha256 {digest}, expected {SHA256}"
        with tarfile.open(cache / TARBALL) as t:
            t.extractall(cache)
    return lib


def corpus_lines(n):
    data = pathlib.Path(os.environ["KVX_DATA_DIR"])
    lines = []
    for source in ("kjv", "brown"):
        files = sorted((data / source).glob("*.txt"))[:3]
        for f in files:
            lines += [line for line in f.read_text().splitlines() if line.strip()][: n // 6]
    return lines


def variants(base):
    v = {"gpt2": base}
    for name, pattern in (("llama3", LLAMA3), ("qwen2", QWEN2)):
        j = copy.deepcopy(base)
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
        v[name] = j
    j = copy.deepcopy(v["qwen2"])
    n = len(j["model"]["vocab"])
    j["normalizer"] = {"type": "NFC"}
    j["added_tokens"] = [
        {"id": n + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    v["qwen2+nfc+added"] = j
    # Llama 3's post_processor: ByteLevel, then a template putting <|begin_of_text|> before the text.
    j = copy.deepcopy(v["llama3"])
    j["added_tokens"] = [{"id": n, "content": "<|begin_of_text|>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}]
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [n], "tokens": ["<|begin_of_text|>"]}}}]}
    v["llama3+bos"] = j
    j = copy.deepcopy(v["qwen2+nfc+added"])
    j["post_processor"] = {"type": "RobertaProcessing", "sep": ["<|endoftext|>", n], "cls": ["<|im_start|>", n + 1],
                           "trim_offsets": True, "add_prefix_space": False}
    v["qwen2+nfc+roberta"] = j
    return v


def test_kvx_encodes_as_tokenizers_js_does(tokenizers_js, tmp_path):
    base = json.loads(kvx.Tokenizer.train(1024).to_json())
    texts = TEXTS + corpus_lines(60)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    for name, j in variants(base).items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(j))
        ours = kvx.Tokenizer(path)
        assert ours.vocab_size == len(j["model"]["vocab"]) + len(j["added_tokens"])
        for special in (False, True) if "post_processor" in j and j["post_processor"] else (False,):
            run = subprocess.run(["node", HERE / "tokenizers_js_encode.mjs", tokenizers_js, path, tmp_path / "texts.json"]
                                 + (["special"] if special else []), capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            theirs = json.loads(run.stdout)
            assert len(theirs) == len(texts)
            for text, want in zip(texts, theirs):
                assert ours.encode(text, add_special_tokens=special) == want, f"{name} special={special}: {text!r}"
        # Decoding gives the text back (NFC-normalised where the tokenizer normalises).
        for text in texts:
            want = unicodedata.normalize("NFC", text) if "nfc" in name else text
            assert ours.decode(ours.encode(text)) == want, f"{name}: {text!r}"
