"""What a run records: ``metrics.jsonl`` (+ TensorBoard), ``loss.png``, and the throughput figures beside the
loss (parameter count, model FLOPs per step, the device's peak for MFU)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jaxgpt.config import GPTConfig


def count_params(params: Any) -> int:
    import jax

    return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_step(config: GPTConfig, *, seq_len: int, batch_size: int, micro_steps: int) -> float:
    """Model (matmul) FLOPs of one optimizer step on one process (jaxgpt.flops: forward + backward, full
    T x T attention, the lm_head over the padded vocabulary)."""
    from jaxgpt.flops import count_flops

    return float(count_flops(config, seq_len, batch_size=batch_size, grad_accum=micro_steps).training_per_step)


def e4m3_fraction(config: GPTConfig, *, seq_len: int, fp8_gemms: str) -> float:
    """The share of the model FLOPs (jaxgpt.flops) that run in e4m3 GEMMs under ``precision: fp8`` with
    ``fp8_gemms`` (``Policy.fp8``; "none": 0)."""
    from jaxgpt.flops import count_flops

    split = count_flops(config, seq_len).training_by_dtype(fp8_gemms)
    return split["e4m3"] / (split["e4m3"] + split["bf16"])


def device_peak_flops(dtype: str, *, e4m3_fraction: float = 0.0) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device for MFU (jaxgpt.devices: a table for accelerators, a GEMM probe
    measured once per process on CPU), and where the number came from; None for a device it doesn't know.
    ``e4m3_fraction`` > 0 (``precision: fp8``): that share of the FLOPs at the fp8 peak, the rest at ``dtype``'s, the
    blended peak of :func:`jaxgpt.devices.mixed_peak` (the ``dtype`` peak on a device without fp8 tensor cores)."""
    import jax

    from jaxgpt import devices

    dev = jax.local_devices()[0]
    if dev.platform == "gpu" and dtype == "float32" and jax.config.jax_default_matmul_precision in (None, "default"):
        dtype = "tf32"  # JAX runs fp32 matmuls on TF32 tensor cores unless precision is pinned
    try:
        peak = float(devices.peak_flops(dev, dtype))
        mixed = devices.mixed_peak(dev, e4m3_fraction, 1.0 - e4m3_fraction, dtype) if e4m3_fraction else None
    except devices.DeviceError as e:  # an unknown device: no MFU, but train anyway
        return None, f"unknown: {e}"
    src = "measured GEMM probe" if dev.platform == "cpu" else f"{dev.device_kind} {dtype} table"
    if mixed is None:
        return peak, src
    fp8 = "fp8 table" if mixed.fp8_native else f"no fp8 tensor cores: e4m3 at the {dtype} peak"
    return mixed.peak, f"blended: {e4m3_fraction:.1%} of the FLOPs in e4m3 ({fp8}), the rest {src}"


SUPERSEDED_METRICS = "metrics.superseded.jsonl"  # records a resume dropped from metrics.jsonl, appended


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when importable); a no-op unless ``enabled`` (process 0 writes).

    Each record goes to the file in one unbuffered write of whole lines (``os.write`` on an ``O_APPEND`` file
    descriptor), so nothing is held in a buffer that a later flush could append; a write that fails (a full
    disk) is cut back to the last whole record, so the log only ever holds whole records. ``failed``: a write
    has failed (the run stops: :class:`jaxgpt.diskspace.WriteFailed`)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, truncate_after: int | None, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.fd: int | None = None
        self.tb = self.tracker = None  # tracker: a WandbTracker fed every record (--wandb)
        self.failed = False
        if not enabled:
            return
        if truncate_after is not None and self.path.exists():  # resumed: set aside what was logged later
            records = read_metrics(run_dir)
            keep = [r for r in records if r.get("step", 0) <= truncate_after]
            later = [r for r in records if r.get("step", 0) > truncate_after]
            if later:  # a killed run's last steps, or a resume_step's abandoned branch: kept, not deleted
                with open(run_dir / SUPERSEDED_METRICS, "a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in later))
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)
        elif truncate_after is None and self.path.exists():
            self.path.unlink()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        if tensorboard:
            self.tb = _summary_writer(run_dir / "tb")

    def write(self, record: dict[str, Any]) -> None:
        if self.fd is None:
            return
        line = (json.dumps(record) + "\n").encode()
        whole = os.fstat(self.fd).st_size  # the log's length in whole records
        try:
            done = 0
            while done < len(line):  # (a write may take only part of the line before the disk fills)
                done += os.write(self.fd, line[done:])
        except OSError as e:  # a full disk: cut the partly written line off, so the log stays whole
            self.failed = True
            try:
                os.ftruncate(self.fd, whole)
            except OSError:
                pass
            from jaxgpt import diskspace

            raise diskspace.WriteFailed(f"{self.path}: cannot append a record ({e.strerror or e}); "
                                        + diskspace.describe_space(self.path.parent, len(line))
                                        + f". The log holds every record up to step {record.get('step')} (excluded)"
                                        "; free space, then re-run the same command to resume") from e
        if self.tracker is not None:
            self.tracker.log(record)
        if self.tb is not None:
            kind = record["type"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step",) and v is not None:
                    self.tb.add_scalar(f"{kind}/{k}", v, record["step"])

    def samples(self, step: int, texts: list[str]) -> None:
        """Text samples (samples.txt is written by the run): to the tracker's table."""
        if self.tracker is not None:
            self.tracker.log_samples(step, texts)

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.close(fd)  # (nothing is buffered: every record was written whole or cut off)
            except OSError:
                pass
        if self.tb is not None:
            self.tb.close()


def _summary_writer(logdir: Path):
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            return __import__(mod, fromlist=["SummaryWriter"]).SummaryWriter(str(logdir))
        except Exception:  # not installed (torch's needs the tensorboard package)
            continue
    return None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (a line torn by a killed process is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_losses(run_dir: str | Path) -> Path | None:
    """loss.png: train and val loss against step, from metrics.jsonl; with HellaSwag scores, a second panel of
    their accuracy (acc_norm, build-nanogpt's number, and acc)."""
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r["type"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r["type"] == "eval"]
    hs = [(r["step"], r["acc_norm"], r["acc"]) for r in records if r["type"] == "hellaswag"]
    if not train and not val:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # a Figure of its own, drawn by Agg: no pyplot, so matplotlib's backend (a notebook's inline one, say) and
    # pyplot's list of figures stay as the caller had them
    fig = Figure(figsize=(14 if hs else 8, 5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if hs else 1, squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    if hs:
        ax = axes[0, 1]
        steps, acc_norm, acc = zip(*hs)
        ax.plot(steps, acc_norm, "o-", ms=3, label="acc_norm")
        ax.plot(steps, acc, "s--", ms=3, lw=1, label="acc")
        ax.axhline(0.25, color="grey", lw=1, ls=":", label="chance")
        ax.set_xlabel("step")
        ax.set_ylabel("HellaSwag accuracy")
        ax.set_title(f"HellaSwag ({hs[-1][0]}: acc_norm {hs[-1][1]:.4f})")
        ax.grid(alpha=0.3)
        ax.legend()
    out = Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out
