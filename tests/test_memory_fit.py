"""Device memory (jaxgpt.memory_fit): a program that does not fit the GPU's pool is refused in one line before it
runs, naming the largest batch that fits; an out-of-memory error while running is one line naming the step and the
checkpoint to resume from.

Without a GPU: the decision with numbers, the search against a stand-in for the compiler, the decision against
steps compiled for an H100 (compile-only topology; ``needs_plugin``), the train command with a faked GPU pool
(real CPU compiles, the pool injected), and the run-time path by fault injection (the step raises the error type
XLA raises).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from jaxgpt import memory_fit
from jaxgpt.memory_fit import GiB, DeviceMemoryError, TrainShape

REPO = Path(__file__).resolve().parent.parent
TINY = ["--config", str(REPO / "configs/tiny-test.yaml"), f"--data_dir={REPO / 'data_cache' / 'shakespeare'}"]
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25769803776 bytes."


# ---- the decision, with numbers -------------------------------------------------------------------------------
def test_a_step_that_fits_the_pool_passes_and_one_that_does_not_names_need_pool_and_the_largest_micro_batch():
    gpt2 = TrainShape(micro_batch=256, micro_steps=2, seq_len=1024)  # 524,288 tokens per step
    pool = int(59.3 * GiB)
    assert memory_fit.train_step_verdict(int(59.3 * GiB), pool, gpt2, best=None, best_needs=None) is None
    msg = memory_fit.train_step_verdict(int(62.2 * GiB), pool, gpt2, best=64, best_needs=int(29.1 * GiB))
    assert "\n" not in msg
    assert "micro-batch 256 x 1024 (2 micro-step(s), 524,288 tokens per step) does not fit" in msg
    assert "needs 62.20 GiB per device" in msg and "pool is 59.30 GiB" in msg
    assert "largest micro-batch that fits at the same tokens per step is 64 (29.10 GiB" in msg
    assert "8 micro-steps" in msg and msg.endswith("--batch_size=64")
    # the config leaves total_batch_tokens unset (it follows batch_size): the suggestion keeps the tokens
    one = TrainShape(micro_batch=8, micro_steps=1, seq_len=1024, processes=2)
    msg = memory_fit.train_step_verdict(5 * GiB, 4 * GiB, one, best=2, best_needs=GiB, tokens_option=True)
    assert msg.endswith("--batch_size=2 --total_batch_tokens=16384") and "4 micro-steps" in msg
    msg = memory_fit.train_step_verdict(5 * GiB, 4 * GiB, one, best=None, best_needs=None, smallest_needs=4 * GiB)
    assert "no micro-batch that keeps 16,384 tokens per step fits" in msg and "the smallest, 4.00 GiB" in msg
    assert "fsdp" in msg


def test_candidates_keep_the_tokens_per_step_and_split_over_the_devices():
    assert memory_fit.candidates(512, 256) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert memory_fit.candidates(48, 24, multiple_of=4) == [4, 8, 12, 16]
    assert memory_fit.candidates(8, 4) == [1, 2]
    assert memory_fit.halvings(100) == [1, 3, 6, 12, 25, 50] and memory_fit.halvings(1) == []


def _remat_like(size: int) -> int:
    """An XLA:GPU-like need: affine in the batch until rematerialisation caps it (gpt2 on an H100 in GiB: b64 29.1,
    b128 54.3, b256 62.2)."""
    return int(min(3.9 + 0.394 * size, 50 + 0.048 * size) * GiB)


@pytest.mark.parametrize("limit_gib, expected", [(53.4, 64), (60.0, 128), (29.0, 32), (1.0, None)])
def test_largest_fitting_is_measured_to_fit_and_its_next_larger_candidate_is_measured_not_to(limit_gib, expected):
    sizes = memory_fit.candidates(512, 256)
    calls = []
    best, measured = memory_fit.largest_fitting(sizes, lambda s: calls.append(s) or _remat_like(s),
                                                int(limit_gib * GiB), {256: _remat_like(256)})
    assert best == expected
    assert len(calls) == len(set(calls)) <= 6  # each compiled once; gallop + bisect, not a sweep of all 8
    limit = int(limit_gib * GiB)
    if best is not None:
        assert measured[best] <= limit
        nxt = sizes[sizes.index(best) + 1] if best != sizes[-1] else 256
        assert measured[nxt] > limit  # (256: the refused one itself, known)
    else:
        assert measured[sizes[0]] > limit


def test_the_pool_is_a_gpus_bytes_limit_and_nothing_on_the_cpu():
    def gpu(limit):
        return SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": 1})

    assert memory_fit.device_pool([gpu(80), gpu(70)]) == 70
    assert memory_fit.device_pool(jax.devices("cpu")) is None  # CPU: no check, no compile
    assert memory_fit.device_pool([SimpleNamespace(platform="gpu", memory_stats=lambda: None)]) is None
    assert memory_fit.device_pool([SimpleNamespace(platform="tpu", memory_stats=lambda: {"bytes_limit": 1})]) is None


def test_out_of_memory_is_xlas_resource_exhausted_runtime_error():
    assert memory_fit.out_of_memory(jax.errors.JaxRuntimeError(OOM))
    assert not memory_fit.out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    assert not memory_fit.out_of_memory(RuntimeError(OOM))
    assert memory_fit.oom_summary(jax.errors.JaxRuntimeError(OOM + "\n" + "x" * 500)) == OOM


# ---- compiled for an H100 (compile-only) -----------------------------------------------------------------------
def _h100_check(config: str, sets: tuple[str, ...], micro_batch: int, pool: int):
    """``check_train_step`` of ``config``'s step at ``micro_batch`` on one compile-only H100 against ``pool``: the
    DeviceMemoryError (or None) and every micro-batch's compiled bytes."""
    from jaxgpt.compile import targets
    from jaxgpt.compile.cli import load_config
    from jaxgpt.compile.program import compile_train_step

    problem = targets.plugin_problem()
    if problem:
        pytest.skip(f"compile-only GPU tests need JAX's CUDA plugin: {problem}")
    cfg = load_config(str(REPO / config), list(sets))
    devices = targets.topology_devices(targets.get_target("h100"), 1)
    measured: dict[int, int] = {}

    def measure(mb: int) -> int:
        measured[mb] = compile_train_step(cfg, devices, micro_batch=mb).memory()["total"]
        return measured[mb]

    cs = compile_train_step(cfg, devices, micro_batch=micro_batch)
    shape = TrainShape(micro_batch, cs.micro_steps, cfg.seq_len)
    needs = measured[micro_batch] = cs.memory()["total"]
    try:
        memory_fit.check_train_step(needs, pool, shape, measure)
    except DeviceMemoryError as e:
        return e, measured, shape
    return None, measured, shape


