"""Checkpoint integrity: every kind of damage to the newest step is detected and named, never a traceback or a
silent wrong load; resume, generate and export fall back to the newest intact step (only training moves the
damaged one aside, never deleting it); list shows each step's state; exports never destroy anything."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from jaxgpt import exportdir
from jaxgpt.checkpoint import (CheckpointDamaged, Checkpoints, NoCheckpointError, export, load_model,
                               load_model_and_step, main)
from jaxgpt.config import GPTConfig, to_dict
from jaxgpt.model import GPT
from jaxgpt.optim import OptimConfig, make_optimizer

CFG = GPTConfig.preset("tiny")
CONFIG = {"model": to_dict(CFG), "optim": {"name": "adamw"}}


@pytest.fixture(scope="module")
def states():
    """Three distinct (params, opt_state) pairs: the checkpoints of steps 10, 20 and 30."""
    opt = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10))
    out = []
    for seed in (10, 20, 30):
        params = nnx.state(GPT(CFG, rngs=nnx.Rngs(seed)), nnx.Param)
        grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed), p.shape) * 1e-2, params)
        _, opt_state = opt.update(grads, opt.init(params), params)  # non-zero moments
        out.append((params, opt_state))
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, states) -> Path:
    run = tmp_path_factory.mktemp("pristine") / "run"
    with Checkpoints(run, keep=3) as c:
        for step, (params, opt_state) in zip((10, 20, 30), states):
            c.save(step, params=params, opt_state=opt_state, config=CONFIG, extra={"loss": step / 10})
    return run


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def data_files(run: Path, step: int, item: str = "params") -> list[Path]:
    """The item's array data files (OCDBT's data of process 0), largest first (the token embedding's chunk)."""
    files = [p for p in (run / "checkpoints" / str(step) / item / "ocdbt.process_0" / "d").iterdir()]
    return sorted(files, key=lambda p: -p.stat().st_size)


def flip_bits(path: Path, n: int = 16) -> None:
    b = bytearray(path.read_bytes())
    for i in range(n):
        b[len(b) // 2 + 97 * i] ^= 1 << (i % 8)
    path.write_bytes(bytes(b))


def damage(run: Path, how: str) -> tuple[str, str | None]:
    """Damage step 30 as a new user did; return what the report must name, and an item it must not name (only
    the item that failed is reported)."""
    step = run / "checkpoints" / "30"
    if how == "bit flip":
        flip_bits(data_files(run, 30)[0])
        return "params/: the bytes read differ from the ones saved: wte/embedding/value: digest", "opt_state/"
    if how == "truncated array":
        f = data_files(run, 30)[0]
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return "step 30 is damaged: params/: ", "opt_state/"
    if how == "garbage array":
        f = data_files(run, 30, "opt_state")[0]
        f.write_bytes(os.urandom(f.stat().st_size))
        return "step 30 is damaged: opt_state/: ", "params/"
    if how == "garbage _METADATA":
        (step / "params" / "_METADATA").write_bytes(os.urandom(4000))
        return "step 30 is damaged: params/_METADATA: not JSON", "opt_state/"
    if how == "deleted _METADATA":
        (step / "params" / "_METADATA").unlink()
        return "step 30 is damaged: params/_METADATA: missing", "opt_state/"
    if how == "empty _METADATA object":
        (step / "opt_state" / "_METADATA").write_text("{}")
        return "step 30 is damaged: opt_state/_METADATA: has no tree_metadata", "params/"
    if how == "garbage meta JSON":
        (step / "meta" / "metadata").write_bytes(b"\xc5\x00garbage" + os.urandom(64))
        return "meta/ (JSON)", None
    if how == "garbage config JSON":
        (step / "config" / "metadata").write_text("{not json")
        return "config/ (JSON)", None
    raise ValueError(how)


KINDS = ["bit flip", "truncated array", "garbage array", "garbage _METADATA", "deleted _METADATA",
         "empty _METADATA object", "garbage meta JSON", "garbage config JSON"]


def leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("how", KINDS)
def test_damage_is_named_and_the_newest_intact_step_restored(run, states, how):
    what, not_named = damage(run, how)
    params, opt_state = states[0]
    with Checkpoints(run, keep=3) as c:
        with pytest.raises(CheckpointDamaged) as e:  # an explicit step: no fallback
            c.restore(30, params=params, opt_state=opt_state)
        assert e.value.step == 30 and what in str(e.value) and "checkpoint step 30 is damaged" in str(e.value)
        assert not_named is None or not_named not in str(e.value), str(e.value)
        assert "pytree structure" not in str(e.value) and "KeyError" not in str(e.value)
        (row,) = [r for r in c.states() if r.step == 30]  # list says the same
        assert row.state == "damaged" and what.split("damaged: ")[-1] in f"{row.reason}", row
        r = c.restore_newest(params=params, opt_state=opt_state)
        assert r.step == 20 and r.verified and [d.step for d in r.skipped] == [30]
        assert c.all_steps() == [10, 20, 30]  # reported, not moved: a writer moves it (training, as here)
        for d in r.skipped:
            c.move_aside(d.step, "damaged", str(d))
        assert leaves_equal(r.params, states[1][0]) and leaves_equal(r.opt_state, states[1][1])
        assert c.all_steps() == [10, 20]  # moved aside: keep-K no longer counts it ...
        (moved,) = c.set_aside("damaged")
        assert moved.name.startswith("30-") and what in (moved / "reason.txt").read_text()
        c.save(40, params=params, opt_state=opt_state, config=CONFIG)
        c.save(50, params=params, opt_state=opt_state, config=CONFIG)
        c.wait()
        assert c.all_steps() == [20, 40, 50] and c.set_aside("damaged") == [moved]  # ... and never deletes it


@pytest.mark.parametrize("how", ["bit flip", "garbage meta JSON"])
def test_readers_report_and_skip_without_moving(run, how, capsys):
    damage(run, how)
    model, step = load_model_and_step(run)
    assert step == 20 and leaves_equal(nnx.state(model, nnx.Param), GPT(CFG, rngs=nnx.Rngs(20)))
    assert "checkpoint step 30 is damaged" in capsys.readouterr().err
    assert (run / "checkpoints" / "30").is_dir()  # a reader moves nothing
    assert main(["list", str(run)]) == 1
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): line for line in out.splitlines() if line.split()[0].isdigit()}
    assert "ok" in rows[10] and "ok" in rows[20] and "damaged" in rows[30] and "loss 2.0000" in rows[20]
    assert main(["export", str(run), "--step", "30", "--to-hf", str(run.parent / "hf")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint step 30 is damaged" in err and "Traceback" not in err
    assert not (run.parent / "hf").exists()
    assert main(["export", "--run-dir", str(run), "--to-hf", str(run.parent / "hf")]) == 0
    assert json.loads((run.parent / "hf" / "jaxgpt_export.json").read_text())["step"] == 20


def test_list_states_incomplete_unverified_and_positional_run_dir(run, capsys):
    (run / "checkpoints" / "40.orbax-checkpoint-tmp-123").mkdir()  # a save killed midway
    meta = run / "checkpoints" / "10" / "meta" / "metadata"  # as an older jaxgpt saved it: no digests
    m = json.loads(meta.read_text())
    del m["digests"]
    meta.write_text(json.dumps(m))
    assert main(["list", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    states = {int(line.split()[0]): line.split()[1] for line in out.splitlines() if line.split()[0].isdigit()}
    assert states == {10: "unverified", 20: "ok", 30: "ok", 40: "incomplete"}
    with Checkpoints(run, read_only=True) as c:
        assert c.restore(10, params=GPT(CFG, rngs=nnx.Rngs(0)) and nnx.state(GPT(CFG, rngs=nnx.Rngs(0)),
                                                                            nnx.Param)).verified is False
    with pytest.raises(SystemExit):
        main(["list"])  # no run directory: argparse's usage error (exit 2)
    assert "give the run directory" in capsys.readouterr().err


def test_no_intact_step_is_a_clear_error(run, capsys):
    for s in (10, 20, 30):
        flip_bits(data_files(run, s)[0])
    with pytest.raises(NoCheckpointError, match="no intact checkpoint.*\n.*step 30 is damaged"):
        load_model(run, report=lambda m: None)
    assert main(["export", str(run), "--to-torch", str(run.parent / "m.pt")]) == 2
    assert "no intact checkpoint" in capsys.readouterr().err


def test_digests_survive_a_mesh_change_and_catch_one_flipped_bit():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxgpt.checkpoint import tree_digests

    x = jax.random.normal(jax.random.key(0), (8, 6))
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    sharded = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    flipped = np.asarray(x).copy()
    flipped.view(np.uint32)[3, 4] ^= 1 << 31  # one bit: the sign of one element
    swapped, moved = np.asarray(x).copy(), np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two rows exchanged
    moved[:, [2, 5]] = moved[:, [5, 2]]  # two columns exchanged
    for kind in ("xxh3", "dev"):  # the host digest, and the device one used for arrays spread over processes
        like = {"x": f"{kind}:"}
        d = tree_digests({"x": x}, like=like)["x"]
        assert d.startswith(kind + ":") and tree_digests({"x": sharded}, like=like)["x"] == d
        for damaged in (flipped, swapped, moved):
            assert tree_digests({"x": jax.numpy.asarray(damaged)}, like=like)["x"] != d
    assert tree_digests({"x": x})["x"].startswith("xxh3:")  # one process holds it whole
    ints = {"i": jax.numpy.arange(5, dtype=jax.numpy.int32), "b": jax.numpy.ones(3, jax.numpy.bfloat16)}
    assert set(tree_digests(ints)) == {"i", "b"}


# ---- exports that never destroy ---------------------------------------------------------------------------
def test_export_refuses_foreign_targets_and_the_run_itself(run, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    for target in (foreign, run, run / "checkpoints", run / "checkpoints" / "30", tmp_path):
        assert main(["export", str(run), "--to-hf", str(target)]) == 2, target
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("other files in it" in err or "must never replace" in err), err
    assert (foreign / "notes.txt").read_text() == "precious"
    assert main(["export", str(run), "--to-hf", str(run / "checkpoints"), "--overwrite"]) == 2  # never, even so
    assert main(["export", str(run), "--to-hf", str(run / "checkpoints" / "30" / "x"), "--overwrite"]) == 2
    with Checkpoints(run, read_only=True) as c:
        assert c.all_steps() == [10, 20, 30] and [s.state for s in c.states()] == ["ok"] * 3
        assert c.directory == run / exportdir.CHECKPOINTS  # the directory exportdir guards is the checkpoints'

    # a file where a directory goes and the other way round: errors, no traceback
    assert main(["export", str(run), "--to-hf", str(foreign / "notes.txt")]) == 2
    assert main(["export", str(run), "--to-torch", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a directory" in err and "is a directory; give a file name" in err

    # into a subdirectory of the run (not its checkpoints), then again over our own export: fine
    hf, pt = run / "export-hf", tmp_path / "ref.pt"
    for _ in range(2):
        assert main(["export", str(run), "--to-hf", str(hf), "--to-torch", str(pt)]) == 0
    assert exportdir._is_our_file(pt) and sorted(torch.load(pt, weights_only=True)) == sorted(
        __import__("jaxgpt.weights", fromlist=["x"]).to_torch_state_dict(load_model(run)))
    (tmp_path / "other.pt").write_bytes(b"someone else's file")
    assert main(["export", str(run), "--to-torch", str(tmp_path / "other.pt")]) == 2
    assert (tmp_path / "other.pt").read_bytes() == b"someone else's file"
    assert main(["export", str(run), "--to-torch", str(tmp_path / "other.pt"), "--overwrite"]) == 0
    assert main(["export", str(run), "--to-hf", str(foreign), "--overwrite"]) == 0  # with consent
    assert not (foreign / "notes.txt").exists() and (foreign / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no leftovers


def test_an_interrupted_export_leaves_the_old_one_whole(run, tmp_path, monkeypatch):
    import safetensors.numpy

    hf = tmp_path / "hf"
    export(run, to_hf=hf, step=10)
    before = {p.name: p.read_bytes() for p in hf.iterdir()}

    def broken(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(exportdir.ExportError, match=f"cannot write {hf}: disk full"):  # not a bare OSError
        export(run, to_hf=hf, step=20)
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(exportdir.ExportError, match="sd.pt: disk full") as e:
        export(run, to_torch=tmp_path / "sd.pt")
    assert isinstance(e.value, OSError)  # still one, for callers of save_hf that catch OSError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporary files left


def test_the_command_line_prints_no_traceback_for_a_truncated_array(run, tmp_path):
    """orbax abandons its other reads when one fails; Python would print them at exit. Nothing but our lines."""
    import subprocess
    import sys

    f = data_files(run, 30)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    proc = subprocess.run([sys.executable, "-m", "jaxgpt.checkpoint", "export", str(run), "--to-hf",
                           str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("warning: checkpoint step 30 is damaged: params/: ")
    # an array's name (which array fails first depends on the read order: they share the truncated data file)
    assert re.search(r"\b(wte|wpe|ln_f|h\.\d+)\.[\w.]*value\b", proc.stderr.splitlines()[0]), proc.stderr
    assert "opt_state/" not in proc.stderr.splitlines()[0]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert json.loads((tmp_path / "hf" / "jaxgpt_export.json").read_text())["step"] == 20


# ---- an intact step saved for another optimizer structure is a mismatch, not damage --------------------------
def test_a_changed_optimizer_structure_is_a_mismatch_naming_paths_not_damage(run, states, capsys):
    """grad_clip 0 <-> > 0 adds or removes a link of optax's chain: the saved opt_state no longer fits. Every step
    is intact: the error names the differing tree paths before any array is read, and nothing is moved."""
    from jaxgpt.checkpoint import CheckpointMismatchError

    params, _ = states[0]
    unclipped = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10, grad_clip=0.0)).init(params)
    with Checkpoints(run, keep=3) as c:
        for call in (lambda: c.restore(30, params=params, opt_state=unclipped),
                     lambda: c.restore_newest(params=params, opt_state=unclipped)):
            with pytest.raises(CheckpointMismatchError) as e:
                call()
            msg = str(e.value)
            assert "damaged" not in msg and "opt_state/ was saved with another tree structure" in msg, msg
            assert "only in the checkpoint" in msg and "only requested" in msg and "inner_state/1/0/mu" in msg
            assert "grad_clip" in msg  # the likely cause
        assert c.all_steps() == [10, 20, 30] and c.set_aside("damaged") == []
        assert [r.state for r in c.states()] == ["ok"] * 3
        # a damaged newest step, then a mismatch: a failed restore moves nothing either
        (run / "checkpoints" / "30" / "params" / "_METADATA").unlink()
        with pytest.raises(CheckpointMismatchError):
            c.restore_newest(params=params, opt_state=unclipped)
        assert c.all_steps() == [10, 20, 30] and c.set_aside("damaged") == []


def test_the_structure_check_reads_no_array(run, states, monkeypatch):
    """The mismatch is found from the metadata alone: no array file is opened."""
    from jaxgpt.checkpoint import CheckpointMismatchError

    params, _ = states[0]
    unclipped = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10, grad_clip=0.0)).init(params)
    for item in ("params", "opt_state"):  # array data unreadable: any read would be damage, not a mismatch
        for f in data_files(run, 30, item):
            f.write_bytes(b"")
    with Checkpoints(run, read_only=True) as c, pytest.raises(CheckpointMismatchError):
        c.restore(30, params=params, opt_state=unclipped)


def test_a_garbage_sharding_file_is_a_note_everywhere(run, states, capsys):
    """``_sharding`` holds each array's device layout and no data: training, load_model and list all restore
    the step (its digests pass); list notes the file."""
    (run / "checkpoints" / "30" / "params" / "_sharding").write_bytes(os.urandom(300))
    params, opt_state = states[0]
    with Checkpoints(run, read_only=True) as c:
        r = c.restore(30, params=params, opt_state=opt_state)
        assert r.verified and leaves_equal(r.params, states[2][0])
        (row,) = [s for s in c.states() if s.step == 30]
    assert row.state == "ok" and "params/_sharding unreadable" in row.reason
    model, step = load_model_and_step(run, report=lambda m: pytest.fail(m))
    assert step == 30 and leaves_equal(nnx.state(model, nnx.Param), states[2][0])
    assert main(["list", str(run)]) == 0
    assert "params/_sharding unreadable" in capsys.readouterr().out


def test_generate_step_on_a_damaged_step_says_so(run, capsys):
    from jaxgpt import generate

    damage(run, "deleted _METADATA")
    assert generate.main(["--init-from", str(run), "--step", "30", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint step 30 is damaged: params/_METADATA: missing" in err and "no config.json" not in err, err
    assert "newest intact step" in err
    assert "the newest intact step" in " ".join(generate.build_parser().format_help().split())


# ---- exports: the run's own files, foreign files in our exports, unwritable targets, staging -------------------
def _with_run_files(run: Path) -> dict[Path, bytes]:
    files = {run / "config.yaml": b"model: tiny\n", run / "metrics.jsonl": b'{"step": 1}\n',
             run / "summary.json": b"{}\n", run / ".jaxgpt.lock": b"host 1\n"}
    for p, b in files.items():
        p.write_bytes(b)
    (run / "tensorboard").mkdir()
    return files


def test_overwrite_never_replaces_the_runs_own_files(run, capsys):
    files = _with_run_files(run)
    targets = [*files, run / "tensorboard", run / "checkpoints" / "30", run / "checkpoints" / "x.pt"]
    for target in targets:
        for option in ("--to-torch", "--to-hf"):
            assert main(["export", str(run), option, str(target), "--overwrite"]) == 2, (option, target)
            err = capsys.readouterr().err
            assert "Traceback" not in err and "not even with --overwrite" in err, err
    assert {p: p.read_bytes() for p in files} == files and (run / "tensorboard").is_dir()
    with Checkpoints(run, read_only=True) as c:
        assert [s.state for s in c.states()] == ["ok"] * 3
    # the hint for a file names a file, not an export-hf directory
    assert main(["export", str(run), "--to-torch", str(run / "checkpoints" / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert f"{run.name}.pt" in err and "export-hf" not in err, err
    # new paths inside the run, and our own exports there, are fine
    assert main(["export", str(run), "--to-torch", str(run / "m.pt"), "--to-hf", str(run / "hf")]) == 0
    assert main(["export", str(run), "--to-torch", str(run / "m.pt"), "--to-hf", str(run / "hf"),
                 "--overwrite"]) == 0


def test_our_export_with_added_files_is_not_ours(run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export", str(run), "--to-hf", str(hf)]) == 0
    assert sorted(json.loads((hf / exportdir.MARKER).read_text())["files"]) == sorted(
        p.name for p in hf.iterdir() if p.name != exportdir.MARKER)
    (hf / "notes.txt").write_text("mine")
    (hf / "eval").mkdir()
    assert main(["export", str(run), "--to-hf", str(hf)]) == 2
    err = capsys.readouterr().err
    assert "other files were added (eval/, notes.txt)" in err and "Traceback" not in err, err
    assert (hf / "notes.txt").read_text() == "mine"
    # an export from before the marker listed its files: the files save_hf writes count as ours
    m = json.loads((hf / exportdir.MARKER).read_text())
    del m["files"]
    (hf / exportdir.MARKER).write_text(json.dumps(m))
    assert main(["export", str(run), "--to-hf", str(hf)]) == 2
    (hf / "notes.txt").unlink()
    (hf / "eval").rmdir()
    assert main(["export", str(run), "--to-hf", str(hf)]) == 0
    # inside the run directory, an export of ours with added files is refused even with --overwrite
    inner = run / "hf"
    assert main(["export", str(run), "--to-hf", str(inner)]) == 0
    (inner / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--to-hf", str(inner), "--overwrite"]) == 2
    assert (inner / "notes.txt").read_text() == "mine"
    # outside it, --overwrite is consent
    (hf / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--to-hf", str(hf), "--overwrite"]) == 0 and not (hf / "notes.txt").exists()


@pytest.mark.skipif(not Path("/sys").is_dir() or not Path("/dev/null").exists(), reason="needs Linux paths")
def test_unwritable_targets_fail_before_loading_without_traceback(run, tmp_path, monkeypatch, capsys):
    import sys

    export_module = sys.modules["jaxgpt.checkpoint.export"]  # (the package's `export` is the function)

    def no_load(*a, **k):
        raise AssertionError("loaded the model before checking the target")

    monkeypatch.setattr(export_module, "load_model_and_step", no_load)
    for option, target in (("--to-hf", "/dev/null/x"), ("--to-torch", "/dev/null/x.pt"), ("--to-torch", "/sys/x.pt"),
                           ("--to-hf", "/sys/x"), ("--to-torch", "/proc/x.pt")):
        assert main(["export", str(run), option, target]) == 2, target
        err = capsys.readouterr().err
        assert err.startswith(f"error: {option} {target!r}: ") and "Traceback" not in err, err
        assert "is not a directory" in err or "cannot create files in" in err, err


def test_a_write_error_is_an_export_error(run, tmp_path, monkeypatch, capsys):
    """An OSError while writing (after the target check passed) is a clear error with exit 2, nothing left."""
    import safetensors.numpy

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    assert main(["export", str(run), "--to-hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path / 'hf'}: No space left on device" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_exports_get_the_umask_permissions(run, tmp_path):
    old = os.umask(0o002)
    try:
        out = export(run, to_hf=tmp_path / "hf", to_torch=tmp_path / "m.pt")
    finally:
        os.umask(old)
    assert (out["hf"].stat().st_mode & 0o777) == 0o775
    assert (out["torch"].stat().st_mode & 0o777) == 0o664
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out["hf"].iterdir()} == {
        p.name: oct(0o664) for p in out["hf"].iterdir()}


def test_a_killed_export_leaves_staging_that_the_next_export_removes(run, tmp_path):
    """SIGKILL mid-export leaves the hidden staging directory beside the target; the next export (a later
    process) removes it; one whose process is alive, or that is not older than the current process, is kept."""
    import signal
    import subprocess
    import sys

    hf = tmp_path / "hf"
    killed = subprocess.Popen([sys.executable, "-c", (
        "import os, signal; from pathlib import Path; from jaxgpt import exportdir\n"
        f"with exportdir.staged_dir(Path({str(hf)!r}), exportdir.marker('hf')) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")])
    assert killed.wait(timeout=120) == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp-")]
    assert f"-{killed.pid}-" in left.name and (left / "model.safetensors").exists()
    live = tmp_path / f".hf.tmp-{exportdir._host()}-{os.getpid()}-abcd1234"  # this (live) process's
    live.mkdir()
    old = os.stat(left).st_mtime - 3600
    os.utime(live, (old, old))
    assert exportdir.remove_stale_staging(hf) == []  # the killed one is newer than this process: kept
    time.sleep(0.05)  # the next process starts measurably after the kill (its start time has a 10 ms tick)
    proc = subprocess.run([sys.executable, "-m", "jaxgpt.checkpoint", "export", str(run), "--to-hf", str(hf)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not left.exists() and live.is_dir() and exportdir._is_our_dir(hf)


def test_reports_of_abandoned_reads_are_dropped_and_others_kept(monkeypatch):
    """What a failed restore leaves behind (orbax's other array reads, failing later in TensorStore's threads) is
    dropped from sys.unraisablehook and from asyncio's "exception was never retrieved" log, by the read
    coroutine's frame in the traceback, whatever object carries it; every other report passes through."""
    import logging
    import sys
    import types

    from jaxgpt.checkpoint import integrity

    def _read_array_index_and_device_put():  # the name of orbax's read coroutine
        raise ValueError("Error reading 'wte': truncated")

    def raised(fn):
        try:
            fn()
        except ValueError as e:
            return e

    def other():
        raise ValueError("something else")

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    integrity.quiet_abandoned_reads()
    unraisable = lambda exc, obj: types.SimpleNamespace(exc_value=exc, object=obj, exc_type=type(exc))  # noqa: E731
    sys.unraisablehook(unraisable(raised(_read_array_index_and_device_put), object()))  # e.g. a Task around it
    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed"), None))
    assert seen == []
    sys.unraisablehook(unraisable(raised(other), None))
    assert len(seen) == 1

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    try:
        for fn in (_read_array_index_and_device_put, other):
            e = raised(fn)
            log.error("Task exception was never retrieved", exc_info=(type(e), e, e.__traceback__))
    finally:
        log.removeHandler(handler)
    assert [r.exc_info[1].args[0] for r in records] == ["something else"]
