"""--wandb (jaxgpt.train.wandb_log), offline only: W&B's local files hold the history metrics.jsonl holds, a
resumed run continues the same W&B run without duplicated steps, and W&B missing, unreachable or failing never
stops training. No test reaches a W&B server (WANDB_MODE=offline; the unreachable one is a closed local port)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from jaxgpt.train import main, parse_args, read_metrics
from jaxgpt.train.wandb_log import STATE_FILE, WandbConfig, WandbTracker, record_to_wandb

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
def wandb_records(path: Path):
    """The protobuf records of a ``run-<id>.wandb`` file: W&B's LevelDB-style log (a 7-byte ':W&B' header,
    32 KiB blocks of records, each a 7-byte header crc32/length/type and a chunk; FULL=1, FIRST/MIDDLE/LAST=2/3/4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run directory under run_dir/wandb, oldest first: id, config, history {step: {key: value}}."""
    runs = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = d.glob("run-*.wandb")
        run = {"dir": d, "history": {}, "config": {}, "id": None}
        for r in wandb_records(log):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"] = r.run.run_id
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
def test_offline_history_equals_metrics_jsonl_and_a_resume_continues_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main(TINY + [f"--out_dir={out}", "--max_steps=4", "--checkpoint_interval=2", "--wandb",
                        "--wandb.project=jaxgpt-test", "--wandb.tags=[tiny, ci]"]) == 0
    state = json.loads((out / STATE_FILE).read_text())
    assert state["last_step"] == 4 and state["project"] == "jaxgpt-test"
    (first,) = offline_runs(out)
    assert first["id"] == state["id"]
    assert first["config"]["max_steps"] == 4 and first["config"]["model"]["n_layer"] == 2
    expected = jsonl_by_step(out)
    assert sorted(first["history"]) == sorted(expected) == [0, 1, 2, 3, 4]
    for step, values in expected.items():  # every number metrics.jsonl holds, exactly
        got = first["history"][step]
        assert {k: got[k] for k in values} == values, step
    assert first["history"][2]["samples/_type"] == "incremental-table-file"  # samples at steps 2 and 4, as table rows
    rows = [row for f in sorted((first["dir"] / "files/media/table").glob("samples_*.table.json"))
            for row in json.loads(f.read_text())["data"]]
    assert sorted((step, i) for step, i, _ in rows) == [(2, 0), (4, 0)]
    assert first["history"][4]["loss_png/_type"] == "image-file"  # loss.png at the end
    assert list((first["dir"] / "files/media/images").glob("loss_png_*.png"))

    # resume from checkpoint 2 (steps 3 and 4 are in W&B already), run on to 6: same W&B run, no step twice
    capsys.readouterr()
    assert main(TINY + [f"--out_dir={out}", "--max_steps=6", "--checkpoint_interval=2", "--resume_step=2",
                        "--sample_interval=-1", "--wandb", "--wandb.project=jaxgpt-test"]) == 0
    assert "steps 3-4 were already in W&B run" in capsys.readouterr().out
    first_again, second = offline_runs(out)
    assert second["id"] == first["id"]
    assert sorted(second["history"]) == [5, 6]  # the resumed run sends only the steps W&B lacks
    assert json.loads((out / STATE_FILE).read_text())["last_step"] == 6
    history = {**first_again["history"], **second["history"]}
    expected = jsonl_by_step(out)  # metrics.jsonl after the resume: steps 3, 4 recomputed
    assert sorted(history) == sorted(expected) == [0, 1, 2, 3, 4, 5, 6]
    for step, values in expected.items():  # the recomputed steps are the same numbers (bit for bit on CPU)
        got = history[step]
        assert {k: got[k] for k in values if k not in ("train/step_time", "train/tokens_per_s",
                                                       "train/flops_per_s", "train/mfu")} == \
            {k: v for k, v in values.items() if k not in ("train/step_time", "train/tokens_per_s",
                                                          "train/flops_per_s", "train/mfu")}, step


def test_unreachable_wandb_never_stops_training(tmp_path, monkeypatch):
    """Online, against a closed local port, with a 3 s init timeout: a warning, and the run finishes."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="(?s)W&B could not start .*local logs only"):
        assert main(TINY + [f"--out_dir={out}", "--max_steps=2", "--checkpoint_interval=0", "--wandb",
                            "--wandb.init_timeout=3"]) == 0
    assert time.perf_counter() - t0 < 120
    assert [r["step"] for r in read_metrics(out) if r["type"] == "train"] == [1, 2]
    assert not (out / STATE_FILE).exists()


def test_missing_wandb_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.warns(RuntimeWarning, match=r'W&B is not installed \(pip install -e "\.\[wandb\]"\)'):
        assert WandbTracker.start(WandbConfig(enabled=True), tmp_path, {}, resumed=False) is None


class _FailingRun:
    id = "failing1"

    def __init__(self):
        self.logged, self.finished = [], []

    def log(self, data, step):
        if step >= 3:
            raise ConnectionError("W&B went away")
        self.logged.append(step)

    def finish(self, exit_code=None):
        self.finished.append(exit_code)


def test_a_failing_log_turns_wandb_off_not_training(tmp_path):
    run = _FailingRun()
    tracker = WandbTracker(wandb, run, tmp_path / STATE_FILE, {"id": run.id, "last_step": -1}, resumed_after=-1,
                           say=lambda *_: None)
    for step in (1, 2):
        tracker.log({"type": "train", "step": step, "loss": 1.0})
    with pytest.warns(RuntimeWarning, match="(?s)W&B failed while logging .*W&B went away.*local logs go on"):
        tracker.log({"type": "train", "step": 3, "loss": 1.0})
    tracker.log({"type": "train", "step": 4, "loss": 1.0})  # off now: nothing raised, nothing sent
    tracker.finish()
    assert run.logged == [1, 2] and run.finished == [1]
    assert json.loads((tmp_path / STATE_FILE).read_text())["last_step"] == 2  # step 2 committed by step 3's call


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