def test_tiny_step_compiled_for_h100_too_large_for_a_small_pool_names_the_largest_micro_batch_that_fits():
    """The tiny model (bf16, T=64, 4,096 tokens per step) against a 512 MiB pool: its b32 step needs more; the
    suggested micro-batch was compiled and fits with 10% free, the next larger one (the refused b32) does not."""
    pool = 512 * 2**20
    err, measured, shape = _h100_check("configs/tiny-test.yaml", ("precision=bf16", "seq_len=64",
                                                                  "total_batch_tokens=4096"), 32, pool)
    assert err is not None and measured[32] > pool, measured
    best = int(str(err).rsplit("--batch_size=", 1)[1])
    assert measured[best] <= memory_fit.suggestion_limit(pool) < measured[2 * best], measured
    assert f"the largest micro-batch that fits at the same tokens per step is {best}" in str(err)
    assert f"{4096 // 64 // best} micro-steps" in str(err) and "pool is 512.0 MiB" in str(err)


@pytest.mark.slow
def test_gpt2_micro_batch_256_does_not_fit_an_h100_and_64_is_the_largest_that_does():
    """gpt2 (configs/gpt2-124m.yaml, 524,288 tokens per step) at micro-batch 256 x 1024 on one 80 GB H100, JAX's
    default pool (75%: 59.3 GiB): refused, naming the need (62.2 GiB compiled, after XLA's rematerialisation), the
    pool and micro-batch 64 (29.1 GiB, what the H100 measured), with 8 micro-steps; b128 (54.3 GiB) fits the pool
    but not with 10% of it free. Three gpt2 compiles: minutes on 2 CPU cores."""
    from jaxgpt.compile import targets

    pool = memory_fit.topology_pool(targets.get_target("h100"), 0.75)
    err, measured, shape = _h100_check("configs/gpt2-124m.yaml", (), 256, pool)
    assert err is not None, measured
    msg = str(err)
    assert f"needs {measured[256] / GiB:.2f} GiB per device" in msg and f"pool is {pool / GiB:.2f} GiB" in msg
    assert msg.endswith("--batch_size=64") and "8 micro-steps" in msg and "524,288 tokens per step" in msg
    assert measured[64] <= memory_fit.suggestion_limit(pool) < measured[128] < measured[256]
    assert 28 * GiB < measured[64] < 30.5 * GiB  # 29.1 GiB measured on the H100 (shared/gpu/h100-2026-11-26)


