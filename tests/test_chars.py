"""Character-level tiny Shakespeare (nanoGPT's first run): the tokenizer round-trips the whole text, shards carry
the vocabulary, a short character run trains, resumes bit-exactly, samples, evaluates and exports with it, and
characters and GPT-2 BPE never meet (one-line refusals). The CPU recipe's loss is the slow test at the end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import data as data_lib, tokenizer
from jaxgpt.chars import CharTokenizer, CharTokenizerError

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = Path(os.environ.get("JAXGPT_SHAKESPEARE", REPO.parent / "shared/data/tinyshakespeare.txt"))
NANOGPT_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # its prepare.py prints them
CPU_RECIPE = REPO / "configs" / "shakespeare-char-cpu.yaml"
# a seconds-long character run: the CPU recipe's settings at a toy size
TOY = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 65, "bias": False},
       "batch_size": 4, "seq_len": 32, "max_steps": 4, "eval_interval": 2, "eval_steps": 2, "checkpoint_interval": 2,
       "keep_checkpoints": 3, "sample_len": 24, "sample_num": 1, "tensorboard": False, "plot": False,
       "progress": False, "async_checkpoint": False}


def text() -> str:
    if not SHAKESPEARE.is_file():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"tiny Shakespeare not at {SHAKESPEARE}")
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def char_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("char") / "shards"
    return data_lib.prepare([str(SHAKESPEARE)] if text() else [], out, tokenizer="char", name="shakespeare",
                            verbose=False)


# ---- the tokenizer and the shards ----------------------------------------------------------------------------
def test_char_tokenizer_round_trips_the_whole_text():
    t = text()
    tok = CharTokenizer.from_text(t)
    assert tok.chars == NANOGPT_CHARS and tok.vocab_size == 65
    ids = tok.encode(t)
    assert len(ids) == len(t) == 1_115_394 and max(ids) == 64
    assert tok.decode(ids) == t
    assert tokenizer.from_record(tok.record()) == tok  # through the record a manifest / checkpoint stores
    with pytest.raises(CharTokenizerError, match="'é' is not in the 65-character vocabulary"):
        tok.encode("café")
    with pytest.raises(CharTokenizerError, match="token id 65 is outside"):
        tok.decode([65])


def test_char_shards_are_nanogpts_split_and_decode_to_the_text(char_data):
    manifest = json.loads((char_data / "manifest.json").read_text())
    assert manifest["tokenizer"]["chars"] == NANOGPT_CHARS and manifest["settings"]["tokenizer"] == "char"
    tok = tokenizer.from_record(data_lib.manifest_tokenizer(char_data))
    parts = []
    for split, n in (("train", 1_003_854), ("val", 111_540)):  # nanoGPT: first 90%, last 10% of the characters
        (shard,) = data_lib.find_shards(char_data, split)
        assert shard.num_tokens == n and shard.header["tokenizer"] == "char" and shard.header["eot_token"] is None
        parts.append(tok.decode(np.fromfile(shard.path, dtype="<u2")))
    assert "".join(parts) == text()
    assert math.isclose(data_lib.unigram_loss(char_data, "val"), 3.3373, abs_tol=1e-4)


def test_unknown_tokenizer_is_refused(tmp_path):
    with pytest.raises(data_lib.DataError, match=r"tokenizer = 'bytes': allowed values are \['gpt2', 'char'\]"):
        data_lib.prepare([str(SHAKESPEARE)], tmp_path / "x", tokenizer="bytes", verbose=False)


# ---- a short character run --------------------------------------------------------------------------------------
def toy_config(char_data: Path, out: Path, **over):
    from jaxgpt.train import TrainConfig

    d = TrainConfig.load(CPU_RECIPE).to_dict()
    d.update({**TOY, "data_dir": str(char_data), "out_dir": str(out), **over})
    d["model"] = {**d["model"], **TOY["model"]}
    d["optim"] = {**d["optim"], "lr": 1e-2, "warmup_steps": 1, "decay_steps": 4}  # 4 steps that learn
    return TrainConfig.from_dict(d)


def records(run_dir: Path) -> list[tuple[str, int, float]]:
    from jaxgpt.train import read_metrics

    return [(r["type"], r["step"], r["loss"] if r["type"] == "train" else r["val_loss"])
            for r in read_metrics(run_dir) if r["type"] in ("train", "eval")]


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, char_data):
    from jaxgpt.train import train

    out = tmp_path_factory.mktemp("run") / "toy"
    summary = train(toy_config(char_data, out))
    return out, summary


def test_char_run_trains_samples_and_records_its_vocabulary(char_run):
    from jaxgpt import checkpoint

    out, summary = char_run
    losses = [v for kind, _, v in records(out) if kind == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0] < 4.3  # ln 65 = 4.17: it starts near chance and learns
    assert summary["best_val_loss"] == min(v for kind, _, v in records(out) if kind == "eval")
    sample = (out / "samples.txt").read_text().split("---\n", 1)[1]
    assert len(sample) >= 24 and set(sample) <= set(NANOGPT_CHARS)  # decoded characters, not BPE
    assert checkpoint.saved_tokenizer(out)["chars"] == NANOGPT_CHARS


def test_char_run_resumes_bit_exactly(char_run, char_data, tmp_path):
    from jaxgpt.train import train

    ref, _ = char_run
    out = tmp_path / "resumed"
    train(toy_config(char_data, out, max_steps=2, sample_interval=-1))
    train(toy_config(char_data, out, resume="must", sample_interval=-1))  # steps 3 and 4 from checkpoint 2
    assert records(out) == records(ref)


def test_generate_eval_and_export_decode_characters(char_run, char_data, tmp_path, capsys):
    import torch

    from jaxgpt import checkpoint, exportdir
    from jaxgpt.eval import val_loss
    from jaxgpt.generate import load_model, load_tokenizer, main
    from jaxgpt.precision import Policy
    from jaxgpt.weights import to_torch_state_dict
    from torch_ref.model import GPT as RefGPT

    out, summary = char_run
    assert main(["--init-from", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "30", "--temperature", "0.8"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ROMEO:") and set(printed) <= set(NANOGPT_CHARS) and len(printed) >= 36
    assert main(["--init-from", str(out), "--prompt", "café"]) == 2  # a character the model never saw: one line
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'é' is not in the 65-character vocabulary" in err

    model = load_model(str(out), policy=Policy.named("fp32"))
    record = load_tokenizer(str(out)).record()
    r = val_loss.evaluate(model, char_data, batch_size=4, seq_len=32, limit=2, tokenizer=record)
    assert r["bytes"] == r["tokens"] and math.isclose(r["bits_per_byte"], r["loss"] / math.log(2), rel_tol=1e-9)

    pt = checkpoint.export(out, to_torch=tmp_path / "toy.pt", report=lambda _m: None)["torch"]
    assert exportdir.export_tokenizer(pt)["chars"] == NANOGPT_CHARS  # the vocabulary travels with the weights
    ref = RefGPT(model.config)
    ref.load_state_dict(torch.load(pt))
    ids = np.asarray([load_tokenizer(str(out)).encode("First Citizen:\nBefore we proceed")])
    mine = np.asarray(model(ids))
    theirs = ref(torch.as_tensor(ids))[0].detach().numpy()
    np.testing.assert_allclose(mine, theirs, atol=1e-4)
    assert set(to_torch_state_dict(model)) == set(ref.state_dict())


# ---- characters and BPE never meet --------------------------------------------------------------------------------
def one_line_error(capsys, argv) -> str:
    from jaxgpt.train import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    err = "\n".join(line for line in lines if not line.startswith("warning: "))  # e.g. the schedule's, then the error
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_character_checkpoint_refuses_bpe_data_and_back(char_run, char_data, tmp_path, capsys):
    out, _ = char_run
    bpe = REPO / "data_cache" / "shakespeare"
    data_lib.ensure_prepared("shakespeare", bpe, verbose=False)
    # the character run, continued on BPE shards
    err = one_line_error(capsys, ["--config", str(CPU_RECIPE), f"--out_dir={out}", f"--data_dir={bpe}",
                                  "--tokenizer=gpt2", "--max_steps=9"])
    assert f"{bpe} holds GPT-2 BPE tokens (50,257 ids) but the checkpoint in {out} was trained on characters" in err
    # the character config pointed at BPE shards
    err = one_line_error(capsys, ["--config", str(CPU_RECIPE), f"--out_dir={tmp_path / 'new'}", f"--data_dir={bpe}"])
    assert "TrainConfig.tokenizer = 'char', but" in err and "holds GPT-2 BPE tokens" in err
    assert not (tmp_path / "new").exists()
    # a GPT-2 model (vocabulary 50,257) on character shards: their ids fit, their meaning does not
    with pytest.raises(data_lib.DataError, match="holds characters .65 ids. but the model was trained on GPT-2 BPE"):
        data_lib.check_shards_for_model(char_data, 50257)
    # a character vocabulary for another text: the same name, other characters
    other = CharTokenizer("abc").record()
    with pytest.raises(data_lib.DataError, match="use shards made with the same characters"):
        data_lib.check_tokenizer_matches(char_data, other, "the model")


def test_eval_refuses_the_other_tokenizer(char_run, char_data):
    from jaxgpt.eval import EvalError, val_loss
    from jaxgpt.generate import load_model
    from jaxgpt.precision import Policy

    out, _ = char_run
    model = load_model(str(out), policy=Policy.named("fp32"))
    with pytest.raises(EvalError, match="holds characters .65 ids. but the model was trained on GPT-2 BPE"):
        val_loss.evaluate(model, char_data, batch_size=2, seq_len=16, limit=1, tokenizer=None)


# ---- the recipe ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cpu_recipe_reaches_nanogpts_loss(tmp_path):
    """nanoGPT's CPU line reaches 1.88; 2,000 iterations of configs/shakespeare-char-cpu.yaml must reach 1.95
    (10-40 minutes on 2 cores, depending on the load)."""
    proc = subprocess.run([sys.executable, "-m", "jaxgpt.train", "--config", str(CPU_RECIPE),
                           f"--out_dir={tmp_path / 'run'}", "--progress=false"], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2000 and summary["val_loss"] <= 1.95 and summary["best_val_loss"] <= 1.95, summary
