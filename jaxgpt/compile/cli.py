"""The command behind ``python -m jaxgpt.compile`` (see :mod:`jaxgpt.compile.__main__`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from jaxgpt.compile.targets import TARGETS, CompileError

GiB = 2**30
POOL_FREE = 0.10  # of JAX's memory pool kept free when searching: allocator fragmentation, cuDNN/cuBLAS scratch


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors: exit 2 with one line, no traceback
        self.exit(2, f"python -m jaxgpt.compile: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxgpt.compile", description=__doc__)
    p.add_argument("--config", default=None, help="training YAML (default: jaxgpt.train's default preset)")
    p.add_argument("--target", default="h100", help=f"GPU: {', '.join(TARGETS)} (default h100 = h100-sxm)")
    p.add_argument("--devices", type=int, default=1, help="GPUs of one host: data parallel over them (default 1)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per device per micro-step (default: the config's batch_size over the devices)")
    p.add_argument("--no-search", action="store_true", help="skip the search for the largest micro-batch that fits")
    p.add_argument("--mem-fraction", type=float, default=0.75,
                   help="share of device memory JAX's pool takes (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.75)")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.add_argument("--hlo", default=None, metavar="FILE",
                   help="predict a saved optimized HLO module (.txt or .txt.gz) instead of compiling: no plugin "
                        "needed; MFU from --config's model FLOPs if given (with --micro-batch), else the program's own "
                        "matmul FLOPs")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="config override, as jaxgpt.train's --FIELD=VALUE (e.g. --set optim.name=sgd)")
    return p


def load_config(path: str | None, sets: list[str]):
    from jaxgpt.config import ConfigError
    from jaxgpt.train.config import TrainConfig

    overrides: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CompileError(f"--set {item!r}: expected FIELD=VALUE")
        overrides[key] = yaml.safe_load(value) if value else ""
    if path is not None and not Path(path).is_file():
        raise CompileError(f"--config {path}: no such file")
    try:
        return TrainConfig.load(path, overrides)
    except ConfigError as e:
        raise CompileError(str(e)) from None


@dataclasses.dataclass
class Report:
    """Everything one compile tells: printed and written as JSON."""

    data: dict[str, Any]
    lines: list[str]


def fits(total: int, target, mem_fraction: float) -> tuple[bool, float]:
    pool = target.device_memory_size * mem_fraction
    return total <= pool * (1 - POOL_FREE), pool


def account_memory(cs, target) -> dict[str, Any] | None:
    """jaxgpt.account's analytic memory per device for the compiled step (None where the accountant does not model
    the step: an optimizer or attention it has no formula for)."""
    from jaxgpt import account

    cfg, policy = cs.cfg, cs.policy
    precision = "fp8" if policy.fp8 != "none" else "bf16" if policy.compute_dtype == "bfloat16" else "fp32"
    attention = account.default_attention(precision, target.name) if policy.kernel("attention") == "auto" \
        else policy.kernel("attention")
    if cfg.optim.name not in account.OPTIMIZERS or attention not in account.ATTENTION_IMPLS:
        return None
    model_cfg = cfg.model if cfg.dropout is None else cfg.model.replace(dropout=cfg.dropout)
    est = account.estimate_memory(model_cfg, batch_size=cs.micro_batch, seq_len=cfg.seq_len, precision=precision,
                                  optimizer=cfg.optim.name, grad_accum=cs.micro_steps, attention=attention,
                                  device=target.name, fast_kernels=policy.fast_kernels,
                                  mesh={k: int(v) for k, v in dict(cs.mesh.shape).items()},
                                  fp8_gemms=policy.fp8 if precision == "fp8" else None)
    return dict(argument=est.params + est.optimizer_state, temp=est.xla_temp, total=est.total)


def memory_lines(mem: dict[str, int], est: dict[str, Any] | None) -> list[str]:
    """XLA's memory beside jaxgpt.account's estimate of it (what ``python -m jaxgpt.account`` prints)."""
    if est is None:
        return ["  (jaxgpt.account has no memory model for this optimizer or attention)"]
    lines = [f"  jaxgpt.account's analytic estimate of the same step: {'estimate':>10}{'compiled':>10}{'ratio':>7}"]
    for key, name in (("argument", "arguments"), ("temp", "temporary"), ("total", "total")):
        lines.append(f"    {name:<48}{est[key] / GiB:>6.2f} GiB{mem[key] / GiB:>6.2f} GiB{est[key] / mem[key]:>7.2f}")
    return lines


def prediction(kernels, target, *, model_flops: float, tokens: int, flops_name: str,
               e4m3_flops: float = 0.0) -> Report:
    """The calibrated estimate (jaxgpt.compile.calibrated, where the target has a calibration) beside the roofline
    bound (jaxgpt.compile.predict), by category, with the MFU of each; ``data`` is the JSON's ``prediction``.
    ``e4m3_flops`` (precision: fp8): that many of the model FLOPs run in e4m3 GEMMs, so MFU is against the blended
    peak of :func:`jaxgpt.devices.mixed_peak` (the fp8 and bf16 dense peaks), not the bf16 peak alone."""
    from jaxgpt.compile import calibrated, predict
    from jaxgpt.devices import mixed_peak

    pred = predict.predict(kernels, predict.gpu_peaks(target), model_flops=model_flops, tokens=tokens)
    try:
        cal = calibrated.for_target(target.name)
    except calibrated.CalibrationError as e:
        raise CompileError(str(e)) from None
    status = calibrated.status(target.name)
    peak, peak_name = target.peak_bf16, "bf16"
    if e4m3_flops:
        peak = mixed_peak(target.name, e4m3_flops, model_flops - e4m3_flops).peak
        peak_name = f"blended (fp8 for {e4m3_flops / model_flops:.1%} of the FLOPs, bf16 for the rest)"
    bound = dict(pred.to_dict(), bound_s=pred.time_s, bound_mfu=pred.mfu(peak))
    if cal is None:
        lines = ["predicted from the compiled kernels (a roofline lower bound on time, not a measurement; not "
                 f"calibrated for {target.name}: {status['why']}):",
                 pred.table(peak=peak, peak_name=f"{target.name} dense {peak_name} {peak / 1e12:,.0f} TFLOP/s")]
        return Report(dict(bound, time_s=None, mfu=None, calibrated=None, calibration=status), lines)
    est = calibrated.estimate(kernels, cal)
    by_cat = est.by(lambda k: k.kernel.category)
    unc = est.by(lambda k: k.kernel.category if not k.calibrated else "")
    lines = [f"predicted step time: calibrated to what {cal.provenance.get('device_kind', target.name)} ran "
             f"({cal.provenance.get('trace', '?')}, {cal.provenance.get('jax', '?')}; {status['file']}), beside the "
             "roofline bound",
             f"{'kernels by scope':<26}{'launches':>10}{'TFLOP':>9}{'GB moved':>10}{'bound ms':>10}{'estimate ms':>13}"]
    for r in pred.rows:
        mark = "  (uncalibrated)" if unc.get(r.category) else ""
        lines.append(f"{r.category:<26}{r.launches:>10,}{r.flops / 1e12:>9.2f}{r.bytes / 1e9:>10.2f}"
                     f"{r.time_s * 1e3:>10.2f}{by_cat.get(r.category, 0.0) * 1e3:>13.2f}{mark}")
    lines.append(f"{'host, per execution':<26}{'':>39}{est.overhead_s * 1e3:>13.2f}")
    lines.append(f"{'total':<26}{sum(r.launches for r in pred.rows):>10,}{pred.flops / 1e12:>9.2f}"
                 f"{pred.bytes / 1e9:>10.2f}{pred.time_s * 1e3:>10.2f}{est.time_s * 1e3:>13.2f}")
    mfu = model_flops / est.time_s / peak
    lines.append(f"predicted step {est.time_s * 1e3:,.1f} ms (MFU {mfu:.1%}); roofline bound >= "
                 f"{pred.time_s * 1e3:,.1f} ms (MFU <= {pred.mfu(peak):.1%}); {model_flops / 1e12:,.1f} TFLOP per "
                 f"step ({flops_name}) over {target.name}'s dense {peak_name} {peak / 1e12:,.0f} TFLOP/s")
    if est.uncalibrated_s:
        lines.append(f"uncalibrated: {est.uncalibrated_s * 1e3:,.2f} ms of kernels of classes the trace never saw, at "
                     f"the least efficient measured rate of their kind: {', '.join(est.to_dict()['uncalibrated'])}")
    return Report(dict(bound, time_s=est.time_s, mfu=mfu, calibrated=est.to_dict(), calibration=status), lines)


def describe(cs, target, mem_fraction: float) -> Report:
    """The memory table, lowering, prediction of one compiled step."""
    from jaxgpt.compile import hlo, inspect, predict
    from jaxgpt.flops import count_flops

    cfg = cs.cfg
    text = cs.hlo_text()
    kernels, unknown_loops = hlo.kernels(text)
    mem = cs.memory()
    ok, pool = fits(mem["total"], target, mem_fraction)
    model_cfg = cfg.model if cfg.dropout is None else cfg.model.replace(dropout=cfg.dropout)
    fc = count_flops(model_cfg, cfg.seq_len, batch_size=cs.micro_batch, grad_accum=cs.micro_steps)
    tokens = cs.micro_batch * cs.micro_steps * cfg.seq_len
    pred = predict.predict(kernels, predict.gpu_peaks(target), model_flops=fc.training_per_step, tokens=tokens)
    e4m3 = fc.training_per_step_by_dtype(cs.policy.fp8)["e4m3"]  # precision: fp8's forward GEMMs (0 otherwise)
    expected = prediction(kernels, target, model_flops=fc.training_per_step, tokens=tokens, flops_name="jaxgpt.flops",
                          e4m3_flops=e4m3)
    st = inspect.structure(text, kernels, seq_len=cfg.seq_len)
    est = account_memory(cs, target)
    lines = [
        f"step: micro-batch {cs.micro_batch} x {cfg.seq_len} per device x {cs.n_devices} device(s), {cs.micro_steps} "
        f"micro-step(s): {cs.tokens_per_step:,} tokens per optimizer step; compute {cs.policy.compute_dtype}, "
        f"optimizer {cfg.optim.name}, mesh {dict(cs.mesh.shape)}",
        f"compile: lower {cs.lower_s:.1f} s, compile {cs.compile_s:.1f} s (compile-only: no GEMM autotuning)",
        "memory per device (XLA memory_analysis):",
        f"  arguments {mem['argument'] / GiB:8.2f} GiB   (params + optimizer state + batch; "
        f"{mem['alias'] / GiB:.2f} GiB donated, reused for the outputs)",
        f"  temporary {mem['temp'] / GiB:8.2f} GiB   (activations, gradients, accumulators, scratch)",
        f"  total     {mem['total'] / GiB:8.2f} GiB   of {target.device_memory_size / GiB:.1f} GiB "
        f"({mem['total'] / target.device_memory_size:.0%}); JAX's pool at --mem-fraction {mem_fraction:g}: "
        f"{pool / GiB:.1f} GiB -> " + ("fits" if ok else "DOES NOT FIT"),
        *memory_lines(mem, est),
        *st.lines(cfg.seq_len),
        "",
        *expected.lines,
    ]
    if unknown_loops:
        lines.append(f"note: {unknown_loops} loop(s) without a recorded trip count were counted once")
    data = dict(micro_batch=cs.micro_batch, micro_steps=cs.micro_steps, devices=cs.n_devices,
                tokens_per_step=cs.tokens_per_step, seq_len=cfg.seq_len, compute=cs.policy.compute_dtype,
                lower_s=cs.lower_s, compile_s=cs.compile_s, memory=mem, account_memory=est, fits=ok, pool_bytes=pool,
                structure=dataclasses.asdict(st), prediction=expected.data, predicted_mfu=expected.data["mfu"],
                bound_mfu=expected.data["bound_mfu"], predicted_bytes_per_micro_step=pred.bytes / cs.micro_steps)
    return Report(data, lines)


def search(cfg, devices, target, mem_fraction: float, known: dict[int, int], say) -> dict[str, Any]:
    """The largest micro-batch (a power of two dividing the batch, so accumulation still makes it up) whose
    compiled step fits JAX's pool with :data:`POOL_FREE` of it free."""
    from jaxgpt.compile.program import compile_train_step

    per_device_rows = (cfg.total_batch_tokens or cfg.batch_size * cfg.seq_len) // cfg.seq_len // len(devices)
    tried: dict[int, float] = {}
    start = min(known)
    mb, best = 1, None
    while mb <= max(per_device_rows, 1):
        if mb >= start // 2 or mb == per_device_rows:
            try:
                total = known.get(mb) or compile_train_step(cfg, devices, micro_batch=mb).memory()["total"]
            except CompileError:
                break
            tried[mb] = total
            ok, _ = fits(total, target, mem_fraction)
            say(f"  micro-batch {mb:>4}: {total / GiB:6.2f} GiB " + ("fits" if ok else "does not fit"))
            if not ok:
                break
            best = mb
        mb *= 2
    return dict(best=best, tried={str(k): v for k, v in tried.items()})


