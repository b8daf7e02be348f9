"""jaxgpt.eval: HellaSwag items and scoring mechanics, val-loss and bits per byte, the command line, the training
hook, the complete Hugging Face export (tokenizer files), and the lm-eval model's mechanics (its command line,
registration, model_args, generation's shapes and stopping rule). The scores themselves are checked against
torch_ref and transformers in parity_tests/test_eval_parity.py and test_lm_eval_parity.py."""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.eval import EvalError, cli, hellaswag, val_loss
from jaxgpt.model import GPT
from jaxgpt.tokenizer import EOT_TOKEN, decode, encode

REPO = Path(__file__).resolve().parent.parent
ITEM = {"ind": 7, "ctx": "A man is sitting on a roof. He", "label": 2, "split": "val",
        "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                    "starts pulling up roofing on a roof.", "is holding a rubik's cube."]}


def write_items(path: Path, n: int = 6) -> Path:
    rows = []
    for i in range(n):
        rows.append({**ITEM, "ind": i, "ctx": ITEM["ctx"] + " and then" * i, "label": i % 4})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    """Prepared tiny-Shakespeare shards of this test module's own (no reliance on data_cache/ or test order)."""
    from jaxgpt.data import prepare

    return prepare("shakespeare", tmp_path_factory.mktemp("shakespeare"), verbose=False)


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("line, match", [
    ("{not json", "not JSON"), (json.dumps({**ITEM, "ctx": ""}), "'ctx' must be a non-empty string"),
    (json.dumps({**ITEM, "endings": ["a", "b"]}), "'endings' must be a list of 4 strings"),
    (json.dumps({**ITEM, "label": 4}), r"'label' must be an integer in \[0, 4\) .*, got 4$"),
    (json.dumps({**ITEM, "label": "7"}), r"'label' must be an integer in \[0, 4\) .*, got 7$"),
    (json.dumps({**ITEM, "label": "one"}), r"'label' must be an integer in \[0, 4\) .*, got 'one'$"),
    (json.dumps({**ITEM, "label": True}), r"'label' must be an integer in \[0, 4\) .*, got True$"),
    (json.dumps({**ITEM, "label": ""}), r"'label' is missing or empty \(the test split has no labels"),
    (json.dumps({k: v for k, v in ITEM.items() if k != "label"}), r"'label' is missing or empty \(the test split")])
def test_malformed_items_name_the_line(line, match):
    with pytest.raises(EvalError, match=f"items.jsonl:2: {match}"):
        hellaswag.parse([json.dumps(ITEM), line], source="items.jsonl")


def test_string_labels_as_hugging_face_stores_them():
    rows = [{**ITEM, "label": str(k), "ind": k} for k in range(4)]  # Rowan/hellaswag: "label": "1"
    items = hellaswag.parse([json.dumps(r) for r in rows], source="hf.jsonl")
    assert [it.label for it in items] == [0, 1, 2, 3] and items[1].origin == "hf.jsonl:2"


def test_find_or_download(tmp_path):
    def offline(url, timeout):
        raise OSError("network unreachable")

    def cut_short(url, timeout):  # the connection closed before Content-Length bytes: not an OSError
        raise http.client.IncompleteRead(b"{", 1000)

    with pytest.raises(EvalError, match=r"could not be downloaded \(network unreachable\).*pass --data"):
        hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=offline)
    with pytest.raises(EvalError, match=r"could not be downloaded \(IncompleteRead.*pass --data"):
        hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=cut_short)
    with pytest.raises(EvalError, match="not JSON"):  # a captive portal's page is not the dataset
        hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=lambda u, t: b"<html>login</html>\n")
    good = "".join(json.dumps({**ITEM, "ind": i}) + "\n" for i in range(5)).encode()
    truncated = good[: good.rindex(b'"label"')]  # four whole items, then half of the fifth
    with pytest.raises(EvalError, match=r"hellaswag_val.jsonl:5: not JSON .*incomplete or not the dataset; "
                                        r"nothing was cached"):
        hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=lambda u, t: truncated)
    with pytest.raises(EvalError, match="not UTF-8"):
        hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=lambda u, t: b"\xff\xfe" + good)
    assert list(tmp_path.iterdir()) == []  # nothing cached, not even a temporary file
    path = hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=lambda u, t: good)
    assert path == tmp_path / "hellaswag_val.jsonl" and path.read_bytes() == good
    assert hellaswag.find_or_download(None, cache_dir=tmp_path, fetch=offline) == path  # cached: no network
    assert hellaswag.find_or_download(tmp_path / "x.jsonl") == tmp_path / "x.jsonl"
    with pytest.raises(EvalError, match="does not exist"):
        hellaswag.load(tmp_path / "x.jsonl")
    with pytest.raises(EvalError, match="is a directory; pass the jsonl file itself"):
        hellaswag.load(tmp_path)


