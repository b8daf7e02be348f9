"""Weights & Biases tracking of a training run (``--wandb``; optional: ``pip install -e ".[wandb]"``).

What goes to W&B is what ``metrics.jsonl`` holds, under TensorBoard's names (``{type}/{field}``, at the record's
``step``): ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/mfu``, ...,
``eval/val_loss``, ``hellaswag/acc_norm``, ``hellaswag/acc``; the samples as one table (``samples``: step,
index, text; rows appended at each sample); the resolved config (``config.yaml``'s) as the run's config; and at
the end ``loss.png`` as an image (``loss_png``).

Resuming: the W&B run's id is kept in the run directory (``wandb.json``, beside ``wandb/``, W&B's own files), so
a restarted run continues the same W&B run (``resume="allow"``). What the W&B run holds is read from W&B itself,
not from what an earlier process handed to W&B's client (a killed process's client may not have written its last
steps): online, the step W&B resumes at (``run.starting_step``, from the server's history); offline, the history
records in the earlier processes' ``wandb/offline-run-*-<id>/run-<id>.wandb`` files (torn tails ignored). Then:

* the records of ``metrics.jsonl`` (kept up to the checkpoint the run resumed from) after the last step W&B holds
  are sent again, so W&B's history has no gap;
* steps W&B already holds (a checkpoint older than what W&B received: a kill, ``--resume_step``) are not sent
  again: W&B's history only moves forward, and no step appears twice. After a kill they are the same numbers
  (a resumed run repeats the uninterrupted one bit for bit on CPU); ``metrics.jsonl`` holds this run's.

So W&B's history (online, or all offline files of the run synced) equals ``metrics.jsonl``, each step once.
Samples are not re-sent (they are in ``samples.txt``). A run directory started afresh gets a new W&B run.

W&B never stops or delays training: ``wandb.init`` runs in a background thread while training starts, the
records wait for it; not installed, not reachable (``init_timeout``: the run's end waits for it at most the rest
of that), or failing while logging, it is a one-line warning and the local logs go on. Offline:
``--wandb.mode=offline`` or ``WANDB_MODE=offline`` writes W&B's files under ``<out_dir>/wandb/`` only
(``wandb sync <out_dir>/wandb/offline-run-*`` uploads them later).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import string
import struct
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from jaxgpt.config import ConfigError

STATE_FILE = "wandb.json"  # {"id", "project", "entity"}: the W&B run this run directory logs to


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """``--wandb`` (= ``--wandb.enabled=true``) and its settings (``--wandb.project=...`` etc.)."""

    enabled: bool = False
    project: str = "jaxgpt"
    name: str | None = None  # the W&B run's display name; None: the run directory's name
    entity: str | None = None  # a W&B user or team; None: the API key's default entity
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline", "disabled"] | None = None  # None: $WANDB_MODE, else online
    init_timeout: float = 60.0  # seconds wandb.init may take (in the background; training does not wait)

    def __post_init__(self) -> None:
        if not self.init_timeout > 0:
            raise ConfigError(f"WandbConfig.init_timeout = {self.init_timeout!r}: must be > 0 seconds")
        if not self.project:
            raise ConfigError("WandbConfig.project = '': must name a W&B project (e.g. --wandb.project=jaxgpt)")


def record_to_wandb(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers under ``{type}/{field}`` (TensorBoard's tags); strings, None and the
    step are left out."""
    kind = record.get("type", "train")
    return {f"{kind}/{k}": v for k, v in record.items()
            if k not in ("type", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbTracker:
    """One W&B run fed from the run's metrics writer; every call swallows W&B's errors (a warning, then off).

    ``log``/``log_samples`` never wait for W&B: until ``wandb.init`` (in a background thread) has returned, what
    they get is kept and sent, in order, once it has."""

    def __init__(self, wandb: Any, state_path: Path, state: dict[str, Any], *, backlog: list[dict[str, Any]] = (),
                 offline_last: int = -1, continuing: bool = False, say: Callable[[str], None] = print,
                 run: Any = None, init_timeout: float = 60.0):
        self.wandb, self.state_path, self.state, self.say = wandb, state_path, state, say
        self.backlog = list(backlog)  # metrics.jsonl's records from before this process (sent if W&B lacks them)
        self.offline_last = offline_last  # the last step the run's earlier offline W&B files hold (-1: none)
        self.continuing, self.init_timeout = continuing, init_timeout
        self.run = None
        self.held = -1  # steps <= this are in the W&B run's history already (known once the run is up)
        self.step: int | None = None  # the last step logged
        self.skipped: list[int] = []
        self.table = None
        self.waiting: list[tuple[str, Any]] = []  # ("record", record) / ("samples", (step, texts)) before the run
        self._init_error: BaseException | None = None
        self._init_done = threading.Event()
        self._init_thread: threading.Thread | None = None
        self._deadline = time.monotonic() + init_timeout
        self._up = self._off = False
        if run is not None:  # an already started run (tests)
            self._new_run = run
            self._init_done.set()

    # ---- start ----------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, cfg: WandbConfig, run_dir: Path, config: dict[str, Any], *, resumed: bool,
              say: Callable[[str], None] = print) -> "WandbTracker | None":
        """The W&B run for ``run_dir`` (a new one, or, when ``resumed``, the one ``wandb.json`` names), started
        in the background; None (after a warning) when W&B is not installed or the state cannot be written."""
        try:
            import wandb
        except ImportError:
            _warn('W&B is not installed (pip install -e ".[wandb]"); training goes on with the local logs only')
            return None
        from jaxgpt.train.metrics import read_metrics

        run_dir = Path(run_dir)
        state_path = run_dir / STATE_FILE
        state = _read_state(state_path) if resumed else None
        continuing = state is not None
        run_id = state["id"] if state else "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                                    for _ in range(8))  # W&B's own id format
        state = {"id": run_id, "project": cfg.project, "entity": cfg.entity}
        tracker = cls(wandb, state_path, state, backlog=read_metrics(run_dir) if resumed else [],
                      offline_last=offline_last_step(run_dir, run_id) if continuing else -1,
                      continuing=continuing, say=say, init_timeout=cfg.init_timeout)
        try:  # before wandb.init: a process killed while W&B starts is resumed into the same W&B run
            tracker._save_state()
        except OSError as e:
            _warn(f"W&B: cannot write {state_path} ({e}); training goes on with the local logs only")
            return None
        kwargs = dict(project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.resolve().name,
                      tags=list(cfg.tags), config=config, id=run_id, resume="allow", dir=str(run_dir),
                      mode=cfg.mode or os.environ.get("WANDB_MODE") or None,
                      settings=wandb.Settings(init_timeout=cfg.init_timeout))
        tracker._init_thread = threading.Thread(target=tracker._init, args=(kwargs,), name="wandb-init",
                                                daemon=True)
        tracker._init_thread.start()
        return tracker

    def _init(self, kwargs: dict[str, Any]) -> None:  # the background thread
        try:
            self._new_run = self.wandb.init(**kwargs)
        except BaseException as e:  # unreachable, bad key, ... : never stops training
            self._init_error = e
        finally:
            self._init_done.set()

    def _ready(self, wait: bool = False) -> bool:
        """Whether the W&B run is up (or off); the first time it is, what waited is sent."""
        if self._up or self._off:
            return True
        if wait:
            self._init_done.wait(max(0.0, self._deadline - time.monotonic()) + 5.0)  # + W&B's own overhead
        if not self._init_done.is_set():
            return False
        if self._init_error is not None:
            self._off = True
            _warn(f"W&B could not start ({_one_line(self._init_error)}); training goes on with the local logs only")
            return True
        self.run, self._up = self._new_run, True
        try:
            starting = int(getattr(self.run, "starting_step", 0) or 0)  # online resume: the server's last step + 1
            self.held = max(self.offline_last, starting - 1)
            mode = getattr(getattr(self.run, "settings", None), "mode", None)
        except Exception as e:
            self._fail("reading the resumed run's step", e)
            return True
        self.say(f"  W&B: run {self.run.id} ({'continued' if self.continuing else 'new'}"
                 f"{', ' + mode if mode else ''}), files in {self.state_path.parent}/wandb"
                 + (f"; W&B holds steps up to {self.held}" if self.held >= 0 else ""))
        resent = [r for r in self.backlog if int(r.get("step", -1)) > self.held and record_to_wandb(r)]
        if resent:
            self.say(f"  W&B: steps {_ranges(sorted({int(r['step']) for r in resent}))} sent from metrics.jsonl "
                     "(recorded before this process; W&B did not hold them)")
        for r in resent:
            self._log(record_to_wandb(r), int(r["step"]))
        self.backlog = []
        waiting, self.waiting = self.waiting, []
        for kind, item in waiting:
            if kind == "record":
                self.log(item)
            else:
                self.log_samples(*item)
        return True

    # ---- logging --------------------------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record at its step (records of steps W&B already holds are skipped)."""
        if not self._ready():
            self.waiting.append(("record", record))
            return
        data = record_to_wandb(record)
        if data:
            self._log(data, int(record["step"]))

    def log_samples(self, step: int, texts: list[str]) -> None:
        """Samples as rows (step, index, text) of the run's ``samples`` table."""
        if not self._ready():
            self.waiting.append(("samples", (step, list(texts))))
            return
        if self.run is None or self._skip(step):
            return
        try:
            if self.table is None:
                self.table = self.wandb.Table(columns=["step", "sample", "text"], log_mode="INCREMENTAL")
            for i, text in enumerate(texts):
                self.table.add_data(step, i, text)
        except Exception as e:
            self._fail("building the samples table", e)
            return
        self._log({"samples": self.table}, step)

    def _skip(self, step: int) -> bool:
        if step <= self.held or (self.step is not None and step < self.step):
            if not self.skipped or self.skipped[-1] != step:
                self.skipped.append(step)
            return True
        return False

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.run is None or self._skip(step):
            return
        try:
            self.run.log(data, step=step)
            self.step = step
        except Exception as e:
            self._fail("logging", e)

    # ---- end ------------------------------------------------------------------------------------------------
    def finish(self, loss_png: Path | None = None) -> None:
        """loss.png as ``loss_png``, then finish the W&B run (waiting for W&B to start at most the rest of
        ``init_timeout``)."""
        if not self._ready(wait=True):
            self._off = True
            _warn(f"W&B did not start within init_timeout ({self.init_timeout:g} s); its {len(self.waiting)} "
                  "waiting record(s) are dropped, the local logs hold them")
        if self.run is None:
            return
        try:
            if loss_png is not None and Path(loss_png).exists() and self.step is not None:
                self.run.log({"loss_png": self.wandb.Image(str(loss_png))}, step=self.step)
            self.run.finish()
        except Exception as e:
            self._fail("finishing", e)
        if self.skipped:
            self.say(f"  W&B: steps {_ranges(self.skipped)} were already in W&B run {self.state['id']} (from before "
                     "the restart) and were not sent again; metrics.jsonl holds this run's records of them")
        self.run = None

    def _fail(self, what: str, e: Exception) -> None:
        _warn(f"W&B failed while {what} ({_one_line(e)}); W&B logging stops, the local logs go on")
        try:
            self.run.finish(exit_code=1)
        except Exception:
            pass
        self.run, self._off = None, True

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, self.state_path)