# ---- the train command ---------------------------------------------------------------------------------------
def test_train_refuses_a_step_larger_than_a_faked_gpu_pool_in_one_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                                          capsys):
    """The pool injected (CPU devices have none); the run's step and the smaller candidate really compiled
    (XLA:CPU: b4 needs 119 MiB, b2 50 MiB). The run directory it created is gone again."""
    from jaxgpt.train import main

    pools = []
    monkeypatch.setattr(memory_fit, "device_pool", lambda devices: pools.append(devices) or 100 * 2**20)
    out = tmp_path / "fresh"
    assert main(TINY + [f"--out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: micro-batch 4 x 32 (2 micro-step(s), 256 tokens per step) does not fit the GPU")
    assert "pool is 100.0 MiB" in err and "at the same tokens per step is 2 (" in err and "4 micro-steps" in err
    assert err.endswith("--batch_size=2")
    assert not out.exists()
    assert pools and all(d.platform == "cpu" for d in pools[0])


def test_a_refused_run_leaves_an_existing_directory_as_it_was(tmp_path, monkeypatch, capsys):
    """A directory of the user's: nothing added (not even the lock file), nothing removed. The compiled figures are
    faked here (the test above compiles them): no micro-batch fits."""
    from jaxgpt.train import main

    monkeypatch.setattr(memory_fit, "device_pool", lambda devices: 1000)
    monkeypatch.setattr(memory_fit, "train_step_bytes", lambda jitted, state, mesh, *, rows, **kw: 2000 * rows)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(TINY + [f"--out_dir={kept}"]) == 2
    err = capsys.readouterr().err
    assert "does not fit the GPU" in err and "--batch_size=" not in err
    assert "no micro-batch that keeps 256 tokens per step fits with 10% of the pool free" in err
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
def test_train_out_of_memory_while_running_names_the_step_and_the_checkpoint_to_resume_from(tmp_path, monkeypatch,
                                                                                           capsys):
    """Fault injection: the 5th step raises what XLA raises when the device runs out (jax.errors.JaxRuntimeError,
    RESOURCE_EXHAUSTED). Checkpoint 4 was held for step 5's check, so the newest one on disk is 2. The pool is faked
    (large) so that the check before the first step runs and passes: the first step then reuses the program the
    check compiled (no compile in that call)."""
    from jax._src import dispatch, monitoring

    from jaxgpt import step as step_lib
    from jaxgpt.train import main

    real = step_lib.make_train_step
    compiles, first_call = [0], []

    def count(event, duration, **kwargs):
        compiles[0] += event == dispatch.BACKEND_COMPILE_EVENT

    def failing_at_step_5(*args, **kwargs):
        step_fn = real(*args, **kwargs)
        calls = [0]

        def fn(*a, **k):
            calls[0] += 1
            if calls[0] == 5:
                raise jax.errors.JaxRuntimeError(OOM)
            before = compiles[0]
            out = step_fn(*a, **k)
            if calls[0] == 1:
                first_call.append(compiles[0] - before)
            return out

        fn.jitted, fn.mesh = step_fn.jitted, step_fn.mesh
        return fn

    monkeypatch.setattr(step_lib, "make_train_step", failing_at_step_5)
    monkeypatch.setattr(memory_fit, "device_pool", lambda devices: 2**40)
    monitoring.register_event_duration_secs_listener(count)
    out = tmp_path / "run"
    try:
        assert main(TINY + [f"--out_dir={out}", "--eval_interval=0"]) == 2
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert first_call == [0]  # the check's compiled step was the one the first step ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"error: out of device memory at step 5 ({OOM})")
    ckpts = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts[-1] == 2, ckpts
    assert f"the newest checkpoint is step 2 in {out / 'checkpoints'}" in err[0]
    assert "Resume with the same command" in err[0]
    assert (out / ".jaxgpt.lock").read_text() == ""  # released


# ---- eval and generate ------------------------------------------------------------------------------------------
class _Program:
    """Stands in for a jitted function: ``.lower(*args).compile().memory_analysis()`` needs ``per_row`` bytes per row
    of its first batch-shaped argument (the compiles themselves are XLA's, checked above for the train step)."""

    def __init__(self, per_row: int, arg: int):
        self.per_row, self.arg, self.rows = per_row, arg, []

    def lower(self, *args, **static):
        rows = args[self.arg].shape[0]
        self.rows.append(rows)
        stats = SimpleNamespace(argument_size_in_bytes=self.per_row * rows, temp_size_in_bytes=0,
                                output_size_in_bytes=0, alias_size_in_bytes=0, generated_code_size_in_bytes=0)
        return SimpleNamespace(compile=lambda: SimpleNamespace(memory_analysis=lambda: stats))


def test_generate_refuses_samples_that_do_not_fit_a_faked_gpu_pool(monkeypatch):
    from flax import nnx

    from jaxgpt import generate as gen
    from jaxgpt.config import GPTConfig
    from jaxgpt.generate import decode
    from jaxgpt.model import GPT

    program = _Program(per_row=100 * 2**20, arg=2)  # (graphdef, state, ctx, ...): ctx's rows
    monkeypatch.setattr(decode, "_generate_compiled", program)
    monkeypatch.setattr(memory_fit, "device_pool", lambda devices: 1000 * 2**20)
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(DeviceMemoryError) as e:  # 2 prompts x 8 samples: 16 rows, 1.6 GB
        gen.generate(model, [[1, 2, 3], [4, 5, 6]], max_new_tokens=4, num_samples=8)
    msg = str(e.value)
    assert "generating 8 sample(s) of 4 tokens does not fit the GPU" in msg and "needs 1.56 GiB" in msg
    assert "pool is 1000.0 MiB" in msg and msg.endswith("the largest num_samples (--num-samples) that fits (halving "
                                                        "it) is 4 (800.0 MiB, 10% of the pool kept free)")
    assert program.rows == [16, 8]  # the call's own shape, then 4 samples (fits: 8 was refused)
    assert gen.main(["--init-from", "random:tiny", "--prompt-ids", "1,2,3", "--num-samples", "16",
                     "--max-new-tokens", "4"]) == 2


def test_eval_refuses_a_batch_that_does_not_fit_a_faked_gpu_pool(monkeypatch):
    from jaxgpt.eval import val_loss

    monkeypatch.setattr(memory_fit, "device_pool", lambda devices: 2**30)
    program = _Program(per_row=300 * 2**20, arg=1)  # (state, x, y): x's rows
    val_loss._check_memory(program, None, 2, 64)  # 600 MiB: fits
    with pytest.raises(DeviceMemoryError, match=r"the loss at --batch-size 16 x 64 tokens does not fit the GPU: the "
                                                r"compiled program needs 4.69 GiB .* pool is 1.00 GiB.* largest "
                                                r"--batch-size that fits \(halving it\) is 2 \(600.0 MiB"):
        val_loss._check_memory(program, None, 16, 64)
    assert program.rows == [2, 16, 8, 4, 1, 2]  # gallop down 8, 4, 1 (fits), then bisect: 2


def test_generate_out_of_memory_while_running_is_one_line_and_other_runtime_errors_propagate(monkeypatch, capsys):
    from jaxgpt.generate import cli

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(OOM + "\n" + "detail " * 100)

    monkeypatch.setattr(cli, "generate_samples", oom)
    assert cli.main(["--init-from", "random:tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: out of device memory ({OOM}); free the GPU's memory (another process on it?) or use a "
                   "smaller --num-samples, and run it again"]

    def crash(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(cli, "generate_samples", crash)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        cli.main(["--init-from", "random:tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"])


def test_eval_out_of_memory_while_running_names_the_batch_size_option(monkeypatch, capsys):
    from jaxgpt.eval import cli

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(OOM)

    monkeypatch.setattr(cli, "prepare", lambda args: {"outputs": {}})
    monkeypatch.setattr(cli, "run", oom)
    assert cli.main(["--task", "val-loss", "--init-from", "random:tiny"]) == 2
    assert capsys.readouterr().err.strip().endswith("use a smaller --batch-size, and run it again")