def read_hlo(path: str) -> str:
    import gzip

    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise CompileError(f"--hlo {path}: cannot read it ({getattr(e, 'strerror', None) or e}); give an optimized HLO "
                           "text file (compiled.as_text(), gzip accepted)") from None
    if "ENTRY" not in text:
        raise CompileError(f"--hlo {path}: no ENTRY computation: not an HLO module's text (compiled.as_text())")
    return text


def predict_hlo(args) -> dict[str, Any]:
    """``--hlo``: the prediction of a saved optimized module, nothing compiled."""
    from jaxgpt.compile import hlo
    from jaxgpt.compile.targets import get_target

    target = get_target(args.target)
    kernels, unknown_loops = hlo.kernels(read_hlo(args.hlo))
    if args.config is not None or args.set:
        from jaxgpt.flops import count_flops

        cfg = load_config(args.config, args.set)
        mb = args.micro_batch or cfg.batch_size
        steps = cfg.micro_steps() if args.micro_batch is None else max(1, (cfg.total_batch_tokens or 0) // (
            mb * cfg.seq_len))
        model_flops = count_flops(cfg.model, cfg.seq_len, batch_size=mb, grad_accum=steps).training_per_step
        tokens, name = mb * steps * cfg.seq_len, "jaxgpt.flops"
    else:
        model_flops, tokens = sum(k.flops * k.count for k in kernels if k.matmul_dtype), 0
        name = "the program's matmul and attention FLOPs"
    report = prediction(kernels, target, model_flops=model_flops, tokens=tokens, flops_name=name)
    print(f"jaxgpt.compile: {args.hlo} for {target.name} (a saved module: nothing compiled)")
    print("\n".join(report.lines))
    if unknown_loops:
        print(f"note: {unknown_loops} loop(s) without a recorded trip count were counted once")
    return dict(target=target.name, hlo=args.hlo, config=args.config, overrides=args.set, prediction=report.data,
                predicted_mfu=report.data["mfu"], bound_mfu=report.data["bound_mfu"])


