"""jaxgpt.mesh: mesh configuration, the FSDP sharding rule, and training on 4 and 8 virtual CPU devices.

The multi-device runs happen in subprocesses (``tests/mesh_worker.py``; the device count is fixed when JAX
starts): data parallel + FSDP layouts give the same per-step losses as one device to 1e-6 over 10 steps,
every device holds exactly ``1/fsdp`` of each sharded parameter and optimizer-state leaf, and orbax
checkpoints restore bit-identically onto meshes of other sizes (4 -> 2, 4 -> 1, 8 -> 2, 1 -> 8, 1 -> 4,
4 -> 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgpt.config import ConfigError
from jaxgpt.mesh import (MeshConfig, batch_sharding, describe, fsdp_spec, make_mesh, param_shardings,
                         state_shardings)
from tests import mesh_worker

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 400  # seconds, per subprocess (generous: the CPU is shared; the runs take ~30-60 s)


# ---- configuration and the rule (no devices needed) -----------------------------------------------------
def test_fsdp_reduce_values():
    from jaxgpt.step import make_train_step
    from jaxgpt.train.config import TrainConfig

    assert TrainConfig.load(None, {"fsdp_reduce": "step"}).fsdp_reduce == "step"
    with pytest.raises(ConfigError, match=r"TrainConfig.fsdp_reduce = 'never': allowed values are \['micro_step', "
                                          r"'step'\]"):
        TrainConfig.load(None, {"fsdp_reduce": "never"})
    with pytest.raises(ValueError, match="fsdp_reduce = 'never'"):
        make_train_step(None, None, micro_steps=1, fsdp_reduce="never")


def test_mesh_config_sizes_and_errors():
    assert MeshConfig().shape(8) == {"data": 8, "fsdp": 1}
    assert MeshConfig(fsdp=4).shape(8) == {"data": 2, "fsdp": 4}
    assert MeshConfig(data=2, fsdp=-1).shape(8) == {"data": 2, "fsdp": 4}
    assert MeshConfig(data=2, fsdp=4).shape(8) == {"data": 2, "fsdp": 4}
    assert MeshConfig.parse("data=2,fsdp=4") == MeshConfig(2, 4)
    assert MeshConfig.parse("fsdp=8") == MeshConfig(-1, 8)
    assert MeshConfig.parse("") == MeshConfig()
    assert MeshConfig.from_dict({"fsdp": 2}) == MeshConfig(-1, 2)
    with pytest.raises(ConfigError, match=r"data \* fsdp = 2 \* 3 = 6 must equal the number of devices \(8\)"):
        MeshConfig(2, 3).shape(8)
    with pytest.raises(ConfigError, match=r"MeshConfig.fsdp = 3: must divide the number of devices \(8\).*"
                                          r"\[1, 2, 4, 8\]"):
        MeshConfig(fsdp=3).shape(8)
    with pytest.raises(ConfigError, match="at most one axis can be -1"):
        MeshConfig(-1, -1)
    with pytest.raises(ConfigError, match=r"MeshConfig.fsdp = 0: must be an integer >= 1, or -1"):
        MeshConfig(fsdp=0)
    with pytest.raises(ConfigError, match="unknown axis 'tensor'"):
        MeshConfig.parse("tensor=2")
    with pytest.raises(ConfigError, match="expected comma-separated axis=size pairs"):
        MeshConfig.parse("data:2")
    with pytest.raises(ConfigError, match="unknown key"):
        MeshConfig.from_dict({"model": 2})
    with pytest.raises(ConfigError, match=r"must equal the number of devices \(1\)"):
        make_mesh(MeshConfig(data=2), jax.devices()[:1])


def test_fsdp_rule():
    assert fsdp_spec((768, 2304), 4) == P(None, "fsdp")  # the largest axis
    assert fsdp_spec((3072, 768), 4) == P("fsdp", None)
    assert fsdp_spec((50257, 768), 8) == P(None, "fsdp")  # 50257 % 8 != 0: the next largest
    assert fsdp_spec((768, 768), 2) == P("fsdp", None)  # ties: the first axis
    assert fsdp_spec((6, 10), 4) == P()  # none divisible: replicated
    assert fsdp_spec((768,), 4) == P()  # < 2-D: replicated
    assert fsdp_spec((), 4) == P()
    assert fsdp_spec((768, 2304), 1) == P()  # no FSDP
    assert fsdp_spec((2, 8, 10), 4) == P(None, "fsdp", None)


def test_shardings_on_one_device():
    """The rule's functions on a 1-device mesh (replicated everything), and the state/param agreement."""
    mesh = make_mesh(devices=jax.devices()[:1])
    assert mesh.axis_names == ("data", "fsdp") and mesh.devices.shape == (1, 1)
    state = mesh_worker.abstract_state(mesh)
    specs = {s.spec for s in jax.tree.leaves(state_shardings(state, mesh))}
    assert specs == {P()}
    assert jax.tree.structure(param_shardings(state.params, mesh)) == jax.tree.structure(state.params)
    assert batch_sharding(mesh, 3).spec == P(None, ("data", "fsdp"), None)
    assert batch_sharding(mesh, 2).spec == P(("data", "fsdp"), None)
    assert describe(mesh) == "data=1 x fsdp=1 (1 devices, 1 process)"


