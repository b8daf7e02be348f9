"""Worker for tests/test_sharding.py and tests/test_multihost.py: runs in a subprocess whose device count (and
process count) is fixed before JAX starts, and prints one ``RESULT {json}`` line.

    python -m tests.mesh_worker layouts  BATCHES.npy OUT_DIR 'data=4' 'data=2,fsdp=2' 'fsdp=4+step' ...
    python -m tests.mesh_worker restore  SPEC_JSON
    python -m tests.mesh_worker multihost BATCHES.npy OUT_DIR   (under JAXGPT_* env; see test_multihost.py)

Every run uses the tiny model below in fp32 with matmul precision "highest", the same initial params (seed 0)
and the same global batches, so any two runs must agree to rounding.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

# vocab 502: wte (502, 32) is not divisible by 4 along its largest axis, so fsdp=4 shards it along the next.
MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=502)
OPTIM = dict(lr=1e-2, warmup_steps=2, decay_steps=10)
OPTIM.update(json.loads(os.environ.get("MESH_WORKER_OPTIM") or "{}"))  # e.g. Muon (parity_tests/test_muon_parity.py)
MICRO_STEPS, MICRO_BATCH, SEQ = 2, 8, 32


def batches(steps: int, seed: int = 0):
    """(steps, 2, MICRO_STEPS, MICRO_BATCH, SEQ) int32: x and y of every step. Rows count up from a random
    start (mod vocab) with 10% random tokens, so the loss falls quickly (updates matter)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = MODEL["vocab_size"]
    shape = (steps, MICRO_STEPS, MICRO_BATCH)
    t = (rng.integers(0, vocab, shape)[..., None] + np.arange(SEQ + 1)) % vocab
    noise = rng.random(t.shape) < 0.1
    t = np.where(noise, rng.integers(0, vocab, t.shape), t).astype(np.int32)
    return np.stack([t[..., :-1], t[..., 1:]], axis=1)


@functools.lru_cache(maxsize=None)
def model():
    """The tiny GPT (seed 0), initialised in one jitted call on this process's first device."""
    import jax
    from flax import nnx

    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.precision import Policy

    cfg = GPTConfig.from_dict(MODEL)
    policy = Policy(matmul_precision="highest")
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GPT(cfg, policy=policy, rngs=nnx.Rngs(0))), nnx.Param)
    params = jax.jit(lambda: nnx.state(GPT(cfg, policy=policy, rngs=nnx.Rngs(0)), nnx.Param),
                     out_shardings=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))()
    return nnx.merge(graphdef, params)


def optimizer():
    from jaxgpt.optim import OptimConfig, make_optimizer

    return make_optimizer(OptimConfig(**OPTIM))


def setup(mesh, fsdp_reduce: str = "micro_step"):
    """(graphdef, state, optimizer, train_step) for ``mesh`` (a jaxgpt.mesh Mesh)."""
    from jaxgpt.step import init_train_state, make_train_step

    opt = optimizer()
    graphdef, state = init_train_state(model(), opt, mesh=mesh)
    step = make_train_step(graphdef, opt, micro_steps=MICRO_STEPS, mesh=mesh, fsdp_reduce=fsdp_reduce)
    return graphdef, state, opt, step


def abstract_state(mesh):
    """ShapeDtypeStructs (with the mesh's shardings) of the train state: a restore target; nothing is
    initialised or compiled."""
    import jax
    from flax import nnx

    from jaxgpt import mesh as mesh_lib
    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.step import TrainState

    opt = optimizer()
    cfg = GPTConfig.from_dict(MODEL)
    _, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    shapes = jax.eval_shape(lambda p: TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=p,
                                                 opt_state=opt.init(p)), params)
    return mesh_lib.abstract(shapes, mesh)


def train(mesh, data, state=None, step=None, fsdp_reduce: str = "micro_step"):
    """(state, per-step losses, per-step gradient norms) over ``data`` (global batches)."""
    if state is None:
        _, state, _, step = setup(mesh, fsdp_reduce)
    losses, norms = [], []
    for x, y in data:
        state, m = step(state, x, y)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return state, losses, norms


