"""Plain PyTorch training for torch_ref: the oracle for ``jaxgpt.optim`` + ``jaxgpt.step``.

build-nanogpt's loop: per step, set the lr from the warmup + cosine schedule, accumulate gradients over the
micro-steps (each micro-loss divided by their count), clip the global norm, ``optimizer.step()``.

Each ``OptimConfig.name`` maps to the torch.optim class configured to the *same update rule* as jaxgpt's optax
chain (the table in ``jaxgpt/optim.py`` lists the rules and where the two libraries' defaults differ):

=========  ==========================================================================================
adamw      ``AdamW(betas=(beta1, beta2), eps, weight_decay)`` -- decoupled decay, as optax.adamw
adam       ``Adam(betas, eps, weight_decay)`` -- torch's decay is coupled L2 (g += wd * p); jaxgpt puts
           ``optax.add_decayed_weights`` before ``optax.adam`` to match
sgd        ``SGD(momentum, dampening=0, nesterov, weight_decay)`` -- the buffer b = m*b + g is optax's
           trace; decay is coupled L2 in both
adagrad    ``Adagrad(initial_accumulator_value = init + eps, eps = 0, lr_decay = 0)`` -- optax divides by
           sqrt(a + eps), torch by sqrt(a) + eps: folding eps into the accumulator's start value and
           setting torch's eps to 0 gives optax's rule exactly
rmsprop    ``RMSprop(alpha, eps, momentum=0, centered=False)`` -- eps outside the sqrt; jaxgpt passes
           ``eps_in_sqrt=False`` to optax.rmsprop
muon       ``Muon`` (below): ``torch.optim.Muon(lr=muon_lr, momentum, nesterov, ns_coefficients, ns_steps,
           weight_decay=muon_weight_decay, adjust_lr_fn)`` on the blocks' hidden matrices, ``AdamW`` on the rest
=========  ==========================================================================================

Muon, and where it meets jaxgpt (``jaxgpt/muon.py`` names each difference of the two libraries): torch.optim.Muon
reads a weight as nn.Linear's (out, in); our weights are HF Conv1D (in, out), so Muon is given the *transposed view*
of each (``weight.T``, sharing storage; its shape-based lr adjustment then sees (out, in) as it was written for),
and, with ``muon_qkv='split'``, one view per q, k, v block of c_attn (``weight[:, i C:(i+1) C].T``), the three
(C, C) matrices the speedrun orthogonalises. Each step hands the views the matching slices of ``weight.grad``.
torch's Newton-Schulz runs in bf16 whatever the config says (``muon_ns_dtype`` is jaxgpt's; the parity tests build
their float64 referee separately).

Weight decay applies to the >= 2-D parameters only (Linear weights, wte, wpe), through two param groups.
The config object is duck-typed (any object with ``OptimConfig``'s fields), so this module needs no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from jaxgpt.optim import OptimConfig


def get_lr(cfg: "OptimConfig", step: int) -> float:
    """build-nanogpt's ``get_lr``, written out independently of jaxgpt's schedule."""
    max_lr, min_lr = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return max_lr
    if step > cfg.decay_steps:
        return min_lr
    decay_ratio = (step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (max_lr - min_lr)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: >= 2-D params (decayed) and the rest (biases, LayerNorm weights; not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


MUON_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_muon_matrix(name: str) -> bool:
    """The blocks' hidden matrices, ``h.{i}.attn.c_attn.weight`` etc. (jaxgpt.muon.muon_labels' names)."""
    parts = name.split(".")
    return len(parts) == 5 and parts[0] == "h" and parts[1].isdigit() and ".".join(parts[2:]) in MUON_MATRICES


class Muon:
    """torch.optim.Muon on the hidden matrices (as transposed views, see the module docstring) and
    torch.optim.AdamW on every other parameter; one schedule: each group's ``lr_scale`` times the step's lr."""

    def __init__(self, model: torch.nn.Module, cfg: "OptimConfig"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.muon_names = [n for n, _ in named if is_muon_matrix(n)]
        self.views: list[tuple[torch.nn.Parameter, torch.nn.Parameter, slice]] = []  # (view, weight, columns)
        for name, w in named:
            if not is_muon_matrix(name):
                continue
            n_in, n_out = w.shape
            blocks = 3 if cfg.muon_qkv == "split" and name.endswith("attn.c_attn.weight") else 1
            width = n_out // blocks
            for i in range(blocks):
                cols = slice(i * width, (i + 1) * width)
                view = torch.nn.Parameter(w.data[:, cols].T)  # shares w's storage: Muon's in-place steps land in w
                self.views.append((view, w, cols))
        others = [(n, p) for n, p in named if not is_muon_matrix(n)]
        lr = get_lr(cfg, 0)
        scale = cfg.muon_lr / cfg.lr
        self.muon = torch.optim.Muon(
            [v for v, _, _ in self.views], lr=lr * scale, weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_coefficients=tuple(cfg.muon_ns_coeffs),
            ns_steps=cfg.muon_ns_steps,  # eps: torch's default 1e-7 floor (jaxgpt/muon.py, difference 2)
            adjust_lr_fn="match_rms_adamw" if cfg.muon_lr_adjust == "match_rms_adamw" else "original")
        for group in self.muon.param_groups:
            group["lr_scale"] = scale
        groups = [{"params": [p for _, p in others if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for _, p in others if p.dim() < 2], "weight_decay": 0.0}]
        # AdamW with param_groups' rule (decay on the >= 2-D: wte, wpe)
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(cfg.beta1, cfg.beta2),
                                       eps=cfg.eps, fused=False, foreach=False)
        self.adamw_params = [p for _, p in others]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        for view, w, cols in self.views:  # the (clipped) gradient slice, transposed like the view
            view.grad = None if w.grad is None else w.grad[:, cols].T
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for view, w, _ in self.views:
            view.grad = None
            if w.grad is not None:
                w.grad = None if set_to_none else w.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def make_optimizer(model: torch.nn.Module, cfg: "OptimConfig") -> torch.optim.Optimizer:
    if cfg.name == "muon":
        return Muon(model, cfg)
    groups = param_groups(model, cfg.weight_decay)
    lr = get_lr(cfg, 0)
    plain = dict(foreach=False)  # the plain per-tensor loops: the code that reads like the formulas above
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=False, **plain)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=False, **plain)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, dampening=0.0, nesterov=cfg.nesterov,
                               **plain)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr, lr_decay=0.0, eps=0.0,
                                   initial_accumulator_value=cfg.adagrad_initial_accumulator + cfg.eps, **plain)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, alpha=cfg.rmsprop_alpha, eps=cfg.eps, momentum=0.0,
                                   centered=False, **plain)
    raise ValueError(f"optimizer name = {cfg.name!r}: allowed values are adamw, adam, sgd, adagrad, rmsprop, muon")


def accumulate_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Backward over the micro-steps of ``x, y: (micro_steps, micro_batch, seq)``, leaving the mean of the
    micro-batch gradients in ``.grad`` (grads must be zeroed first); returns the mean loss."""
    micro_steps = x.shape[0]
    loss_accum = 0.0
    for i in range(micro_steps):
        _, loss = model(x[i], y[i])
        loss = loss / micro_steps  # so the summed grads are the mean over micro-steps
        loss_accum += loss.detach()
        loss.backward()
    return float(loss_accum)


