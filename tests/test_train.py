"""jaxgpt.train: config and CLI, a real tiny run (files), SIGKILL + resume bit-identity, NaN stop (more on
divergence, rollback and the run directory's lock in test_train_safety.py).

The runs are real subprocesses (`python -m jaxgpt.train --config configs/tiny-test.yaml ...`) sharing a
persistent XLA compilation cache, so only the first one pays for compiling.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from jaxgpt.config import PRESETS, ConfigError
from jaxgpt.train import DEFAULT_CONFIG, TrainConfig, main, parse_args, read_metrics
from tests.runs import checkpoint_then_two_steps, sigkill_when

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
TINY = ["--config", str(REPO / "configs/tiny-test.yaml")]
RUN_ARGS = ["--max_steps=12", "--checkpoint_interval=3", "--eval_interval=4",
            f"--data_dir={REPO / 'data_cache' / 'shakespeare'}"]


# ---- configuration and command line ---------------------------------------------------------------------
def test_every_preset_loads_and_divides():
    names = {p.name for p in CONFIGS}
    assert {"gpt2-124m.yaml", "shakespeare-cpu.yaml", "finetune-gpt2.yaml", "tiny-test.yaml"} <= names
    for path in CONFIGS:
        cfg = TrainConfig.load(path)
        assert cfg.micro_steps() >= 1, path
    big = TrainConfig.load(REPO / "configs/gpt2-124m.yaml")
    assert big.batch_size == 64 and (big.micro_steps(), big.micro_steps(8)) == (8, 1)  # jaxgpt.compile's H100 fit
    assert big.model.n_layer == 12 and big.model.padded_vocab_size == 50304 and big.optim.lr == 6e-4
    assert big.optim.warmup_steps == 715 and big.max_steps == big.optim.decay_steps == 19073
    assert TrainConfig.load(None) == TrainConfig.load(DEFAULT_CONFIG)
    assert DEFAULT_CONFIG.name == "shakespeare-char-cpu.yaml"  # nanoGPT's first run (issue 34)


def test_cli_overrides_any_field():
    path, overrides, printing = parse_args(TINY + ["--optim.lr=3e-4", "--max_steps", "100", "--model.n_layer=3",
                                                   "--sample_prompt=to be or", "--sample_top_k=null",
                                                   "--dropout=0.1", "--resume=never"])
    assert path == REPO / "configs/tiny-test.yaml" and not printing
    cfg = TrainConfig.load(path, overrides)
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)  # YAML alone reads 3e-4 as a string
    assert cfg.max_steps == 100 and cfg.sample_prompt == "to be or" and cfg.sample_top_k is None
    assert cfg.model.n_layer == 3 and cfg.model.n_embd == PRESETS["tiny"]["n_embd"]  # merged over the preset
    assert cfg.dropout == 0.1 and cfg.resume == "never"
    # a resolved config round-trips through its dict
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("args, expected", [
    (["--bogus=1"], "unknown key(s) ['bogus']; valid keys are ["),
    (["--optim.bogus=1"], "OptimConfig: unknown key(s) ['bogus']; valid keys are ['adagrad_initial_accumulator'"),
    (["--model.n_lyer=2"], "GPTConfig: unknown key(s) ['n_lyer']; valid keys are ['bias', 'block_size'"),
    (["--optim.lr=fast"], "OptimConfig.lr = 'fast': expected a number"),
    (["--resume=sometimes"], "TrainConfig.resume = 'sometimes': allowed values are ['auto', 'never', 'must']"),
    (["--max_steps=0"], "TrainConfig.max_steps = 0: must be an integer >= 1"),
    (["--model_preset=huge"], "TrainConfig.model_preset = 'huge': valid presets are"),
    (["--total_batch_tokens=1000"], "must be a multiple of batch_size * seq_len * processes = 4 * 32 * 1 = 128"),
    (["--seq_len=65"], "TrainConfig.seq_len = 65: must be <= model.block_size (64)"),
    (["--init_from=gpt2"], "init_from: gpt2 takes the model shape from the checkpoint"),
    (["positional"], "unexpected argument 'positional'"),
    (["--max_steps"], "--max_steps needs a value"),
])
def test_cli_errors_exit_2_without_traceback(capsys, args, expected):
    assert main(TINY + args) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_missing_config_file_and_help(capsys):
    assert main(["--config", "configs/nope.yaml"]) == 2
    assert "configs/nope.yaml" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--optim.lr=<float>" in out and "--model.n_layer=<int>" in out


def test_init_from_a_missing_directory_and_advice_that_works(tmp_path, monkeypatch, capsys):
    """A mistyped init_from is a missing directory (not "a GPT-2 model"); a GPT-2 model given to the default
    (character) config names the fine-tuning config, and the command it names loads."""
    from flax import nnx

    from jaxgpt import weights
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT

    (tmp_path / "runs" / "shakespeare-char-cpu").mkdir(parents=True)
    weights.save_hf(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)), tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert main(["--init_from=runs/shakespeare-char-cpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TrainConfig.init_from = 'runs/shakespeare-char-cpy': no such directory: "
                          "runs/shakespeare-char-cpy (did you mean runs/shakespeare-char-cpu?); init_from takes "
                          "scratch") and err.count("\n") == 1 and "GPT-2 model" not in err, err
    for extra in ([], ["--tokenizer=gpt2"]):  # the default config's tokenizer, then its model shape
        assert main(["--init_from=hf", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith(
            "fine-tune with --config configs/finetune-gpt2.yaml --init_from=hf"), err
    advice = err.rstrip().rsplit("fine-tune with ", 1)[1].split()
    config_path, overrides, _ = parse_args(advice)
    cfg = TrainConfig.load(REPO / config_path, overrides)  # (the repository's configs/)
    assert cfg.init_from == "hf" and cfg.tokenizer == "gpt2" and cfg.model is None


def test_max_steps_inside_the_schedule_warns_in_one_line_with_the_flags_that_fit_it(tmp_path, capsys):
    default = TrainConfig.load(None)
    assert (default.max_steps, default.optim.warmup_steps, default.optim.decay_steps) == (2000, 100, 2000)
    assert default.schedule_warning() is None
    for max_steps, says, fix in ((30, "inside the learning-rate warm-up (optim.warmup_steps 100",
                                  {"optim.warmup_steps": 1, "optim.decay_steps": 30}),
                                 (500, "before the cosine decay ends (optim.decay_steps 2000",
                                  {"optim.decay_steps": 500}),
                                 (100, "before the cosine decay ends", {"optim.warmup_steps": 5, "optim.decay_steps": 100})):
        warning = TrainConfig.load(None, {"max_steps": max_steps}).schedule_warning()
        flags = " ".join(f"--{k}={v}" for k, v in fix.items())
        assert warning.startswith(f"warning: max_steps {max_steps} ends the run {says}") and warning.endswith(
            f"to fit the schedule to the run set {flags}") and "\n" not in warning, warning
        _, overrides, _ = parse_args([f"--max_steps={max_steps}", *flags.split()])
        assert TrainConfig.load(None, overrides).schedule_warning() is None  # the advice fits it
    constant = TrainConfig.load(REPO / "configs/finetune-gpt2.yaml", {"max_steps": 2, "optim.warmup_steps": 5})
    assert constant.schedule_warning().endswith("set --optim.warmup_steps=0")  # no decay to fit
    assert TrainConfig.load(REPO / "configs/finetune-gpt2.yaml").schedule_warning() is None
    # the command prints it before the run (which here stops at once: out_dir is a file)
    (tmp_path / "a_file").write_text("")
    assert main(["--max_steps=30", f"--out_dir={tmp_path / 'a_file'}"]) == 2
    assert capsys.readouterr().err.startswith("warning: max_steps 30 ends the run inside the learning-rate warm-up")


@pytest.mark.parametrize("args, expected", [
    (["--config", "configs/nope.yaml"], "error: config file 'configs/nope.yaml' does not exist"),
    (["--batch_size=-3"], "error: TrainConfig.batch_size = -3: must be an integer >= 1"),
    (["--optim.lrr=1"], "error: OptimConfig: unknown key(s) ['lrr']; valid keys are ["),
    (["positional"], "error: unexpected argument 'positional'"),
])
def test_torch_ref_train_has_jaxgpt_trains_config_errors(capsys, args, expected):
    from torch_ref import train as ref_train

    assert main(args) == ref_train.main(args) == 2
    jax_err, torch_err = capsys.readouterr().err.splitlines()
    assert jax_err == torch_err and torch_err.startswith(expected), torch_err


def test_torch_ref_train_help_and_its_output_folder(tmp_path, capsys):
    from torch_ref import train as ref_train

    assert ref_train.main(["--help"]) == 0
    out = capsys.readouterr().out
    head, usage_line = out.split("\n\n")[:2]
    assert head.startswith("python -m torch_ref.train: jaxgpt.train's run of a config, in plain PyTorch") and \
        head.endswith("(beside jaxgpt's run, not over it).") and "``" not in head  # the whole description
    assert usage_line == "usage: python -m torch_ref.train [--config FILE] [--print-config] [--FIELD=VALUE ...]"
    for field in ("--optim.lr=<float>", "--model.n_layer=<int>", "--max_steps=<int>", "--out_dir=<str>"):
        assert f"\n  {field}\n" in out
    assert "--gelu=" not in out and "--mesh." not in out  # jaxgpt's alone: not read
    out_dir = tmp_path / "torch-run"
    assert ref_train.main(TINY + ["--max_steps=1", "--eval_steps=1", "--sample_len=2", f"--out_dir={out_dir}",
                                  f"--data_dir={REPO / 'data_cache' / 'shakespeare'}"]) == 0
    printed = capsys.readouterr().out
    assert f"writing metrics.jsonl, samples.txt and summary.json to {out_dir}\n" in printed
    assert f"metrics.jsonl, samples.txt, summary.json in {out_dir}\n" in printed
    assert {p.name for p in out_dir.iterdir()} == {"metrics.jsonl", "samples.txt", "summary.json"}


def test_print_config(capsys):
    assert main(TINY + ["--print-config", "--optim.lr=2e-3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 2e-3 and printed["model"]["n_layer"] == 2


def test_config_errors_are_config_errors():
    with pytest.raises(ConfigError, match="needs a model shape"):
        TrainConfig.from_dict({})


# ---- real runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "JAX_PLATFORMS": "cpu"}


def train_cmd(out_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "jaxgpt.train", *TINY, f"--out_dir={out_dir}", *RUN_ARGS, *args]


def run(cmd, env, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    return [(r["type"], r["step"], r["loss"] if r["type"] == "train" else r["val_loss"])
            for r in read_metrics(run_dir) if r["type"] in ("train", "eval")]  # not the kernels / resume records


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, run_env):
    out = tmp_path_factory.mktemp("reference")
    proc = run(train_cmd(out, "--sample_interval=0"), run_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_run_writes_metrics_plot_samples_and_checkpoints(reference_run):
    out, proc = reference_run
    records = read_metrics(out)
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert [r["step"] for r in evals] == [0, 4, 8, 12]
    for r in train:
        for k in ("loss", "lr", "grad_norm", "step_time", "tokens_per_s", "flops_per_s", "tokens"):
            assert isinstance(r[k], (int, float)), (k, r)
    assert train[-1]["loss"] < train[0]["loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "--- sample 0 (step 12) ---" in (out / "samples.txt").read_text()
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["n_layer"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] == evals[-1]["val_loss"] and summary["train_loss"] == train[-1]["loss"]
    kept = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [9, 12]  # keep_checkpoints: 2
    assert "done: step 12" in proc.stderr + proc.stdout
    assert "init scratch" in proc.stdout and "resumed" not in proc.stdout


def test_sigkill_then_resume_repeats_the_losses_bit_for_bit(tmp_path, reference_run, run_env):
    ref_dir, _ = reference_run
    out = tmp_path / "killed"
    slow = {**run_env, "JAXGPT_DEBUG_STEP_SLEEP": "0.25"}  # test hook: room to kill it mid-run
    proc = subprocess.Popen(train_cmd(out), cwd=REPO, env=slow, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    sigkill_when(proc, checkpoint_then_two_steps(out))  # a checkpoint exists and the run went on
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists()
    killed_at = max(r["step"] for r in read_metrics(out) if r["type"] == "train")
    assert killed_at < 12

    resumed = run(train_cmd(out, "--resume=must"), run_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout
    assert "resumed (run begun from scratch)" in resumed.stdout and "init scratch" not in resumed.stdout
    assert losses(out) == losses(ref_dir)  # train and val losses, every step, bit-identical


def test_resume_must_without_checkpoint_and_mismatch(tmp_path, reference_run, capsys):
    ref_dir, _ = reference_run
    assert main(TINY + [f"--out_dir={tmp_path / 'empty'}", *RUN_ARGS, "--resume=must"]) == 2
    err = capsys.readouterr().err
    assert "resume: must" in err and "no complete checkpoint" in err and "Traceback" not in err
    before = (ref_dir / "metrics.jsonl").read_text()
    assert main(TINY + [f"--out_dir={ref_dir}", *RUN_ARGS, "--model.n_embd=48"]) == 2
    err = capsys.readouterr().err
    assert "model.n_embd: 32 -> 48" in err and "use --model.n_embd=32" in err and "Traceback" not in err
    assert (ref_dir / "metrics.jsonl").read_text() == before  # nothing touched


def test_nan_loss_stops_and_saves_no_unchecked_state(tmp_path, capsys):
    """lr 1e9: the state after step 1 gives a non-finite (or exploded) loss at step 2. The checkpoint due at
    step 1 would hold that state, so it is never written: only states whose loss was seen healthy are saved."""
    out = tmp_path / "nan"
    code = main(TINY + [f"--out_dir={out}", *RUN_ARGS, "--optim.lr=1e9", "--optim.warmup_steps=0",
                        "--optim.grad_clip=0", "--checkpoint_interval=1", "--eval_interval=0"])
    err = capsys.readouterr().err
    assert code == 3, err[-3000:]
    assert "Traceback" not in err
    records = read_metrics(out)
    train = [r for r in records if r["type"] == "train"]
    bad_step = len(train) + 1  # diverged steps are logged as divergence records, not train records
    assert [r["step"] for r in records if r["type"] == "divergence"] == [bad_step]
    assert f"step {bad_step}: loss " in err and "training diverged" in err
    assert f"The newest healthy state is step {bad_step - 2}" in err
    kept = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == list(range(max(1, bad_step - 3), bad_step - 1))  # keep 2 of the checked steps < bad_step - 1
    if kept:
        assert f"the last good checkpoint is step {kept[-1]}" in err
    else:
        assert "no checkpoint was written before it" in err
    assert (out / "loss.png").exists()


def test_init_from_a_hugging_face_directory(tmp_path):
    """init_from takes a local HF GPT-2 directory (what `python -m jaxgpt.checkpoint export --to-hf` writes);
    the shape comes from its config.json and `dropout` overrides the checkpoint's rate."""
    import numpy as np
    from flax import nnx

    from jaxgpt import weights
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy
    from jaxgpt.train import build_model

    src = GPT(GPTConfig.preset("tiny", dropout=0.1), rngs=nnx.Rngs(3))
    weights.save_hf(src, tmp_path / "hf")
    cfg = TrainConfig.load(REPO / "configs/finetune-gpt2.yaml", {"init_from": str(tmp_path / "hf"), "seq_len": 32})
    model = build_model(cfg, Policy.fp32())
    assert model.config == src.config.replace(dropout=0.0)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(src, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError, match="seq_len = 65: must be <= the checkpoint's block_size"):
        build_model(TrainConfig.load(REPO / "configs/finetune-gpt2.yaml",
                                     {"init_from": str(tmp_path / "hf"), "seq_len": 65}), Policy.fp32())


def test_metrics_log_tensorboard_when_importable_and_torn_lines(tmp_path, monkeypatch):
    import types

    from jaxgpt.train import MetricsLog

    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("init", logdir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=Writer))
    log = MetricsLog(tmp_path, tensorboard=True, truncate_after=None)
    log.write({"type": "train", "step": 1, "loss": 2.5, "mfu": None})
    log.write({"type": "eval", "step": 2, "val_loss": 2.0})
    log.close()
    assert calls == [("init", str(tmp_path / "tb")), ("train/loss", 2.5, 1), ("eval/val_loss", 2.0, 2), ("close",)]
    # a process killed mid-write leaves a torn last line: resuming drops it with the later steps
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"type": "train", "step": 3, "lo')
    MetricsLog(tmp_path, tensorboard=False, truncate_after=1).close()
    assert read_metrics(tmp_path) == [{"type": "train", "step": 1, "loss": 2.5, "mfu": None}]