def sharding_report(state, mesh) -> dict:
    """Per leaf: is it sharded, and do all its shards hold exactly 1/fsdp of it; per device: bytes."""
    import jax
    import numpy as np

    from jaxgpt import mesh as mesh_lib

    fsdp = mesh_lib.axis_size(mesh, mesh_lib.FSDP_AXIS)
    bad, sharded_bytes, repl_bytes = [], 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path({"params": state.params, "opt": state.opt_state}):
        nbytes = leaf.size * leaf.dtype.itemsize
        shard_sizes = {int(s.data.nbytes) for s in leaf.addressable_shards}
        expect_sharded = leaf.ndim >= 2 and fsdp > 1
        want = nbytes // fsdp if expect_sharded else nbytes
        if shard_sizes != {want}:
            bad.append(f"{jax.tree_util.keystr(path)} {leaf.shape}: shards {sorted(shard_sizes)}, want {want}")
        if expect_sharded:
            sharded_bytes += nbytes
        else:
            repl_bytes += nbytes
    per_device = mesh_lib.device_bytes({"params": state.params, "opt": state.opt_state})
    return dict(bad=bad, sharded_bytes=sharded_bytes, replicated_bytes=repl_bytes,
                per_device=sorted(set(per_device.values())), devices=len(per_device),
                specs={jax.tree_util.keystr(p): [*leaf.sharding.spec] + [None] * (leaf.ndim - len(leaf.sharding.spec))
                       for p, leaf in jax.tree_util.tree_leaves_with_path(state.params)})


def save_checkpoint(state, directory: str) -> None:
    import numpy as np

    from jaxgpt.checkpoint import Checkpoints

    with Checkpoints(directory, async_save=False) as ck:
        ck.save(int(state.step), params=state.params, opt_state=state.opt_state, config={"model": MODEL})


def flat_numpy(tree) -> dict:
    import jax
    import numpy as np

    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def cmd_layouts(batches_path: str, out_dir: str, *layouts: str) -> dict:
    import jax
    import numpy as np

    from jaxgpt import mesh as mesh_lib

    data = np.load(batches_path)
    out: dict = {"devices": jax.device_count(), "layouts": {}}
    with jax.default_matmul_precision("highest"):
        for layout in layouts:
            t0 = time.perf_counter()
            spec, _, n = layout.partition("@")  # "fsdp=2@2": a mesh over the first 2 devices
            spec, _, reduce = spec.partition("+")  # "fsdp=4+step": fsdp_reduce="step"
            mesh = mesh_lib.make_mesh(spec, jax.devices()[: int(n)] if n else None)
            state, losses, norms = train(mesh, data, fsdp_reduce=reduce or "micro_step")
            out["layouts"][layout] = dict(losses=losses, norms=norms, seconds=time.perf_counter() - t0,
                                          mesh=dict(mesh.shape), **sharding_report(state, mesh))
            if layout == layouts[-1] and out_dir != "-":  # checkpoint the last layout's state
                save_checkpoint(state, out_dir)
                np.savez(Path(out_dir) / "state.npz", **flat_numpy(state))
                out["saved"] = dict(layout=layout, step=int(state.step))
    return out


def cmd_restore(spec_json: str) -> dict:
    """``{"restores": [{"from": DIR, "layout": "fsdp=2", "devices": 1 | null, "save_to": DIR | null}]}``:
    restore each checkpoint onto a mesh of this process's devices and compare with DIR/state.npz."""
    import jax
    import numpy as np

    from jaxgpt import mesh as mesh_lib
    from jaxgpt.checkpoint import Checkpoints

    spec = json.loads(spec_json)
    out = []
    for r in spec["restores"]:
        devices = jax.devices()[: r["devices"]] if r.get("devices") else None
        mesh = mesh_lib.make_mesh(r["layout"], devices)
        target = abstract_state(mesh)
        with Checkpoints(r["from"], read_only=True) as ck:
            got = ck.restore(params=target.params, opt_state=target.opt_state)
        state = target.replace(step=jax.device_put(np.int32(got.step), mesh_lib.replicated(mesh)),
                               params=got.params, opt_state=got.opt_state)
        want = np.load(Path(r["from"]) / "state.npz")
        mine = flat_numpy(state)
        diffs = [k for k in want.files if not (want[k].dtype == mine[k].dtype and np.array_equal(want[k], mine[k]))]
        report = sharding_report(state, mesh)
        out.append(dict(r, step=got.step, leaves=len(want.files), mismatched=diffs, bad=report["bad"],
                        mesh=dict(mesh.shape), devices_used=report["devices"]))
        if r.get("save_to"):
            save_checkpoint(state, r["save_to"])
            np.savez(Path(r["save_to"]) / "state.npz", **mine)
    return {"restores": out}