def test_render_pad_and_truncation():
    item = hellaswag.parse([json.dumps(ITEM)])[0]
    rows, ctx_len, cut = hellaswag.render(item, encode, 1024)
    assert not cut and ctx_len == len(encode(ITEM["ctx"]))
    assert rows[2] == encode(ITEM["ctx"]) + encode(" " + ITEM["endings"][2])  # build-nanogpt's " " + ending
    tokens, mask = hellaswag.pad(rows, [ctx_len] * 4, 32, 6)
    assert tokens.shape == mask.shape == (6, 32) and mask[4:].sum() == 0
    assert [int(m.sum()) for m in mask[:4]] == [len(encode(" " + e)) for e in ITEM["endings"]]
    rows, ctx_len, cut = hellaswag.render(item, encode, 12)
    assert cut and max(map(len, rows)) == 12 and ctx_len == 12 - max(len(encode(" " + e)) for e in ITEM["endings"])
    assert hellaswag.bucket(33, 32, 1024) == 64 and hellaswag.bucket(33, 32, 40) == 40 and hellaswag.bucket(5, 16, 64) == 16
    long_ending = [json.dumps({**ITEM, "ind": 3, "endings": ["x " * 20] * 4}),
                   json.dumps({k: v for k, v in ITEM.items() if k != "ind"} | {"endings": ["x " * 20] * 4})]
    first, second = hellaswag.parse(long_ending, source="items.jsonl")
    with pytest.raises(EvalError, match=r"^HellaSwag item 3 \(items.jsonl:1\): an ending alone is longer"):
        hellaswag.render(first, encode, 12)
    with pytest.raises(EvalError, match=r"^HellaSwag item at items.jsonl:2: an ending alone is longer"):
        hellaswag.render(second, encode, 12)


def test_scores_do_not_depend_on_batching_and_compile_per_bucket(model, tmp_path):
    items = hellaswag.load(write_items(tmp_path / "items.jsonl", 6))
    one = hellaswag.Scorer(model, batch_size=1).score(items)
    four = hellaswag.Scorer(model, batch_size=4)
    again = four.score(items)  # batches of 4 and 2 (+ 2 padding items)
    for a, b in zip(one, again):
        np.testing.assert_allclose(a["sum_losses"], b["sum_losses"], rtol=1e-5)
        assert (a["pred"], a["pred_norm"]) == (b["pred"], b["pred_norm"])
    assert four._fn._cache_size() == 1  # all of these fit one (32-token context, 16-token ending) bucket pair
    s = four.evaluate(items, params=nnx.state(model, nnx.Param))
    assert s["n"] == 6 and s["acc"] == sum(r["correct"] for r in one) / 6 and four._fn._cache_size() == 1
    other_model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(1))
    seen = []  # what evaluate scored: the results behind its summary
    score = four.score
    four.score = lambda *a, **k: seen.append(score(*a, **k)) or seen[-1]
    assert four.evaluate(items, params=nnx.state(other_model, nnx.Param))["items_per_s"] > 0
    assert four._fn._cache_size() == 1
    theirs = hellaswag.Scorer(other_model, batch_size=4).score(items)
    for a, b, mine in zip(seen[-1], theirs, again):  # the other params' losses, not the model's own
        np.testing.assert_allclose(a["sum_losses"], b["sum_losses"], rtol=1e-5)
        assert not np.allclose(a["sum_losses"], mine["sum_losses"], rtol=1e-3)
    four.evaluate(items)  # and back to the model's own without params
    for a, mine in zip(seen[-1], again):
        np.testing.assert_allclose(a["sum_losses"], mine["sum_losses"], rtol=1e-6)