# ---- W&B's offline files ------------------------------------------------------------------------------------
_BLOCK, _HEADER = 32768, 7  # W&B's run file: LevelDB's log format (32 KiB blocks of records with 7-byte headers)


def wandb_file_records(path: Path) -> Iterator[Any]:
    """The protobuf records (``wandb_internal_pb2.Record``) of a ``run-<id>.wandb`` file, in order, up to the first
    torn or damaged one (what a killed process may leave at the end). The format: a 7-byte ``:W&B`` header, then
    32 KiB blocks of chunks, each a 7-byte header (crc32 of type + data seeded as LevelDB does, length, type
    FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) and its data; a block's last < 7 bytes are padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        return
    pos, parts = _HEADER, None
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        if pos + _HEADER > len(data):
            return
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + n]
        if len(chunk) < n or kind not in (1, 2, 3, 4) or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return  # torn or damaged: nothing after it is trusted
        pos += _HEADER + n
        if kind in (1, 2):
            parts = [chunk]
        elif parts is None:
            return
        else:
            parts.append(chunk)
        if kind in (1, 4):
            record = pb.Record()
            try:
                record.ParseFromString(b"".join(parts))
            except Exception:
                return
            parts = None
            yield record


def history_steps(path: Path) -> list[int]:
    """The steps of the history records in a ``run-<id>.wandb`` file, in order."""
    steps = []
    for r in wandb_file_records(path):
        if r.WhichOneof("record_type") == "history":
            step = next((i.value_json for i in r.history.item if i.key == "_step"), None)
            steps.append(int(json.loads(step)) if step is not None else int(r.history.step.num))
    return steps


def offline_last_step(run_dir: Path, run_id: str) -> int:
    """The last step of W&B run ``run_id`` that its offline files under ``run_dir/wandb`` hold; -1 for none."""
    steps = [s for f in Path(run_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
             for s in history_steps(f)]
    return max(steps, default=-1)


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        _warn(f"{path} is unreadable ({e}); a new W&B run is started")
        return None
    return state if isinstance(state, dict) and isinstance(state.get("id"), str) else None


def _ranges(steps: list[int]) -> str:
    out, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _warn(message: str) -> None:
    """A one-line warning (``jaxgpt.train.wandb_log: RuntimeWarning: ...``), no source line under it."""
    warnings.warn_explicit(" ".join(message.split()), RuntimeWarning, filename="jaxgpt.train.wandb_log", lineno=0,
                           module="jaxgpt.train.wandb_log")
