"""--wandb (jaxgpt.train.wandb_log), offline only: W&B's local files hold the history metrics.jsonl holds, a
resumed run continues the same W&B run without duplicated steps, and W&B missing, unreachable or failing never
stops training. No test reaches a W&B server (WANDB_MODE=offline; the unreachable one is a closed local port)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import pytest

from jaxgpt.train import main, parse_args, read_metrics
from tests.runs import saved_steps, sigkill_when, trained_steps
from jaxgpt.train.wandb_log import (STATE_FILE, WandbConfig, WandbTracker, history_steps, offline_last_step,
                                    record_to_wandb, wandb_file_records)

wandb = pytest.importorskip("wandb", reason='W&B is optional: pip install -e ".[wandb]"')

REPO = Path(__file__).resolve().parent.parent
TINY = ["--config", str(REPO / "configs/tiny-test.yaml"), f"--data_dir={REPO / 'data_cache' / 'shakespeare'}",
        "--eval_steps=1", "--sample_interval=2", "--sample_len=4", "--plot=true"]


@pytest.fixture(autouse=True)
def fresh_wandb(tmp_path_factory, monkeypatch):
    """wandb keeps one process-wide setup (its settings read from the environment once): start each test anew,
    with its settings, cache and staging directories in a scratch place and its error reporting off."""
    home = tmp_path_factory.mktemp("wandb_home")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    wandb.teardown()
    yield
    wandb.teardown()


# ---- reading W&B's offline files ------------------------------------------------------------------------
def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run directory under run_dir/wandb, oldest first: id, config, history {step: {key: value}}
    (read with wandb's protobuf records, wandb_log.wandb_file_records; a step twice in one file fails here)."""
    runs = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = d.glob("run-*.wandb")
        run = {"dir": d, "history": {}, "config": {}, "id": d.name.rsplit("-", 1)[1]}  # offline-run-<time>-<id>
        for r in wandb_file_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                assert r.run.run_id == run["id"]
                run["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = items.pop("_step")
                assert step not in run["history"], f"step {step} twice in {log}"
                run["history"][step] = items
        runs.append(run)
    return runs


def jsonl_by_step(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's train/eval numbers by step, under W&B's names."""
    out: dict[int, dict] = {}
    for r in read_metrics(run_dir):
        if r["type"] in ("train", "eval"):
            out.setdefault(r["step"], {}).update(record_to_wandb(r))
    return out


# ---- the real thing, offline --------------------------------------------------------------------------------
TIMINGS = ("train/step_time", "train/tokens_per_s", "train/flops_per_s", "train/mfu")


def assert_history_is_metrics_jsonl(runs: list[dict], run_dir: Path, *, exact_steps=()) -> dict[int, dict]:
    """The W&B runs' histories together hold every step of metrics.jsonl exactly once, with its numbers (all of
    them for ``exact_steps``; timings aside for the others: steps recomputed after a restart)."""
    history: dict[int, dict] = {}
    for run in runs:
        twice = sorted(set(history) & set(run["history"]))
        assert not twice, f"steps {twice} are in W&B's files twice"
        history.update(run["history"])
    expected = jsonl_by_step(run_dir)
    assert sorted(history) == sorted(expected)
    for step, values in expected.items():
        got = history[step]
        keys = values if step in exact_steps else [k for k in values if k not in TIMINGS]
        assert {k: got[k] for k in keys} == {k: values[k] for k in keys}, step
    return history


def test_offline_history_equals_metrics_jsonl_and_a_resume_continues_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main(TINY + [f"--out_dir={out}", "--max_steps=4", "--checkpoint_interval=2", "--wandb",
                        "--wandb.project=jaxgpt-test", "--wandb.tags=[tiny, ci]"]) == 0
    state = json.loads((out / STATE_FILE).read_text())
    assert state["project"] == "jaxgpt-test"
    (first,) = offline_runs(out)
    assert first["id"] == state["id"]
    assert first["config"]["max_steps"] == 4 and first["config"]["model"]["n_layer"] == 2
    assert sorted(first["history"]) == [0, 1, 2, 3, 4]
    assert_history_is_metrics_jsonl([first], out, exact_steps=range(5))  # every number metrics.jsonl holds
    assert first["history"][2]["samples/_type"] == "incremental-table-file"  # samples at steps 2 and 4, as table rows
    rows = [row for f in sorted((first["dir"] / "files/media/table").glob("samples_*.table.json"))
            for row in json.loads(f.read_text())["data"]]
    assert sorted((step, i) for step, i, _ in rows) == [(2, 0), (4, 0)]
    assert first["history"][4]["loss_png/_type"] == "image-file"  # loss.png at the end
    assert list((first["dir"] / "files/media/images").glob("loss_png_*.png"))

    # resume from checkpoint 2 (W&B's files hold steps 3 and 4 already), run on to 6: same W&B run, no step twice
    capsys.readouterr()
    assert main(TINY + [f"--out_dir={out}", "--max_steps=6", "--checkpoint_interval=2", "--resume_step=2",
                        "--sample_interval=-1", "--wandb", "--wandb.project=jaxgpt-test"]) == 0
    printed = capsys.readouterr().out
    assert "W&B holds steps up to 4" in printed and "steps 3-4 were already in W&B run" in printed
    assert "sent from metrics.jsonl" not in printed
    first_again, second = offline_runs(out)
    assert second["id"] == first["id"]
    assert sorted(second["history"]) == [5, 6]  # the resumed run sends only the steps W&B lacks
    # metrics.jsonl after the resume: steps 3, 4 recomputed, the same numbers (bit for bit on CPU)
    assert_history_is_metrics_jsonl([first_again, second], out, exact_steps=[0, 1, 2, 5, 6])


@pytest.mark.slow  # 41 s on 2 cores; a resume continuing the history: the offline test
def test_sigkill_then_resume_gives_w_and_b_every_step_of_metrics_jsonl_once(tmp_path, monkeypatch, capsys):
    """A run killed with SIGKILL: W&B's client had not written its last steps to the offline file (the W&B
    service dies with the process). The restart resumes the W&B run from the step its files really hold: the
    steps after it up to the checkpoint are sent from metrics.jsonl, those after the checkpoint W&B already holds
    are not sent again. Both processes' files together: every step of metrics.jsonl, once."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = TINY + [f"--out_dir={out}", "--checkpoint_interval=5", "--sample_interval=-1", "--plot=false", "--wandb"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXGPT_DEBUG_STEP_SLEEP": "0.3"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxgpt.train", *args, "--max_steps=40"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sigkill_when(proc, lambda: max(trained_steps(out), default=0) >= 13 and 10 in saved_steps(out))
    (killed_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    size = -1
    while size != killed_file.stat().st_size:  # W&B's service (a child process) has exited: the file is final
        size = killed_file.stat().st_size
        time.sleep(1.0)
    killed_at = max(r["step"] for r in read_metrics(out) if r["type"] == "train")
    held = offline_last_step(out, json.loads((out / STATE_FILE).read_text())["id"])
    assert held < killed_at  # the client had been given steps W&B's file does not hold

    capsys.readouterr()
    assert main(args + ["--max_steps=16"]) == 0
    printed = capsys.readouterr().out
    first, second = offline_runs(out)
    assert first["id"] == second["id"]
    resumed_from = int(printed.split("resumed from step ")[1].split()[0].rstrip(";"))
    assert resumed_from == 10 and max(first["history"], default=-1) == held
    if held < resumed_from:  # what the killed process's file lacks up to the checkpoint is sent from metrics.jsonl
        assert f"steps {held + 1}-{resumed_from} sent from metrics.jsonl" in printed
    if held > resumed_from:  # recomputed steps W&B held already
        assert f"steps {resumed_from + 1}" in printed and "were already in W&B run" in printed
    assert sorted(second["history"]) == list(range(held + 1, 17))
    assert_history_is_metrics_jsonl([first, second], out, exact_steps=range(held + 1, 17))


def test_the_reader_of_w_and_b_files_stops_at_a_torn_or_damaged_tail(tmp_path):
    """wandb_file_records on a file written here in W&B's format (records split over 32 KiB blocks): all of it;
    cut anywhere, a prefix of the records; one byte changed, the records before it."""
    from wandb.proto import wandb_internal_pb2 as pb

    def history(step, pad=0):
        r = pb.Record()
        r.history.item.add(key="_step", value_json=str(step))
        r.history.item.add(key="train/text", value_json=json.dumps("x" * pad))
        return r.SerializeToString()

    payloads = [history(s, pad) for s, pad in enumerate([10, 40000, 10, 70000, 10])]
    data, ends = bytearray(b":W&B\xe1\xbe\x00"), []
    for payload in payloads:
        rest, first = payload, True
        while True:
            left = 32768 - len(data) % 32768
            if left < 7:
                data += b"\0" * left
                continue
            chunk, rest = rest[:left - 7], rest[left - 7:]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            data += struct.pack("<IHB", zlib.crc32(chunk, zlib.crc32(bytes([kind]))), len(chunk), kind) + chunk
            first = False
            if not rest:
                break
        ends.append(len(data))
    path = tmp_path / "run-x.wandb"
    path.write_bytes(bytes(data))
    assert history_steps(path) == [0, 1, 2, 3, 4]
    for cut in sorted({*range(0, len(data), 997), *ends, *(e - 1 for e in ends)}):
        path.write_bytes(bytes(data[:cut]))
        assert history_steps(path) == [s for s, e in enumerate(ends) if e <= cut], cut
    damaged = bytearray(data)
    damaged[ends[2] + 100] ^= 1  # inside step 3's record
    path.write_bytes(bytes(damaged))
    assert history_steps(path) == [0, 1, 2]


def test_unreachable_wandb_delays_nothing_and_never_stops_training(tmp_path, monkeypatch):
    """Online, against a closed local port: W&B starts in the background, so the run's first step waits for
    nothing (WandbTracker.start returns at once, with init_timeout 8 s); at the end a one-line warning, and the run
    has finished."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_SILENT", "true")
    start_s = []
    real_start = WandbTracker.start.__func__

    def timed_start(cls, *a, **k):
        t0 = time.perf_counter()
        try:
            return real_start(cls, *a, **k)
        finally:
            start_s.append(time.perf_counter() - t0)

    monkeypatch.setattr(WandbTracker, "start", classmethod(timed_start))
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(TINY + [f"--out_dir={out}", "--max_steps=2", "--checkpoint_interval=0", "--wandb",
                            "--wandb.init_timeout=8"]) == 0
    took = time.perf_counter() - t0
    (warning,) = [w for w in caught if "W&B" in str(w.message)]
    assert "W&B could not start" in str(warning.message) and "local logs only" in str(warning.message)
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno)
    assert shown.count("\n") == 1 and "run.py" not in shown, shown  # one line, no source line of run.py under it
    assert len(start_s) == 1 and start_s[0] < 2.0, start_s  # training did not wait for W&B
    assert took < 8 + 60, took  # the end waits for wandb.init at most the rest of init_timeout
    assert [r["step"] for r in read_metrics(out) if r["type"] == "train"] == [1, 2]


def test_missing_wandb_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.warns(RuntimeWarning, match=r'W&B is not installed \(pip install -e "\.\[wandb\]"\)'):
        assert WandbTracker.start(WandbConfig(enabled=True), tmp_path, {}, resumed=False) is None


class _FakeRun:
    id = "fakerun1"

    def __init__(self, starting_step=0, fail_at=None):
        self.starting_step, self.fail_at = starting_step, fail_at
        self.logged, self.finished = [], []

    def log(self, data, step):
        if self.fail_at is not None and step >= self.fail_at:
            raise ConnectionError("W&B went\naway")
        self.logged.append(step)

    def finish(self, exit_code=None):
        self.finished.append(exit_code)


def test_a_failing_log_turns_wandb_off_not_training(tmp_path):
    run = _FakeRun(fail_at=3)
    tracker = WandbTracker(wandb, tmp_path / STATE_FILE, {"id": run.id}, run=run, say=lambda *_: None)
    for step in (1, 2):
        tracker.log({"type": "train", "step": step, "loss": 1.0})
    with pytest.warns(RuntimeWarning, match="W&B failed while logging .*W&B went away.*local logs go on"):
        tracker.log({"type": "train", "step": 3, "loss": 1.0})
    tracker.log({"type": "train", "step": 4, "loss": 1.0})  # off now: nothing raised, nothing sent
    tracker.finish()
    assert run.logged == [1, 2] and run.finished == [1]


def test_online_resume_sends_what_the_server_lacks_from_metrics_jsonl(tmp_path):
    """Online, W&B's resumed run starts at the step after the last one the server holds (run.starting_step): the
    records of metrics.jsonl from there on are sent, then the run's own; none the server holds."""
    backlog = [{"type": "eval", "step": 0, "val_loss": 3.0}]
    for s in range(1, 7):  # metrics.jsonl up to checkpoint 6
        backlog += [{"type": "train", "step": s, "loss": 2.0 - s / 10}] + \
            ([{"type": "eval", "step": s, "val_loss": 2.5}] if s == 4 else [])
    backlog.append({"type": "config_change", "step": 6, "changes": {"max_steps": [6, 8]}})  # no numbers
    said = []
    run = _FakeRun(starting_step=4)  # the server holds steps 0-3 (a killed run's client never sent 4-8)
    tracker = WandbTracker(wandb, tmp_path / STATE_FILE, {"id": run.id}, backlog=backlog, run=run, say=said.append)
    for step in range(7, 9):  # the run resumed from checkpoint 6
        tracker.log({"type": "train", "step": step, "loss": 1.0})
    tracker.finish()
    assert run.logged == [4, 4, 5, 6, 7, 8]  # train and eval records of step 4
    assert any("steps 4-6 sent from metrics.jsonl" in s for s in said), said

    run = _FakeRun(starting_step=9)  # the server holds 0-8, the run resumed from checkpoint 6: 7, 8 not again
    tracker = WandbTracker(wandb, tmp_path / STATE_FILE, {"id": run.id}, backlog=backlog, run=run, say=said.append)
    for step in range(7, 11):
        tracker.log({"type": "train", "step": step, "loss": 1.0})
    tracker.finish()
    assert run.logged == [9, 10] and "steps 7-8 were already in W&B run" in said[-1]


def test_records_wait_for_a_slow_wandb_init_and_are_sent_in_order(tmp_path, monkeypatch):
    """wandb.init in the background: what the run logs meanwhile waits and is sent once W&B is up."""
    run = _FakeRun()
    release = __import__("threading").Event()

    class SlowWandb:
        Settings = wandb.Settings

        @staticmethod
        def init(**kwargs):
            release.wait(10)
            return run

    monkeypatch.setitem(sys.modules, "wandb", SlowWandb)
    tracker = WandbTracker.start(WandbConfig(enabled=True, mode="offline"), tmp_path, {}, resumed=False,
                                 say=lambda *_: None)
    for step in (0, 1, 2):
        tracker.log({"type": "train", "step": step, "loss": 1.0})
    assert run.logged == [] and len(tracker.waiting) == 3
    release.set()
    tracker.finish()
    assert run.logged == [0, 1, 2] and run.finished == [None]
    assert json.loads((tmp_path / STATE_FILE).read_text())["id"] == tracker.state["id"]


def test_records_map_to_tensorboard_names_and_cli_flag():
    assert record_to_wandb({"type": "train", "step": 5, "loss": 2.5, "mfu": None, "lr": 1e-3}) == \
        {"train/loss": 2.5, "train/lr": 1e-3}
    assert record_to_wandb({"type": "eval", "step": 5, "val_loss": 3.0}) == {"eval/val_loss": 3.0}
    assert record_to_wandb({"type": "hellaswag", "step": 5, "acc": 0.25, "acc_norm": 0.26, "n": 100,
                            "seconds": 1.5}) == {"hellaswag/acc": 0.25, "hellaswag/acc_norm": 0.26,
                                                 "hellaswag/n": 100, "hellaswag/seconds": 1.5}
    assert record_to_wandb({"type": "config_change", "step": 5, "changes": {"a": [1, 2]}}) == {}
    _, overrides, _ = parse_args(["--wandb", "--wandb.project=p", "--wandb.tags=[a, b]"])
    assert overrides == {"wandb.enabled": True, "wandb.project": "p", "wandb.tags": ["a", "b"]}
    assert parse_args(["--wandb=false"])[1] == {"wandb.enabled": False}