def test_val_loss_and_bits_per_byte(model, shakespeare):
    lens = val_loss.byte_lengths()
    assert lens[EOT_TOKEN] == 0 and lens[encode("Hello")[0]] == 5 and lens[encode(" é")[0]] == len(" é".encode())
    r = val_loss.evaluate(model, shakespeare, batch_size=2, seq_len=32, limit=3)
    assert r["tokens"] == 3 * 2 * 32 and 0 < r["bytes"] <= 3 * 2 * 32 * 16
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    assert r["bits_per_byte"] == pytest.approx(r["loss"] * r["tokens"] / math.log(2) / r["bytes"])
    assert 10.0 < r["loss"] < 11.5  # a random model: about ln(50257) = 10.8
    with pytest.raises(EvalError, match="seq_len = 65: must be <= the model's block_size"):
        val_loss.evaluate(model, shakespeare, seq_len=65)


def test_val_loss_names_an_id_outside_the_vocabulary(model, tmp_path):
    from jaxgpt.data import write_shard

    tokens = np.arange(400) % 1000
    tokens[150] = 60_000  # in the third batch (each takes 2 x 32 tokens: 128..191)
    write_shard(tmp_path, "x", "val", 0, tokens, {})
    with pytest.raises(EvalError, match=r"x_val_000000\.bin: token id 60,000 at token offset 150 is outside the "
                       r"model's vocabulary \[0, 50,257\) \(found in batch 3 of the val split"):
        val_loss.evaluate(model, tmp_path, batch_size=2, seq_len=32)


