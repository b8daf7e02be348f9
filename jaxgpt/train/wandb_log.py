"""Weights & Biases tracking of a training run (``--wandb``; optional: ``pip install -e ".[wandb]"``).

What goes to W&B is what ``metrics.jsonl`` holds, under TensorBoard's names (``{type}/{field}``, at the record's
``step``): ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/mfu``, ...,
``eval/val_loss``, ``hellaswag/acc_norm``, ``hellaswag/acc``; the samples as one table (``samples``: step,
index, text; rows appended at each sample); the resolved config (``config.yaml``'s) as the run's config; and at
the end ``loss.png`` as an image (``loss_png``).

Resuming: the W&B run's id is kept in the run directory (``wandb.json``, beside ``wandb/``, W&B's own files), so
a restarted run continues the same W&B run (``resume="allow"``). W&B's history only moves forward: the steps a
W&B run already holds (recorded in ``wandb.json`` as they are committed) are not sent again, so a resume from
an older checkpoint (a restart after a kill, ``--resume_step``) continues the history without duplicated
steps; the repeated steps' records are in ``metrics.jsonl`` (after a kill they are the same numbers: a resumed
run repeats the uninterrupted one bit for bit on CPU). A run directory started afresh (no checkpoint to
resume) gets a new W&B run.

W&B never stops training: not installed, not reachable (``init_timeout``), or failing while logging, it is a
warning and the local logs go on. Offline: ``--wandb.mode=offline`` or ``WANDB_MODE=offline`` writes W&B's files
under ``<out_dir>/wandb/`` only (``wandb sync <out_dir>/wandb/offline-run-*`` uploads them later).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import string
import warnings
from pathlib import Path
from typing import Any, Callable, Literal

from jaxgpt.config import ConfigError

STATE_FILE = "wandb.json"  # {"id", "project", "entity", "last_step"}: the W&B run this run directory logs to


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """``--wandb`` (= ``--wandb.enabled=true``) and its settings (``--wandb.project=...`` etc.)."""

    enabled: bool = False
    project: str = "jaxgpt"
    name: str | None = None  # the W&B run's display name; None: the run directory's name
    entity: str | None = None  # a W&B user or team; None: the API key's default entity
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline", "disabled"] | None = None  # None: $WANDB_MODE, else online
    init_timeout: float = 60.0  # seconds wandb.init may take (an unreachable server) before training goes on

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
    """One W&B run fed from the run's metrics writer; every call swallows W&B's errors (a warning, then off)."""

    def __init__(self, wandb: Any, run: Any, state_path: Path, state: dict[str, Any], *, resumed_after: int,
                 say: Callable[[str], None]):
        self.wandb, self.run, self.state_path, self.state, self.say = wandb, run, state_path, state, say
        self.resumed_after = resumed_after  # steps <= this are already in the W&B run's history
        self.step: int | None = None  # the step being logged (W&B commits a step when a later one comes)
        self.skipped: list[int] = []
        self.table = None

    # ---- start ----------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, cfg: WandbConfig, run_dir: Path, config: dict[str, Any], *, resumed: bool,
              say: Callable[[str], None] = print) -> "WandbTracker | None":
        """The W&B run for ``run_dir`` (a new one, or, when ``resumed``, the one ``wandb.json`` names); None
        (after a warning) when W&B is not installed or could not start."""
        try:
            import wandb
        except ImportError:
            _warn('W&B is not installed (pip install -e ".[wandb]"); training goes on with the local logs only')
            return None
        state_path = Path(run_dir) / STATE_FILE
        state = _read_state(state_path) if resumed else None
        continuing = state is not None
        run_id = state["id"] if state else "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                                    for _ in range(8))  # W&B's own id format
        try:
            run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or Path(run_dir).resolve().name,
                             tags=list(cfg.tags), config=config, id=run_id, resume="allow", dir=str(run_dir),
                             mode=cfg.mode or os.environ.get("WANDB_MODE") or None, settings=wandb.Settings(init_timeout=cfg.init_timeout))
        except Exception as e:  # unreachable, bad key, ... : never stops training
            _warn(f"W&B could not start ({type(e).__name__}: {e}); training goes on with the local logs only")
            return None
        last = int(state.get("last_step", -1)) if state else -1  # -1: no step committed yet
        state = {"id": run.id, "project": cfg.project, "entity": cfg.entity, "last_step": last}
        tracker = cls(wandb, run, state_path, state, resumed_after=last, say=say)
        try:
            tracker._save_state()
        except OSError as e:
            tracker._fail(f"writing {state_path}", e)
            return None
        say(f"  W&B: run {run.id} ({'continued' if continuing else 'new'}"
            f"{', ' + run.settings.mode if getattr(run.settings, 'mode', None) else ''}), files in {run_dir}/wandb")
        return tracker

    # ---- logging --------------------------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record at its step (records of steps W&B already holds are skipped)."""
        data = record_to_wandb(record)
        if data:
            self._log(data, int(record["step"]))

    def log_samples(self, step: int, texts: list[str]) -> None:
        """Samples as rows (step, index, text) of the run's ``samples`` table."""
        if self.run is None:
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

    def _log(self, data: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        if step <= self.resumed_after or (self.step is not None and step < self.step):
            if not self.skipped or self.skipped[-1] != step:
                self.skipped.append(step)
            return
        try:
            if self.step is not None and step > self.step:
                self._committed(self.step)  # W&B commits a step's row when a later step is logged
            self.run.log(data, step=step)
            self.step = step
        except Exception as e:
            self._fail("logging", e)

    def _committed(self, step: int) -> None:
        if step > self.state["last_step"]:
            self.state["last_step"] = step
            self._save_state()

    # ---- end ------------------------------------------------------------------------------------------------
    def finish(self, loss_png: Path | None = None) -> None:
        """loss.png as ``loss_png``, then finish the W&B run (all steps committed)."""
        if self.run is None:
            return
        try:
            if loss_png is not None and Path(loss_png).exists() and self.step is not None:
                self.run.log({"loss_png": self.wandb.Image(str(loss_png))}, step=self.step)
            self.run.finish()
            if self.step is not None:
                self._committed(self.step)
        except Exception as e:
            self._fail("finishing", e)
        if self.skipped:
            self.say(f"  W&B: steps {_ranges(self.skipped)} were already in W&B run {self.state['id']} (from before "
                     "the restart) and were not sent again; metrics.jsonl holds this run's records of them")
        self.run = None

    def _fail(self, what: str, e: Exception) -> None:
        _warn(f"W&B failed while {what} ({type(e).__name__}: {e}); W&B logging stops, the local logs go on")
        try:
            self.run.finish(exit_code=1)
        except Exception:
            pass
        self.run = None

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, self.state_path)


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


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