def wait_for_checkpoint(directory: str, timeout: float = 300.0) -> None:
    """Block until ``directory`` holds a complete checkpoint (another process is writing it)."""
    from jaxgpt.checkpoint import checkpoint_dir

    deadline = time.monotonic() + timeout
    root = checkpoint_dir(directory)
    while not (root.is_dir() and any(p.name.isdigit() for p in root.iterdir())):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint appeared in {root} within {timeout} s")
        time.sleep(0.2)


def restore_into(state, directory: str):
    """``state`` (a TrainState, its arrays placed on some mesh) with the latest checkpoint's values."""
    import jax
    import numpy as np

    from jaxgpt import mesh as mesh_lib
    from jaxgpt.checkpoint import Checkpoints

    with Checkpoints(directory, read_only=True) as ck:
        got = ck.restore(params=state.params, opt_state=state.opt_state)
    step = jax.device_put(np.int32(got.step), state.step.sharding)
    return state.replace(step=step, params=got.params, opt_state=got.opt_state), got.step


def cmd_multihost(batches_path: str, out_dir: str) -> dict:
    """One process of a multi-process run (JAXGPT_* env): trains on the global batches (each process
    feeding its own rows), checkpoints after WORKER_SAVE_AT steps; with WORKER_THEN_RESUME_FROM, once done
    it restores that checkpoint (written meanwhile by another run) and trains from there to the end again.
    WORKER_STEP_SLEEP: seconds to sleep after every step (a test kills the process mid-run)."""
    from jaxgpt import distributed

    distributed.initialize_from_env()
    import jax
    import numpy as np

    from jaxgpt import mesh as mesh_lib

    pid, nproc = jax.process_index(), jax.process_count()
    data = np.load(batches_path)
    save_at = int(os.environ.get("WORKER_SAVE_AT", "0"))
    resume_from = os.environ.get("WORKER_THEN_RESUME_FROM")
    sleep = float(os.environ.get("WORKER_STEP_SLEEP", "0"))
    rows = MICRO_BATCH // nproc
    local = slice(pid * rows, (pid + 1) * rows)
    out: dict = {"process": pid, "processes": nproc, "devices": jax.device_count(),
                 "local_devices": jax.local_device_count()}

    def run(state, step, start):
        losses = []
        for i in range(start, len(data)):
            x, y = data[i]
            state, m = step(state, x[:, local], y[:, local])  # this process's rows only
            losses.append(float(m["loss"]))
            out.setdefault("norms", []).append(float(m["grad_norm"]))
            print(f"step {i + 1} loss {losses[-1]:.6f}", flush=True)
            if save_at and i + 1 == save_at:
                save_checkpoint(state, out_dir)
            if sleep:
                time.sleep(sleep)
        return state, losses

    with jax.default_matmul_precision("highest"):
        mesh = mesh_lib.make_mesh(os.environ.get("WORKER_MESH", ""))
        out["mesh"] = dict(mesh.shape)
        _, state, _, step = setup(mesh)
        out["per_device_param_bytes"] = sorted(set(mesh_lib.device_bytes(state.params).values()))
        state, out["losses"] = run(state, step, 0)
        if resume_from:
            wait_for_checkpoint(resume_from)
            state, start = restore_into(state, resume_from)
            state, out["resumed_losses"] = run(state, step, start)
            out["resumed_from"] = start
    distributed.shutdown()
    return out


def main(argv: list[str]) -> int:
    cmd, *args = argv
    result = {"layouts": cmd_layouts, "restore": cmd_restore, "multihost": cmd_multihost}[cmd](*args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