def test_command_line(tmp_path, capsys, shakespeare):
    data = write_items(tmp_path / "items.jsonl", 5)
    argv = ["--task", "hellaswag", "--init-from", "random:tiny", "--data", str(data), "--limit", "3",
            "--out", str(tmp_path / "r.jsonl"), "--json", str(tmp_path / "s.json"), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("hellaswag: acc_norm ") and "on 3 items" in out[0]
    summary = json.loads(out[1])
    assert summary == json.loads((tmp_path / "s.json").read_text()) and summary["n"] == 3
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["ind"] for r in rows] == [0, 1, 2] and all(len(r["sum_losses"]) == 4 for r in rows)

    assert cli.main(["--task", "val-loss", "--init-from", "random:tiny", "--data",
                     str(shakespeare), "--limit", "2", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("val loss ")
    for bad, match in ((["--task", "val-loss", "--init-from", "random:tiny"], "needs --data DIR"),
                       (["--task", "hellaswag", "--init-from", "random:tiny", "--data", str(tmp_path / "no")],
                        "does not exist"),
                       (["--task", "hellaswag", "--init-from", "random:nope", "--data", str(data)], "unknown preset")):
        assert cli.main(bad) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err


def test_command_line_checks_outputs_and_data_before_loading_the_model(tmp_path, capsys, monkeypatch, shakespeare):
    data = write_items(tmp_path / "items.jsonl", 3)
    loads = []
    real_load = cli.load_model
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    hs = ["--task", "hellaswag", "--init-from", "random:tiny", "--no-progress"]
    (tmp_path / "a_file").write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    bad_item = tmp_path / "bad.jsonl"
    bad_item.write_text(json.dumps(ITEM) + "\n" + json.dumps({**ITEM, "label": 9}) + "\n")
    cases = [([*hs, "--data", str(data), "--json", str(tmp_path / "a_file" / "sub" / "s.json")],
              "--json " + str(tmp_path / "a_file" / "sub" / "s.json") + ": cannot create its directory"),
             ([*hs, "--data", str(data), "--out", str(tmp_path)], f"--out {tmp_path}: is a directory"),
             ([*hs, "--data", str(data), "--out", str(tmp_path / "r.jsonl"), "--json", str(tmp_path / "r.jsonl")],
              "--out and --json are the same file"),
             ([*hs, "--data", str(tmp_path)], "is a directory; pass the jsonl file itself"),
             ([*hs, "--data", str(bad_item)], "bad.jsonl:2: 'label' must be an integer in [0, 4)"),
             ([*hs, "--data", str(data), "--seq-len", "16"], "--seq-len applies to --task val-loss only"),
             (["--task", "val-loss", "--init-from", "random:tiny", "--data", str(shakespeare), "--out",
               str(tmp_path / "r.jsonl")], "--out (per-item results) applies to --task hellaswag only"),
             (["--task", "val-loss", "--init-from", "random:tiny", "--data", str(tmp_path / "none")], "does not exist"),
             (["--task", "val-loss", "--init-from", "random:tiny", "--data", str(tmp_path)], "no val shards in"),
             (["--task", "val-loss", "--init-from", str(tmp_path / "red_only"), "--data", str(shakespeare)],
              f"error: --init-from {tmp_path / 'red_only'}: no such directory: {tmp_path / 'red_only'} (did you "
              f"mean {read_only}?); give a training run directory")]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append(([*hs, "--data", str(data), "--json", str(read_only / "s.json")], "s.json: not writable"))
    for argv, match in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, (argv, err)
    assert loads == []  # every one refused before the model was loaded
    for flag in ("--batch-size", "--limit", "--seq-len"):
        with pytest.raises(SystemExit) as e:
            cli.main([*hs, "--data", str(data), flag, "0"])
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    nested = tmp_path / "new" / "sub"  # outputs' directories are made, before the scoring
    assert cli.main([*hs, "--data", str(data), "--json", str(nested / "s.json"), "--out", str(nested / "r.jsonl")]) == 0
    assert json.loads((nested / "s.json").read_text())["n"] == 3 and len((nested / "r.jsonl").read_text().split()) > 3
    assert len(loads) == 1


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.mark.slow  # 16 s on 2 cores
def test_training_scores_hellaswag_and_plots_it(tmp_path, capsys, monkeypatch, shakespeare):
    import matplotlib.figure

    from jaxgpt.train import main, read_metrics
    from jaxgpt.train.metrics import plot_losses

    data = write_items(tmp_path / "items.jsonl", 4)
    base = ["--config", str(REPO / "configs/tiny-test.yaml"), f"--data_dir={shakespeare}",
            "--max_steps=4", "--eval_interval=0", "--checkpoint_interval=0"]
    panels = []  # each saved figure's axes: (y label, the x data of each line)
    savefig = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        panels.append([(ax.get_ylabel(), [list(line.get_xdata()) for line in ax.get_lines()]) for ax in fig.axes])
        return savefig(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    assert main([*base, f"--out_dir={tmp_path / 'run'}", "--hellaswag_interval=2", f"--hellaswag_file={data}"]) == 0
    hs = [r for r in read_metrics(tmp_path / "run") if r["type"] == "hellaswag"]
    assert [r["step"] for r in hs] == [2, 4] and all(r["n"] == 4 and 0 <= r["acc_norm"] <= 1 for r in hs)
    assert "HellaSwag acc_norm" in capsys.readouterr().out
    (loss_label, _), (hs_label, hs_lines) = panels[-1]  # two panels: the losses, then HellaSwag
    assert loss_label.startswith("loss") and hs_label == "HellaSwag accuracy"
    assert hs_lines[:2] == [[2, 4], [2, 4]]  # acc_norm and acc at the scored steps (then the chance line)
    without = tmp_path / "without"  # the same run's metrics less the HellaSwag rows: one panel, a narrower image
    without.mkdir()
    (without / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("type") != "hellaswag"))
    plot_losses(without)
    assert [label for label, _ in panels[-1]] == [loss_label]
    assert png_size(tmp_path / "run" / "loss.png")[0] > 1.5 * png_size(without / "loss.png")[0]
    assert main([*base, f"--out_dir={tmp_path / 'run2'}", "--hellaswag_interval=2",
                 f"--hellaswag_file={tmp_path / 'missing.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert "hellaswag_interval = 2: HellaSwag file" in err and "does not exist" in err
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


# ---- the complete Hugging Face export --------------------------------------------------------------------------
TEXTS = ["Hello, I'm a language model,", "  two  spaces and\ttabs\n\nnew lines", "naïve café — 東京 🤖",
         "end<|endoftext|>next", "", "'''quotes''' and 1234567 digits"]


class TransformersLog:
    """transformers' log records (it logs through ``logging``, not ``warnings``, and does not propagate to the
    root logger, so neither ``warnings.simplefilter('error')`` nor caplog sees them)."""

    def __init__(self):
        import logging

        self.records: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.records.append(record.getMessage())
        self.logger = logging.getLogger("transformers")

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)

    def out_of_vocabulary(self) -> list[str]:
        return [r for r in self.records if "within the vocabulary" in r]


def test_the_exported_tokenizer_gives_our_ids(model, tmp_path, monkeypatch):
    from transformers import AutoTokenizer, GPT2LMHeadModel, pipeline

    from jaxgpt.weights import save_hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = save_hf(model, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tok(text)["input_ids"] == encode(text, allow_eot=True), text  # HF reads <|endoftext|> as special
        assert tok.decode(encode(text)) == text
    assert tok.eos_token_id == tok.bos_token_id == EOT_TOKEN
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": EOT_TOKEN,
                                                                         "eos_token_id": EOT_TOKEN}
    gen = pipeline("text-generation", model=str(out), device="cpu")  # its tokenizer found in the directory
    assert gen.tokenizer.eos_token_id == EOT_TOKEN
    text = gen("Hello, I'm", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert text.startswith("Hello, I'm") and len(text) > len("Hello, I'm")

    small = GPT(GPTConfig.preset("tiny", vocab_size=512), rngs=nnx.Rngs(0))  # no room for <|endoftext|>
    small_dir = save_hf(small, tmp_path / "small")
    config = json.loads((small_dir / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert json.loads((small_dir / "generation_config.json").read_text()) == {}
    with TransformersLog() as log:
        GPT2LMHeadModel.from_pretrained(small_dir)
        pipeline("text-generation", model=str(small_dir), device="cpu")
    assert log.out_of_vocabulary() == [], log.records
    # the check can fail: the same directory with GPT-2's ids written in makes transformers log that warning
    for name in ("config.json", "generation_config.json"):
        d = json.loads((small_dir / name).read_text())
        (small_dir / name).write_text(json.dumps({**d, "bos_token_id": EOT_TOKEN, "eos_token_id": EOT_TOKEN}))
    with TransformersLog() as log:
        GPT2LMHeadModel.from_pretrained(small_dir)
    assert any("eos_token_id" in r for r in log.out_of_vocabulary()), log.records


# ---- the lm-eval model (jaxgpt.eval.harness) -------------------------------------------------------------------
MC_TASK = """output_type: multiple_choice
doc_to_text: "{{ctx}}"
doc_to_choice: "{{endings}}"
doc_to_target: "{{label}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_TASK = """output_type: generate_until
doc_to_text: "{{ctx}}"
doc_to_target: "{{endings[0]}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
"""


def lm_eval_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow  # 32 s on 2 cores; the harness itself: parity_tests/test_lm_eval_parity.py
def test_the_harness_command_line_as_documented(model, tmp_path):
    """``python -m jaxgpt.eval.harness --model jaxgpt --model_args pretrained=DIR,batch_size=N`` (README's form:
    lm-eval's command line also passes its own batch_size, which used to make it a TypeError), on a local task."""
    pytest.importorskip("lm_eval")
    from jaxgpt.weights import save_hf

    export = save_hf(model, tmp_path / "hf")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"ctx": "The capital of France is", "endings": [" Paris.", " a banana."], "label": 0},
            {"ctx": "Cats like to chase", "endings": [" mice.", " taxes."], "label": 0},
            {"ctx": "Once upon a", "endings": [" time", " spoon"], "label": 0}]
    (tasks / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, body in (("jaxgpt_cli_mc", MC_TASK), ("jaxgpt_cli_gen", GEN_TASK)):
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {tasks / 'items.jsonl'}\ntest_split: test\n{body}")
    argv = ["--model", "jaxgpt", "--model_args", f"pretrained={export},batch_size=2", "--tasks",
            "jaxgpt_cli_mc,jaxgpt_cli_gen", "--include_path", str(tasks), "--output_path", str(tmp_path / "out")]
    p = subprocess.run([sys.executable, "-m", "jaxgpt.eval.harness", *argv], cwd=REPO, env=lm_eval_env(),
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    (results_file,) = (tmp_path / "out").glob("*/results_*.json")
    r = json.loads(results_file.read_text())
    assert r["config"]["model"] == "jaxgpt" and r["config"]["batch_size"] == "2"  # moved to lm-eval's --batch_size
    assert r["config"]["model_args"] == {"pretrained": str(export)}
    assert 0.0 <= r["results"]["jaxgpt_cli_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in r["results"]["jaxgpt_cli_gen"]


def test_importing_the_harness_keeps_lm_evals_models():
    """Registering jaxgpt into lm-eval's empty model registry used to hide the built-in models (get_model loads
    them only into an empty registry): import the harness first, in a fresh interpreter, then look up ``hf``."""
    pytest.importorskip("lm_eval")
    code = ("import jaxgpt.eval.harness\n"
            "from lm_eval.api.registry import get_model\n"
            "print(get_model('hf').__name__, get_model('jaxgpt').__module__)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=lm_eval_env(), capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["HFLM", "jaxgpt.eval.harness"]


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
def test_the_harness_as_main_registers_the_package_class_once(monkeypatch, capsys):
    """``python -m jaxgpt.eval.harness`` runs the file as ``__main__``: the model registered is still
    ``jaxgpt.eval.harness.JaxGPTLM`` (a second registration under the same name would be refused); batch_size
    both in --model_args and as --batch_size, differently, is refused before anything runs."""
    pytest.importorskip("lm_eval")
    import runpy

    from lm_eval.api.registry import get_model

    from jaxgpt.eval import harness

    monkeypatch.setattr(sys, "argv", ["jaxgpt-lm-eval", "--model", "jaxgpt", "--model_args",
                                      "pretrained=random:tiny,batch_size=4", "--batch_size", "2", "--tasks", "x"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("jaxgpt.eval.harness", run_name="__main__")
    assert e.value.code == 2
    assert "batch_size is given twice, 4 in --model_args and 2 as --batch_size" in capsys.readouterr().err
    assert get_model("jaxgpt") is harness.JaxGPTLM


def test_the_harness_model_args(monkeypatch):
    pytest.importorskip("lm_eval")
    from jaxgpt.eval.harness import JaxGPTLM

    lm = JaxGPTLM.create_from_arg_string("pretrained=random:tiny,batch_size=3,dtype=bfloat16",
                                         {"batch_size": None, "max_batch_size": None, "device": "cuda:0"})
    assert lm.batch_size == 3 and lm.model.policy.compute_dtype in ("bfloat16", np.dtype("bfloat16"))
    lm = JaxGPTLM.create_from_arg_obj({"pretrained": "random:tiny", "batch_size": 3, "device": "cpu"},
                                      {"batch_size": "3", "device": "cuda:0"})  # the same value twice: fine
    assert lm.batch_size == 3 and lm.model.policy.compute_dtype in ("float32", np.dtype("float32"))
    assert JaxGPTLM(pretrained="random:tiny", batch_size="auto", max_batch_size="4").batch_size == 4
    assert JaxGPTLM(pretrained="random:tiny", dtype="float32", precision="fp32").model.policy.dtype == np.float32
    for kwargs, additional, match in (
            ({"batch_size": 16}, {"batch_size": 1}, "batch_size is given twice, 16 in --model_args and 1 as"),
            ({"dtype": "float16"}, None, "dtype=float16: the jaxgpt model computes in float32 or bfloat16"),
            ({"dtype": "auto"}, None, "dtype=auto: "),
            ({"dtype": "bfloat16", "precision": "fp32"}, None, "disagree"),
            ({"batch_size": "many"}, None, "batch_size=many: expected an integer"),
            ({"batch_size": 0}, None, "batch_size=0: must be >= 1"),
            ({"temperature": 1}, None, r"unknown argument\(s\) \['temperature'\]")):
        with pytest.raises(EvalError, match=match):
            JaxGPTLM.create_from_arg_obj({"pretrained": "random:tiny", **kwargs}, additional)


class Request:
    def __init__(self, *args):
        self.args = args


def test_generate_until_compiles_per_bucket_and_matches_one_prompt_at_a_time():
    """Prompts of many lengths in batches of mixed lengths: every row at its own positions (the position
    embedding is scaled up, so a row at the wrong positions generates other tokens), the same tokens as greedy
    decoding by full forward passes over each prompt alone, and one compilation per context-width bucket."""
    pytest.importorskip("lm_eval")
    import jax

    from jaxgpt.eval.harness import GEN_CHECK_EVERY, JaxGPTLM, gen_width

    lm = JaxGPTLM(pretrained="random:tiny", batch_size=3, max_gen_toks=10)  # block_size 64
    scale = {"['wte']": 3.0, "['wpe']": 30.0}
    nnx.update(lm.model, jax.tree_util.tree_map_with_path(lambda p, x: x * next(
        (f for k, f in scale.items() if jax.tree_util.keystr(p).startswith(k)), 1.0), nnx.state(lm.model, nnx.Param)))
    lm.state = nnx.state(lm.model)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "curious",
             "owls", "watch", "from", "an", "old", "oak"]
    contexts = [" ".join((words * 5)[:n]) for n in [*range(1, 27), 40, 55, 60, 70]]
    lengths = {len(encode(c)) for c in contexts}
    assert len(lengths) == 30 and max(lengths) > 64 - 10  # distinct lengths, some cut to block_size - max_gen_toks
    kwargs = {"until": ["never appears"], "max_gen_toks": 10, "do_sample": False}
    out = lm.generate_until([Request(c, kwargs) for c in contexts], disable_tqdm=True)
    forward = jax.jit(lambda x: lm.model(x))  # the oracle: greedy by full forward passes, no cache, positions 0..
    rows = [encode(c)[-(64 - 10):] for c in contexts]
    for _ in range(10):
        x = np.zeros((len(rows), 64), np.int32)
        for r, row in enumerate(rows):
            x[r, : len(row)] = row
        logits = np.asarray(forward(x))
        for r, row in enumerate(rows):
            row.append(int(np.argmax(logits[r, len(row) - 1])))
    reference = [lm.tok_decode(row[-10:][: row[-10:].index(EOT_TOKEN)] if EOT_TOKEN in row[-10:] else row[-10:])
                 for row in rows]
    assert out == reference
    assert len(set(out)) > 20  # position-dependent continuations, not one repeated token
    buckets = {gen_width(min(n, 64 - 10), 64 - 10) for n in lengths}
    assert buckets == {16, 32, 54}  # powers of two, and the cap block_size - max_gen_toks
    assert lm.traces["prefill"] <= len(buckets) and lm.traces["decode"] <= len(buckets)
    assert lm.gen_steps == [(10, 10)] * 10  # nothing ended early: no stop string, no <|endoftext|>
    before = dict(lm.traces)
    lm.generate_until([Request(c + " and", kwargs) for c in contexts[:9]], disable_tqdm=True)
    assert dict(lm.traces) == before  # other lengths, the same buckets: nothing compiled again

    # a stop string every row of the batch reaches: the batch ends after the first check, the texts are cut
    stop = reference[4][2:5]
    early = {"until": [stop], "max_gen_toks": 30, "do_sample": False}
    assert lm.generate_until([Request(contexts[4], early)] * 3, disable_tqdm=True) == [reference[4].split(stop)[0]] * 3
    assert lm.gen_steps == [(GEN_CHECK_EVERY, 30)]


def test_the_stopping_rule_is_lm_evals_hf_rule(model, tmp_path):
    """StopRule against lm-eval's own MultiTokenEOSCriteria driven the way transformers' generate drives it (a
    finished row padded with the pad token, <|endoftext|>; the batch ends when every row is finished), on random
    token rows made of pieces of the stop strings."""
    pytest.importorskip("lm_eval")
    import torch
    from lm_eval.models.utils_hf import stop_sequences_criteria
    from transformers import AutoTokenizer

    from jaxgpt.eval.harness import StopRule
    from jaxgpt.weights import save_hf

    tok = AutoTokenizer.from_pretrained(save_hf(model, tmp_path / "hf"))
    until = ["\n\n", ". The", "<|endoftext|>"]
    pieces = [encode(t) for t in ["\n", "\n\n", ".", " The", " the", "The", " cat", " sat", "."]] + [[EOT_TOKEN]]

    def hf_end(rows: list[list[int]]) -> int | None:
        criteria = stop_sequences_criteria(tok, list(until), 1, len(rows))
        seqs, unfinished = [[0] for _ in rows], [True] * len(rows)
        for t in range(len(rows[0])):
            for i, row in enumerate(rows):
                seqs[i].append(row[t] if unfinished[i] else EOT_TOKEN)
            stop_all = any([c(torch.tensor(seqs), None) for c in criteria])  # noqa: C419  (each one updates)
            unfinished = [u and not (stop_all or s[-1] == EOT_TOKEN) for u, s in zip(unfinished, seqs)]
            if not any(unfinished):
                return t + 1
        return None

    rng = np.random.default_rng(0)
    ends = []
    for _ in range(150):
        n_rows, n = int(rng.integers(1, 4)), 12
        rows = []
        for _ in range(n_rows):
            row = []
            while len(row) < n:
                row += pieces[rng.integers(len(pieces))] if rng.random() < 0.6 else [int(rng.integers(300, 5000))]
            rows.append(row[:n])
        expected = hf_end(rows)
        rule = StopRule(until, n_rows, encode=lambda s: encode(s, allow_eot=True), decode=decode, eot=EOT_TOKEN)
        got = None
        for k in range(3, n + 3, 3):  # fed a few tokens at a time, as the decoder does
            got = rule.update(np.array(rows)[:, :k])
            if got is not None:
                break
        assert got == expected, (rows, got, expected)
        ends.append(expected)
    assert sum(e is None for e in ends) > 10 and sum(e is not None for e in ends) > 50
