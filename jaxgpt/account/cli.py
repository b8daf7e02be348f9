"""``python -m jaxgpt.account``: the account's tables (or JSON) for a preset or a custom shape."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence

from jaxgpt.account.common import OPTIMIZERS, AccountError
from jaxgpt.account.devices import DEVICES, dtype_table
from jaxgpt.account.memory import mesh_devices
from jaxgpt.account.report import account, devices_table, dtypes_table_text
from jaxgpt.config import PRESETS, ConfigError, GPTConfig


# ---- CLI --------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit code 2, message, no traceback (argparse's own behaviour)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_number(text: str) -> float:
    try:
        return float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 10e9)") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxgpt.account",
                description="Parameters, memory, FLOPs, time and cost of training a GPT-2 configuration.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="gpt2", help=f"preset name: {', '.join(sorted(PRESETS))} (default gpt2)")
    src.add_argument("--config", type=Path, help="a YAML config (a model mapping, or a file with a 'model:' key)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch", type=int, default=None, help="sequences per micro-step per device (default 8)")
    batch.add_argument("--global-batch", type=int, default=None,
                       help="sequences per micro-step over all devices of --mesh (split evenly)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default block_size)")
    p.add_argument("--precision", default="bf16", help="fp32, bf16 or fp8 compute (params stay fp32; fp8: bf16 with "
                   "the --fp8-gemms forward GEMMs in e4m3, priced at the fp8 peak); default bf16")
    p.add_argument("--fp8-gemms", default=None, help="with --precision fp8: which forward GEMMs run in e4m3: lm_head, "
                   "mlp, mlp+lm_head or all (default all, as TrainConfig.fp8_gemms)")
    p.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--device", default="h100-sxm", help=f"one of {', '.join(DEVICES)} (default h100-sxm)")
    p.add_argument("--matmul-dtype", default=None, help="peak to use: fp32, tf32, bf16, fp8 (default from precision)")
    p.add_argument("--attention", default=None, help="xla or cudnn (default: what kernels.attention auto picks)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    p.add_argument("--tokens", type=_parse_number, default=None, help="training tokens D (default 20 x params)")
    p.add_argument("--dollars-per-hour", type=float, default=None, help="price of one device (default per device)")
    p.add_argument("--remat", action="store_true", help="activations with per-block rematerialisation")
    p.add_argument("--fsdp", type=int, default=1, help="devices sharding params/grads/optimizer state (default 1)")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. data=2,fsdp=4 (jaxgpt.mesh; memory per device, "
                   "time and cost for all of them); an axis left out or -1 counts as 1")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--dtypes", action="store_true", help="also print the floating-point data types table")
    p.add_argument("--devices", action="store_true", help="also print the device peak table")
    p.add_argument("--conventions", action="store_true", help="also print others' FLOP conventions")
    p.add_argument("--compiled", action="store_true", help="moved: python -m jaxgpt.compile --config FILE --target "
                   "DEVICE compiles the step and prints this memory estimate beside XLA's")
    return p


def _cli_mesh(args: argparse.Namespace) -> dict[str, int] | None:
    if args.mesh is None:
        return {"fsdp": args.fsdp} if args.fsdp != 1 else None
    from jaxgpt.mesh import MeshConfig

    if args.fsdp != 1:
        raise AccountError("give --mesh or --fsdp, not both (--mesh data=1,fsdp=8 is --fsdp 8)")
    cfg = MeshConfig.parse(args.mesh)
    return {"data": max(cfg.data, 1), "fsdp": max(cfg.fsdp, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compiled:  # the accountant sits below jaxgpt.compile (which reads it): it compiles nothing itself
        print(f"{parser.prog}: error: --compiled moved to python -m jaxgpt.compile, which compiles a training config's "
              f"step and prints this estimate beside XLA's memory_analysis(): python -m jaxgpt.compile --config FILE "
              f"--target {args.device} [--micro-batch B] (e.g. --config configs/gpt2-124m.yaml --micro-batch 16)",
              file=sys.stderr)
        return 2
    try:
        if args.config is not None:
            config, name = GPTConfig.from_yaml(args.config), str(args.config)
        else:
            config, name = GPTConfig.preset(args.model), args.model
        mesh = _cli_mesh(args)
        batch = args.batch if args.batch is not None else 8
        if args.global_batch is not None:
            n = mesh_devices(mesh)
            if args.global_batch <= 0 or args.global_batch % n:
                raise AccountError(f"--global-batch = {args.global_batch}: must be a positive multiple of the "
                                   f"mesh's {n} devices")
            batch = args.global_batch // n
        acc = account(config, batch_size=batch, seq_len=args.seq_len, precision=args.precision,
                      optimizer=args.optimizer, grad_accum=args.grad_accum, device=args.device, mfu=args.mfu,
                      tokens=args.tokens, dollars_per_hour=args.dollars_per_hour, remat=args.remat,
                      matmul_dtype=args.matmul_dtype, attention=args.attention, model_name=name, mesh=mesh,
                      fp8_gemms=args.fp8_gemms)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = acc.to_dict()
        if args.dtypes:
            out["dtypes"] = [dataclasses.asdict(d) for d in dtype_table()]
        if args.devices:
            out["devices"] = {k: dict(peak=dict(d.peak), memory_bytes=d.memory_bytes,
                                      bandwidth_bytes_s=d.bandwidth_bytes_s, dollars_per_hour=d.dollars_per_hour,
                                      source=d.source) for k, d in DEVICES.items() if k != "cpu"}
        print(json.dumps(out, indent=2))
        return 0
    print(acc.table())
    if args.conventions:
        from jaxgpt.flops import conventions_table

        print("\nTraining FLOPs per token by convention\n" + conventions_table(config, acc.seq_len))
    if args.devices:
        print("\n" + devices_table())
    if args.dtypes:
        print("\n" + dtypes_table_text())
    return 0
