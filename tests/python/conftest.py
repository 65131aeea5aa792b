# Shared fixtures: the package from build/python, the corpora, one micro model trained once.
import os
import pathlib

import pytest

SOURCE_DIR = pathlib.Path(os.environ.get("KVX_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
os.environ.setdefault("KVX_DATA_DIR", str(SOURCE_DIR / "data"))

import kvx  # noqa: E402

# A 2-layer GQA model small enough to train in seconds (head_dim 32: q8/q4 caches apply).
MICRO = {
    "name": "micro",
    "model": {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 48, "max_position_embeddings": 128},
    "train": {"steps": 6, "batch_size": 4, "seq_len": 32, "eval_every": 3, "eval_batches": 1, "checkpoint_every": 3,
              "log_every": 3, "warmup": 2},
}


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "run"
    summary = kvx.train(out, "tiny", MICRO)
    return out, summary


@pytest.fixture(scope="session")
def micro_model(micro_run):
    return kvx.load(micro_run[0])