def train_steps(model: torch.nn.Module, batches: Iterable[tuple[Any, Any]], cfg: "OptimConfig", *,
                optimizer: torch.optim.Optimizer | None = None, start_step: int = 0) -> list[float]:
    """Train ``model`` in place, one optimizer step per ``(x, y)`` batch shaped (micro_steps, micro_batch,
    seq); returns each step's mean loss. To continue a run pass its ``optimizer`` (from
    :func:`make_optimizer`) and the number of steps already taken as ``start_step``."""
    device = next(model.parameters()).device
    optimizer = optimizer or make_optimizer(model, cfg)
    model.train()
    losses = []
    for step, (x, y) in enumerate(batches, start=start_step):
        x = torch.as_tensor(x, dtype=torch.long, device=device)
        y = torch.as_tensor(y, dtype=torch.long, device=device)
        optimizer.zero_grad(set_to_none=True)
        losses.append(accumulate_grads(model, x, y))
        update(model, optimizer, cfg, step)
    return losses


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: "OptimConfig", step: int) -> float:
    """One optimizer update from the gradients in ``.grad``: the lr of ``step`` (counted from 0), global-norm
    clipping, ``optimizer.step()``. Returns the gradient norm before clipping."""
    lr = get_lr(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    params = [p for p in model.parameters() if p.grad is not None]
    if cfg.grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    optimizer.step()
    return float(norm)


# ---- a whole run: `python -m torch_ref.train --config configs/shakespeare-char-cpu.yaml` -------------------------
def evaluate(model: torch.nn.Module, loader: Any, start: dict[str, Any], batches: int) -> float:
    """Mean loss of the val loader's first ``batches`` batches (from its position ``start``), as jaxgpt's run."""
    model.eval()
    loader.load_state_dict(start)
    with torch.no_grad():
        losses = [float(model(torch.as_tensor(x, dtype=torch.long), torch.as_tensor(y, dtype=torch.long))[1])
                  for x, y in (loader.next_batch() for _ in range(batches))]
    model.train()
    return sum(losses) / len(losses)


def run(config: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """jaxgpt.train's run of a config, in plain PyTorch on the CPU (float32): the same initial weights (jaxgpt's init
    of the config's seed), the same batches (jaxgpt's DataLoader, same seed and mode), the same learning-rate
    schedule and the same evaluations (the first ``eval_steps`` val batches at step 0, every ``eval_interval`` steps
    and at the end), then ``sample_num`` samples; its ``metrics.jsonl``, ``samples.txt`` and ``summary.json`` go
    to ``--out_dir`` if given, else the config's ``out_dir`` + ``-torch`` (beside jaxgpt's run, not over it).

    ``config`` None is jaxgpt.train's default config."""
    import json
    import time
    from pathlib import Path

    from jaxgpt import data as data_lib, tokenizer
    from jaxgpt.precision import Policy
    from jaxgpt.train.config import TrainConfig
    from jaxgpt.train.run import build_model
    from jaxgpt.weights import to_torch_state_dict
    from torch_ref.model import GPT

    cfg = TrainConfig.load(config, overrides)
    t0 = time.perf_counter()
    out = Path(overrides.get("out_dir") or cfg.out_dir + "-torch")
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch_ref.train: {cfg.max_steps} steps of {config or 'the default config'}; writing metrics.jsonl, "
          f"samples.txt and summary.json to {out}", flush=True)
    data_dir = data_lib.ensure_prepared(cfg.data_source, cfg.resolved_data_dir(), tokenizer=cfg.tokenizer)
    tok = tokenizer.from_record(data_lib.manifest_tokenizer(data_dir))
    micro = cfg.micro_steps()
    train = data_lib.DataLoader(data_dir, "train", cfg.batch_size * micro, cfg.seq_len, mode=cfg.loader_mode,
                                seed=cfg.seed)
    val = data_lib.DataLoader(data_dir, "val", cfg.batch_size, cfg.seq_len, mode="sequential", seed=cfg.seed)
    val_start, n_eval = val.state_dict(), min(cfg.eval_steps, val.batches_per_epoch)
    jax_model = build_model(cfg, Policy.named("fp32"))  # jaxgpt's initial weights, exactly
    model = GPT(jax_model.config)
    model.load_state_dict(to_torch_state_dict(jax_model))
    del jax_model
    torch.manual_seed(cfg.seed)
    optimizer = make_optimizer(model, cfg.optim)
    records = [{"type": "eval", "step": 0, "val_loss": evaluate(model, val, val_start, n_eval)}]
    print(f"step 0: val loss {records[-1]['val_loss']:.4f}", flush=True)
    t_train = time.perf_counter()
    for step in range(1, cfg.max_steps + 1):
        x, y = train.next_batch()
        x = torch.as_tensor(x.reshape(micro, cfg.batch_size, cfg.seq_len), dtype=torch.long)
        y = torch.as_tensor(y.reshape(micro, cfg.batch_size, cfg.seq_len), dtype=torch.long)
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_grads(model, x, y)
        norm = update(model, optimizer, cfg.optim, step - 1)
        records.append({"type": "train", "step": step, "loss": loss, "grad_norm": norm,
                        "lr": get_lr(cfg.optim, step - 1)})
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.max_steps:
            records.append({"type": "eval", "step": step, "val_loss": evaluate(model, val, val_start, n_eval)})
            print(f"step {step}: train loss {loss:.4f}, val loss {records[-1]['val_loss']:.4f}", flush=True)
    train_s = time.perf_counter() - t_train
    model.eval()
    prompt = tok.encode(cfg.sample_prompt) or [tok.eot_token or 0]
    gen = torch.Generator().manual_seed(cfg.seed)
    idx = model.generate(torch.tensor([prompt] * cfg.sample_num), cfg.sample_len, temperature=cfg.sample_temperature,
                         top_k=cfg.sample_top_k or None, generator=gen)
    samples = [tok.decode(row.tolist()) for row in idx]
    (out / "samples.txt").write_text("".join(f"--- sample {i} (step {cfg.max_steps}) ---\n{t}\n"
                                             for i, t in enumerate(samples)))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    evals = [r for r in records if r["type"] == "eval"]
    best = min(evals, key=lambda r: r["val_loss"])
    summary = {"steps": cfg.max_steps, "val_loss": evals[-1]["val_loss"], "best_val_loss": best["val_loss"],
               "best_val_step": best["step"], "train_s": train_s, "wall_s": time.perf_counter() - t0,
               "torch_threads": torch.get_num_threads(), "config": str(config)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done: best val loss {best['val_loss']:.4f} (step {best['step']}), {summary['wall_s']:.1f} s wall; "
          f"metrics.jsonl, samples.txt, summary.json in {out}\n" + "\n".join(samples), flush=True)
    return summary


# the TrainConfig fields run() reads (the rest, e.g. precision, kernels, mesh, checkpoints, are jaxgpt's alone)
USED_FIELDS = ("model_preset", "model.", "init_from", "dropout", "data_source", "data_dir", "tokenizer", "loader_mode",
               "batch_size", "seq_len", "total_batch_tokens", "max_steps", "eval_interval", "eval_steps",
               "sample_prompt", "sample_num", "sample_len", "sample_temperature", "sample_top_k", "optim.", "out_dir",
               "seed")


def usage() -> str:
    """``--help``: what the command does, and the jaxgpt.train fields it reads."""
    from jaxgpt.train.cli import _field_help  # jaxgpt.train's own field list, so the two cannot drift apart
    from jaxgpt.train.config import TrainConfig

    fields = [line for line in _field_help(TrainConfig)
              if line.strip().removeprefix("--").startswith(USED_FIELDS)]
    return ("python -m torch_ref.train: " + " ".join(run.__doc__.split("\n\n")[0].replace("``", "").split()) + "\n\n"
            "usage: python -m torch_ref.train [--config FILE] [--print-config] [--FIELD=VALUE ...]\n\n"
            "The config and overrides are jaxgpt.train's (the same YAML files, the same checks and errors); "
            "--config defaults to jaxgpt.train's default config. Fields it reads:\n" + "\n".join(fields) + "\n"
            "Other jaxgpt.train fields (precision, kernels, mesh, checkpoints, resume, ...) are checked but not used.")


def main(argv: list[str] | None = None) -> int:
    """``python -m torch_ref.train [--config FILE] [--field=value ...]``: jaxgpt.train's arguments, its one-line
    errors (exit 2) and its ``--help`` shape."""
    import sys

    import yaml

    from jaxgpt.config import ConfigError
    from jaxgpt.train.cli import EXIT_CONFIG, load_config

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        config_path, overrides, cfg, print_config = load_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    if cfg.schedule_warning():
        print(cfg.schedule_warning(), file=sys.stderr)
    from jaxgpt.data import DataError
    from jaxgpt.weights import CheckpointError

    try:
        run(None if config_path is None else str(config_path), overrides)
    except (ConfigError, DataError, CheckpointError) as e:  # e.g. no data, an init_from that cannot be loaded
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