# ---- accounting on a mesh -------------------------------------------------------------------------------
def test_account_per_device_memory_on_a_mesh(capsys):
    from jaxgpt import account as acc
    from jaxgpt.config import GPTConfig

    assert acc.main(["--device", "h100", "--mesh", "data=1,fsdp=8", "--model", "gpt2-xl", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    n = acc.count_params(GPTConfig.preset("gpt2-xl")).total
    m = d["memory"]
    assert d["mesh"] == {"data": 1, "fsdp": 8} and d["devices"] == 8 and m["state_shards"] == 8
    assert m["params"] == m["grads"] == -(-4 * n // 8)  # sharded by fsdp
    assert m["optimizer_state"] == -(-8 * n // 8)  # AdamW's two moments
    assert m["gathered_weights"] == 4 * n  # the all-gathered fp32 weights, transient
    single = acc.estimate_memory(GPTConfig.preset("gpt2-xl"), batch_size=8, precision="bf16", attention="cudnn")
    assert m["activations"]["total"] == single.activations.total  # same per-device batch
    assert m["total"] < single.total - 8 * n  # FSDP saves more than the optimizer state of one replica
    one = acc.account(GPTConfig.preset("gpt2-xl"), batch_size=8, precision="bf16", device="h100")
    assert d["train_time_s"] == pytest.approx(one.train_time_s / 8)  # 8 devices
    assert d["train_cost_dollars"] == pytest.approx(one.train_cost_dollars)
    assert d["tokens_per_step"] == 8 * 1024 * 8

    # a global batch is split over the mesh: activations of 64 / (2 x 4) = 8 sequences per device
    assert acc.main(["--mesh", "data=2,fsdp=4", "--global-batch", "64", "--model", "gpt2-xl", "--json"]) == 0
    g = json.loads(capsys.readouterr().out)
    assert g["batch_size"] == 8 and g["memory"]["activations"] == m["activations"]
    assert g["memory"]["params"] == -(-4 * n // 4)
    assert acc.main(["--mesh", "data=2,fsdp=4", "--model", "gpt2-xl"]) == 0
    table = capsys.readouterr().out
    assert "mesh data=2 x fsdp=4" in table and "FSDP all-gathered weights (transient)" in table
    for argv, match in [(["--mesh", "data=2,fsdp=4", "--global-batch", "12"], "multiple of the mesh's 8 devices"),
                        (["--mesh", "fsdp=8", "--fsdp", "8"], "give --mesh or --fsdp, not both"),
                        (["--mesh", "tensor=2"], "unknown axis 'tensor'")]:
        assert acc.main(argv) == 2
        assert match in capsys.readouterr().err


# ---- multi-device runs ----------------------------------------------------------------------------------
def _start(devices: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tests.mesh_worker", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    line = next(ln for ln in _finish(proc).splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _one_device_reference(data: np.ndarray, ckpt: Path) -> tuple[list[float], list[float]]:
    """The same 10 steps on one device, in this process; checkpoints the final state to ``ckpt``."""
    with jax.default_matmul_precision("highest"):
        mesh = make_mesh(devices=jax.devices()[:1])
        state, losses, norms = mesh_worker.train(mesh, data)
        mesh_worker.save_checkpoint(state, str(ckpt))
        np.savez(ckpt / "state.npz", **mesh_worker.flat_numpy(state))
    return losses, norms


@pytest.mark.slow  # 54 s on 2 cores; one mesh per step: tests/test_step.py, tests/test_compile.py
def test_layouts_match_one_device_and_checkpoints_move_between_meshes(tmp_path):
    """4 devices: data=2,fsdp=2 (gradients reduce-scattered per micro-step, and with fsdp_reduce=step once per
    step) and fsdp=4; 8 devices: data=2,fsdp=4 (wte (502, 32): 502 % 4 != 0, so fsdp=4 shards it along its 32
    columns). Then checkpoints move between meshes of 8, 4, 2 and 1 devices."""
    t0 = time.perf_counter()
    np.save(tmp_path / "batches.npy", mesh_worker.batches(10))
    ck = {n: tmp_path / f"ckpt{n}" for n in (1, 4, 8)}
    for d in ck.values():
        d.mkdir()
    b = str(tmp_path / "batches.npy")
    p4 = _start(4, "layouts", b, str(ck[4]), "data=2,fsdp=2+step", "data=2,fsdp=2", "fsdp=4")
    p8 = _start(8, "layouts", b, str(ck[8]), "data=2,fsdp=4")
    try:
        one, one_norms = _one_device_reference(np.load(b), ck[1])
        r4, r8 = _result(p4), _result(p8)
    finally:
        p4.kill()
        p8.kill()
    t_layouts = time.perf_counter() - t0
    assert one[-1] < one[0] - 0.5, one  # it trains

    diffs, norm_diffs = {}, {}
    for r, n in ((r4, 4), (r8, 8)):
        assert r["devices"] == n
        for layout, v in r["layouts"].items():
            fsdp = v["mesh"]["fsdp"]
            assert v["mesh"]["data"] * fsdp == n
            diffs[layout] = float(np.max(np.abs(np.subtract(v["losses"], one))))
            np.testing.assert_allclose(v["losses"], one, rtol=0, atol=1e-6, err_msg=layout)
            # gradient scale too (Adam would hide a gradient off by a constant factor from the losses)
            np.testing.assert_allclose(v["norms"], one_norms, rtol=1e-5, err_msg=layout)
            norm_diffs[layout] = float(np.max(np.abs(np.subtract(v["norms"], one_norms)) / one_norms))
            # Every sharded leaf (params and Adam moments) has every shard exactly 1/fsdp of it...
            assert v["bad"] == [], (layout, v["bad"][:5])
            # ... so each device holds 1/fsdp of the sharded bytes plus the replicated ones.
            assert v["devices"] == n
            assert v["per_device"] == [v["sharded_bytes"] // fsdp + v["replicated_bytes"]], layout
            assert v["sharded_bytes"] > 20 * v["replicated_bytes"]
    specs4, specs22 = r4["layouts"]["fsdp=4"]["specs"], r4["layouts"]["data=2,fsdp=2"]["specs"]
    assert specs4["['wte']['embedding'].value"] == [None, "fsdp"]  # 502 % 4 != 0: the 32 columns
    assert specs22["['wte']['embedding'].value"] == ["fsdp", None]  # 502 % 2 == 0: the rows
    assert specs4["['h'][0]['mlp']['c_proj']['kernel'].value"] == ["fsdp", None]  # (128, 32)
    assert specs4["['h'][0]['attn']['c_attn']['kernel'].value"] == [None, "fsdp"]  # (32, 96)
    assert specs4["['ln_f']['scale'].value"] == [None]
    print(f"\nmax |loss - 1-device loss| over 10 steps: {diffs}; max relative grad-norm diff: {norm_diffs}; "
          f"layouts took {t_layouts:.0f} s")

    # Checkpoints across meshes: saved on fsdp=4 (4 devices), data=2,fsdp=4 (8) and 1 device; restored onto
    # other meshes: 4 -> 2, 4 -> 1, 8 -> 2, and the reverse: 1 -> 8, 1 -> 4, 4 -> 8.
    t1 = time.perf_counter()
    spec2 = {"restores": [{"from": str(ck[4]), "layout": "fsdp=2"},
                          {"from": str(ck[4]), "layout": "data=1", "devices": 1},
                          {"from": str(ck[8]), "layout": "data=1,fsdp=2"}]}
    spec8 = {"restores": [{"from": str(ck[1]), "layout": "fsdp=8"},
                          {"from": str(ck[1]), "layout": "data=2,fsdp=2", "devices": 4},
                          {"from": str(ck[4]), "layout": "data=1,fsdp=8"}]}
    q2, q8 = _start(2, "restore", json.dumps(spec2)), _start(8, "restore", json.dumps(spec8))
    try:
        restores = _result(q2)["restores"] + _result(q8)["restores"]
    finally:
        q2.kill()
        q8.kill()
    for r in restores:
        assert r["step"] == 10 and r["leaves"] > 30
        assert r["mismatched"] == [], r  # bit-identical params and optimizer state
        assert r["bad"] == [], r  # and laid out on the new mesh
    assert [r["devices_used"] for r in restores] == [2, 1, 2, 8, 4, 8]
    print(f"checkpoint moves took {time.perf_counter() - t1:.0f} s")


# ---- the train CLI on a mesh ----------------------------------------------------------------------------
def _train(out: Path, devices: int, *args: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    cmd = [sys.executable, "-m", "jaxgpt.train", "--config", str(REPO / "configs/tiny-test.yaml"),
           f"--data_dir={REPO / 'data_cache' / 'shakespeare'}", f"--out_dir={out}", "--checkpoint_interval=3",
           "--eval_interval=3", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    return out


def _losses(run_dir: Path) -> dict[tuple[str, int], float]:
    from jaxgpt.train import read_metrics

    return {(r["type"], r["step"]): r["loss"] if r["type"] == "train" else r["val_loss"]
            for r in read_metrics(run_dir) if r["type"] in ("train", "eval")}  # not a resume's config_change


@pytest.mark.slow  # ~75 s at load 8 on 2 cores: three CLI runs
def test_train_cli_on_an_fsdp_mesh_then_resumed_on_one_device(tmp_path):
    """``python -m jaxgpt.train --mesh=fsdp=2`` on 2 devices logs its mesh and per-device bytes; its step-3
    checkpoint resumes on 1 device; the losses follow a plain 1-device run (tiny-test: 2 micro-steps of
    4 x 32 tokens, loss ~10.8, so 1e-6 relative: a few float32 ulps)."""
    cache = tmp_path / "xla_cache"
    fsdp = _train(tmp_path / "fsdp", 2, "--mesh=fsdp=2", "--max_steps=3", cache=cache)
    plain = _train(tmp_path / "plain", 1, "--max_steps=6", cache=cache)
    log = _finish(fsdp)
    _finish(plain)
    assert "mesh data=1 x fsdp=2 (2 devices, 1 process); per device: params 3.12 MiB of 6.24 MiB, " \
           "optimizer state 6.24 MiB of 12.48 MiB" in log
    resumed = _finish(_train(tmp_path / "fsdp", 1, "--max_steps=6", cache=cache))
    assert "resumed from step 3" in resumed and "mesh data=1 x fsdp=1 (1 devices, 1 process)" in resumed
    got, want = _losses(tmp_path / "fsdp"), _losses(tmp_path / "plain")
    assert sorted(got) == sorted(want) and len(want) == 9  # 6 train + evals at 0, 3, 6
    np.testing.assert_allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], rtol=1e-6, atol=0)