def write_json(path: str, data: dict[str, Any]) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))
    except OSError as e:
        raise CompileError(f"--json {path}: cannot write it ({e.strerror or e}); the figures above are "
                           "complete: give a writable path to keep them as JSON") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        if args.hlo is not None:
            data = predict_hlo(args)
            if args.json:
                write_json(args.json, data)
            return 0
        from jaxgpt.compile.program import compile_train_step
        from jaxgpt.compile.targets import get_target, topology_devices

        if not 0 < args.mem_fraction <= 1:
            raise CompileError(f"--mem-fraction {args.mem_fraction}: must be in (0, 1]")
        target = get_target(args.target)
        cfg = load_config(args.config, args.set)
        if args.micro_batch is not None and args.micro_batch < 1:
            raise CompileError(f"--micro-batch {args.micro_batch}: must be >= 1")
        devices = topology_devices(target, args.devices)
        import jax
        import jaxlib

        say(f"jaxgpt.compile: {args.config or 'default config'} for {args.devices} x {target.name} "
            f"({target.device_kind}; {target.source}); jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
            f"compile-only (nothing runs)")
        cs = compile_train_step(cfg, devices, micro_batch=args.micro_batch)
        report = describe(cs, target, args.mem_fraction)
        say("\n".join(report.lines))
        data = dict(target=target.name, config=args.config, overrides=args.set, jax=jax.__version__, **report.data)
        if not args.no_search:
            say(f"largest micro-batch that fits (powers of two, {POOL_FREE:.0%} of the pool kept free):")
            found = search(cfg, devices, target, args.mem_fraction, {cs.micro_batch: report.data["memory"]["total"]}, say)
            data["search"] = found
            if found["best"]:
                steps = max(1, (cfg.total_batch_tokens or 0) // (found["best"] * len(devices) * cfg.seq_len))
                say(f"  -> micro-batch {found['best']} per device ({steps} micro-step(s) per optimizer step)")
        if args.json:
            write_json(args.json, data)
        if not report.data["fits"]:
            print(f"error: micro-batch {cs.micro_batch} does not fit: the step needs "
                f"{report.data['memory']['total'] / GiB:.2f} GiB per device, JAX's pool on {target.name} is "
                f"{report.data['pool_bytes'] / GiB:.1f} GiB; use a smaller batch_size (with total_batch_tokens kept, "
                f"accumulation makes up the rest) or more devices with an fsdp mesh", file=sys.stderr)
            return 2
        return 0
    except CompileError as e:
        print(f"python -m jaxgpt.compile: error: {e}", file=sys.stderr)
        return 2

