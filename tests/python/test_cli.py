# The kvx binary refuses bad arguments with a message naming the option and the fix (CLI11 checks
# run only on values given, so defaults such as --steps 0 = "the config's steps" still pass).
import os
import pathlib
import subprocess

import pytest

BINARY = os.environ.get("KVX_BINARY", str(pathlib.Path(os.environ.get("KVX_SOURCE_DIR", ".")) / "build" / "kvx"))


def kvx_fails(*args):
    r = subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, f"kvx {' '.join(args)} succeeded"
    return r.stdout + r.stderr


@pytest.mark.parametrize("args, message", [
    (["train", "--steps", "0"], "--steps: must be a whole number >= 1"),
    (["train", "--nproc", "-1"], "--nproc: must be a whole number >= 1"),
    (["train", "--rank", "1"], "--rank requires --world-size"),
    (["tokenizer", "train", "--vocab", "100", "--out", "t.json"], "the byte alphabet alone takes 256 ids"),
    (["bench", "train", "--steps", "0"], "--steps: must be a whole number >= 1"),
    (["eval", "--model", "m", "--batch", "0"], "--batch: must be a whole number >= 1"),
])
def test_bad_numbers_are_refused_by_name(args, message):
    assert message in kvx_fails(*args)


def test_eval_refuses_options_a_document_module_would_ignore(micro_run):
    model = str(micro_run[0])
    out = kvx_fails("eval", "--model", model, "--document-module", "m", "--kv-cache", "q8", "--seq-len", "16")
    assert "--seq-len, --kv-cache would be ignored" in out
    assert "--document-module" in kvx_fails("eval", "--model", model, "--document", "doc.txt")


def test_cost_reads_a_run_config(tmp_path):
    # the file kvx train --config takes (its model config under "model") is read by cost --config too
    run_config = subprocess.run([BINARY, "train", "--print-config"], capture_output=True, text=True, timeout=120, check=True).stdout
    (tmp_path / "run.json").write_text(run_config)
    r = subprocess.run([BINARY, "cost", "--config", str(tmp_path / "run.json"), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dense H=6" in r.stdout
