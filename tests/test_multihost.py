"""Multi-process training on one machine: 2 processes on loopback (JAX's distributed runtime, gloo collectives
on CPU), each with 2 virtual CPU devices, against a 1-process run fed the same global batches.

Each process passes only its own rows of every global batch (process p: rows p*4 .. p*4+3 of 8) and the
train step assembles the global batch with ``jax.make_array_from_process_local_data``; the 1-process run
passes all 8 rows, so both compute on the same global batches and the losses must agree to rounding.
Every subprocess is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxgpt import distributed
from jaxgpt.config import ConfigError
from jaxgpt.mesh import make_mesh
from tests import mesh_worker

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds per subprocess (the CPU is shared; a 2-process run takes ~30-60 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXGPT_", "SLURM_", "OMPI_"))}
    return {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", **extra}


def start_processes(n: int, port: int, *args: str, devices: int = 2, **extra: str) -> list[subprocess.Popen]:
    """``n`` processes of one run (process ids 0..n-1) running ``tests.mesh_worker *args``."""
    return [subprocess.Popen([sys.executable, "-m", "tests.mesh_worker", *args], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_env(devices, JAXGPT_COORDINATOR=f"127.0.0.1:{port}", JAXGPT_NUM_PROCESSES=str(n),
                                      JAXGPT_PROCESS_ID=str(i), **extra))
            for i in range(n)]


def results(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[dict]:
    out = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"process exited with {p.returncode}:\n{stderr[-4000:]}"
            out.append(json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))[7:]))
    finally:
        for p in procs:
            p.kill()
    return out


# ---- settings -------------------------------------------------------------------------------------------
def test_resolve_explicit_env_and_errors(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("JAXGPT_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(k)
    r = distributed.resolve(environ={})
    assert (r.how, r.num_processes, r.process_id) == ("single", 1, 0)
    env = {"JAXGPT_COORDINATOR": "10.0.0.1:1234", "JAXGPT_NUM_PROCESSES": "4", "JAXGPT_PROCESS_ID": "3",
           "JAXGPT_INIT_TIMEOUT": "17", "JAXGPT_LOCAL_DEVICE_IDS": "0,1"}
    r = distributed.resolve(environ=env)
    assert (r.how, r.coordinator, r.num_processes, r.process_id, r.init_timeout, r.local_device_ids) == (
        "explicit", "10.0.0.1:1234", 4, 3, 17, (0, 1))
    assert (r.heartbeat_timeout, r.shutdown_timeout) == (60, 60)
    # config fields win over the environment
    cfg = distributed.DistributedConfig(process_id=1, heartbeat_timeout=5)
    r = distributed.resolve(cfg, environ=env)
    assert (r.process_id, r.heartbeat_timeout) == (1, 5)
    assert distributed.resolve(environ={**env, "JAXGPT_NUM_PROCESSES": "1", "JAXGPT_PROCESS_ID": "0"}).how == "single"
    with pytest.raises(ConfigError, match=r"incomplete.*missing: process_id \(\$JAXGPT_PROCESS_ID\)"):
        distributed.resolve(environ={"JAXGPT_COORDINATOR": "h:1", "JAXGPT_NUM_PROCESSES": "2"})
    with pytest.raises(ConfigError, match=r"process_id = 2: must be < num_processes \(2\)"):
        distributed.resolve(environ={**env, "JAXGPT_NUM_PROCESSES": "2", "JAXGPT_PROCESS_ID": "2"})
    with pytest.raises(ConfigError, match=r"\$JAXGPT_NUM_PROCESSES = 'two': expected an integer >= 1"):
        distributed.resolve(environ={**env, "JAXGPT_NUM_PROCESSES": "two"})
    with pytest.raises(ConfigError, match="expected host:port"):
        distributed.resolve(environ={**env, "JAXGPT_COORDINATOR": "10.0.0.1"})
    with pytest.raises(ConfigError, match="init_timeout = 0: must be null or an integer >= 1"):
        distributed.DistributedConfig(init_timeout=0)


def test_resolve_slurm_through_jax_cluster_detection(monkeypatch):
    """SLURM is JAX's own auto-detection (jax._src.clusters.SlurmCluster); resolve() reports what it will use."""
    for k in list(os.environ):
        if k.startswith(("JAXGPT_", "SLURM_", "OMPI_", "JAX_COORDINATOR")):
            monkeypatch.delenv(k)
    slurm = dict(SLURM_JOB_ID="12345", SLURM_STEP_NODELIST="gpu[003-004],gpu010", SLURM_NTASKS="16",
                 SLURM_PROCID="9", SLURM_LOCALID="1", SLURM_STEP_NUM_NODES="2")
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    r = distributed.resolve()
    assert (r.how, r.coordinator, r.num_processes, r.process_id) == ("slurm", "gpu003:61497", 16, 9)
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "5000")
    assert distributed.resolve().coordinator == "gpu003:5000"
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task step: a single process
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert distributed.resolve().how == "single"
    monkeypatch.setenv("SLURM_NTASKS", "16")  # explicit settings win over SLURM
    monkeypatch.setenv("JAXGPT_COORDINATOR", "h:1")
    monkeypatch.setenv("JAXGPT_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXGPT_PROCESS_ID", "1")
    assert distributed.resolve().how == "explicit"


# ---- 2 processes ----------------------------------------------------------------------------------------
def test_two_processes_match_one_and_checkpoints_cross_process_counts(tmp_path):
    """2 processes (mesh data=2 x fsdp=2: each process's 2 devices form an FSDP group, the data axis spans
    the processes) and 1 process on 1 device run the same 10 steps, each checkpointing after step 5; then
    each restores the *other* run's step-5 checkpoint and runs steps 6-10 again."""
    t0 = time.perf_counter()
    np.save(tmp_path / "batches.npy", mesh_worker.batches(10))
    b = str(tmp_path / "batches.npy")
    two_ck, one_ck = tmp_path / "ckpt_2proc", tmp_path / "ckpt_1proc"
    procs = start_processes(2, free_port(), "multihost", b, str(two_ck), WORKER_MESH="data=2,fsdp=2",
                            WORKER_SAVE_AT="5", WORKER_THEN_RESUME_FROM=str(one_ck))
    try:
        with jax.default_matmul_precision("highest"):  # meanwhile: 1 process, 1 device
            mesh = make_mesh(devices=jax.devices()[:1])
            _, state, _, step = mesh_worker.setup(mesh)
            state, one, one_norms = mesh_worker.train(mesh, np.load(b)[:5], state, step)
            mesh_worker.save_checkpoint(state, str(one_ck))
            state, rest, rest_norms = mesh_worker.train(mesh, np.load(b)[5:], state, step)
            one, one_norms = one + rest, one_norms + rest_norms
            mesh_worker.wait_for_checkpoint(str(two_ck))
            state, start = mesh_worker.restore_into(state, str(two_ck))
            _, one_resumed, _ = mesh_worker.train(mesh, np.load(b)[5:], state, step)
        two = results(procs)
    finally:
        for p in procs:
            p.kill()
    assert [r["process"] for r in two] == [0, 1] and all(r["devices"] == 4 for r in two)
    assert two[0]["mesh"] == {"data": 2, "fsdp": 2}
    assert two[0]["losses"] == two[1]["losses"]  # every process sees the global loss
    assert one[-1] < one[0] - 0.5  # it trains
    np.testing.assert_allclose(two[0]["losses"], one, rtol=0, atol=1e-6)
    np.testing.assert_allclose(two[0]["norms"][:10], one_norms, rtol=1e-5)
    # Checkpoints move between process counts: 2-process checkpoint resumed in 1 process, and the reverse.
    assert start == 5 and two[0]["resumed_from"] == 5
    np.testing.assert_allclose(one_resumed, one[5:], rtol=0, atol=1e-6)
    np.testing.assert_allclose(two[0]["resumed_losses"], one[5:], rtol=0, atol=1e-6)
    d = lambda a, b: float(np.max(np.abs(np.subtract(a, b))))  # noqa: E731
    print(f"\n2 processes vs 1: max |loss diff| {d(two[0]['losses'], one):.2e} over 10 steps; after resuming "
          f"the other's step-5 checkpoint: {d(one_resumed, one[5:]):.2e} (2 -> 1 process), "
          f"{d(two[0]['resumed_losses'], one[5:]):.2e} (1 -> 2); {time.perf_counter() - t0:.0f} s")


# ---- failures are bounded -------------------------------------------------------------------------------
def test_a_process_that_never_joins_fails_in_bounded_time():
    """Only one of two processes is started (once process 0, which hosts the coordination service; once
    process 1, which has nobody to talk to): each gives up after the 5 s init timeout with a clear error."""
    t0 = time.monotonic()
    port = free_port()
    alone = [subprocess.Popen([sys.executable, "-m", "tests.mesh_worker", "multihost", "-", "-"], cwd=REPO,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(2, JAXGPT_COORDINATOR=f"127.0.0.1:{port + i}", JAXGPT_NUM_PROCESSES="2",
                                       JAXGPT_PROCESS_ID=str(i), JAXGPT_INIT_TIMEOUT="5"))
             for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=90) for p in alone]
    finally:
        for p in alone:
            p.kill()
    elapsed = time.monotonic() - t0
    for i, (p, (_, err)) in enumerate(zip(alone, outs)):
        assert p.returncode == distributed.EXIT_DISTRIBUTED, err[-3000:]
        assert (f"process {i} of 2: the run did not come together through the coordinator 127.0.0.1:{port + i} "
                "within the init timeout (5 s): not every process joined") in err
    assert elapsed < 60
    print(f"\nnever-joined processes gave up after {elapsed:.1f} s (init timeout 5 s, start-up included)")


# both victims slow (46 s each on 2 cores); test_a_process_that_never_joins_fails_in_bounded_time covers the
# coordination service's error path in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_process_killed_mid_run_stops_the_other(tmp_path, victim):
    """SIGKILL one of two training processes after its 2nd step: the survivor ends with an error (JAX's
    coordination service: a missed heartbeat, or the lost coordinator) well within the bound."""
    np.save(tmp_path / "batches.npy", mesh_worker.batches(40))
    procs = start_processes(2, free_port(), "multihost", str(tmp_path / "batches.npy"), str(tmp_path / "ck"),
                            WORKER_STEP_SLEEP="0.5", JAXGPT_HEARTBEAT_TIMEOUT="5")
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + TIMEOUT
        for line in procs[victim].stdout:  # wait for the victim's second step
            if line.startswith("step 2 ") or time.monotonic() > deadline:
                break
        os.kill(procs[victim].pid, signal.SIGKILL)
        t_kill = time.monotonic()
        _, err = survivor.communicate(timeout=60)
        waited = time.monotonic() - t_kill
    finally:
        for p in procs:
            p.kill()
    assert survivor.returncode != 0
    assert "Terminating process because the JAX distributed service detected fatal errors" in err, err[-3000:]
    assert "another task died" in err
    assert waited < 45
    print(f"\nprocess {victim} killed: process {1 - victim} stopped {waited:.1f} s later "
          f"(exit status {survivor.returncode})")


# ---- the train CLI --------------------------------------------------------------------------------------
def _train_cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "jaxgpt.train", "--config", str(REPO / "configs/tiny-test.yaml"),
            f"--data_dir={REPO / 'data_cache' / 'shakespeare'}", f"--out_dir={out}", "--loader_mode=sequential",
            "--total_batch_tokens=null", "--checkpoint_interval=2", "--eval_interval=2", "--sample_interval=0",
            *args]


@pytest.mark.slow  # ~90 s at load 8 on 2 cores
def test_train_cli_two_processes_match_one_then_resume_in_one(tmp_path):
    """``python -m jaxgpt.train`` as 2 processes x 2 devices (batch_size 2 each, mesh data=2 x fsdp=2) and as
    1 process x 1 device (batch_size 4): the sequential loader gives process p windows p, p+2, ... of 2 x 32
    tokens, which side by side are the 1-process run's windows of 4 x 32, so both runs see the same global
    batches and log the same losses. Process 0 alone logs and writes files. Then the 2-process run's step-4
    checkpoint resumes in 1 process (batch 4 x 1 = 2 x 2: the loader keeps its place) and follows the
    1-process run (losses ~10.8: 1e-6 relative, a few float32 ulps)."""
    cache = tmp_path / "xla_cache"
    env = _env(2, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    port = free_port()
    two = [subprocess.Popen(_train_cmd(tmp_path / "two", "--batch_size=2", "--mesh=data=2,fsdp=2", "--max_steps=4"),
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, "JAXGPT_COORDINATOR": f"127.0.0.1:{port}", "JAXGPT_NUM_PROCESSES": "2",
                                 "JAXGPT_PROCESS_ID": str(i)}) for i in (0, 1)]
    one = subprocess.Popen(_train_cmd(tmp_path / "one", "--batch_size=4", "--max_steps=6"), cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "XLA_FLAGS": ""})
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in (*two, one)]
    finally:
        for p in (*two, one):
            p.kill()
    for p, (_, err) in zip((*two, one), outs):
        assert p.returncode == 0, err[-4000:]
    log0, log1 = outs[0][0], outs[1][0]
    assert "4 x cpu, 2 process(es)" in log0 and "mesh data=2 x fsdp=2 (4 devices, 2 processes)" in log0
    assert "jaxgpt.train" not in log1 and "sample" not in log1  # process 1 says nothing ...
    assert (tmp_path / "two" / "metrics.jsonl").read_text().count('"type": "train"') == 4  # ... writes nothing
    assert sorted(int(p.name) for p in (tmp_path / "two" / "checkpoints").iterdir()) == [2, 4]
    assert "--- sample 0 (step 4) ---" in (tmp_path / "two" / "samples.txt").read_text()
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 2} and summary["processes"] == 2
    from jaxgpt.train import read_metrics

    def losses(d):
        return {(r["type"], r["step"]): r["loss"] if r["type"] == "train" else r["val_loss"] for r in read_metrics(d)
                if r["type"] in ("train", "eval")}  # (a resume with another batch_size also logs a config_change)

    got, want = losses(tmp_path / "two"), losses(tmp_path / "one")
    keys = sorted(got)
    assert len(keys) == 7  # 4 train steps + evals at 0, 2, 4
    np.testing.assert_allclose([got[k] for k in keys], [want[k] for k in keys], rtol=1e-6, atol=0)

    # the 2-process checkpoint, resumed by 1 process with batch_size 4
    resumed = subprocess.run(_train_cmd(tmp_path / "two", "--batch_size=4", "--max_steps=6"), cwd=REPO, text=True,
                             capture_output=True, env={**env, "XLA_FLAGS": ""}, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step 4" in resumed.stdout
    assert "resuming a 2-process run with 1 process(es): the data loader keeps its place" in resumed.stdout
    got = losses(tmp_path / "two")
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], rtol=1e-6, atol=0)
    assert (tmp_path / "two" / "samples.txt").read_text().split("(step 6) ---")[1] == \
        (tmp_path / "one" / "samples.txt").read_text().split("(step 6) ---")[1]


def test_train_config_mesh_and_distributed_fields(tmp_path, capsys):
    from jaxgpt.mesh import MeshConfig
    from jaxgpt.train import TrainConfig, main, parse_args

    tiny = ["--config", str(REPO / "configs/tiny-test.yaml")]
    path, overrides, _ = parse_args(tiny + ["--mesh=data=2,fsdp=4", "--distributed.coordinator=10.0.0.1:1234",
                                            "--distributed.num_processes=2", "--distributed.process_id=1",
                                            "--distributed.init_timeout=30"])
    cfg = TrainConfig.load(path, overrides)
    assert cfg.mesh == MeshConfig(2, 4)
    assert (cfg.distributed.coordinator, cfg.distributed.num_processes, cfg.distributed.process_id,
            cfg.distributed.init_timeout) == ("10.0.0.1:1234", 2, 1, 30)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # round trip (config.yaml)
    assert TrainConfig.load(path, {"mesh.fsdp": 1}).mesh == MeshConfig(-1, 1)
    # errors name the field, before anything is written (this process has 1 device)
    out = tmp_path / "never"
    assert main(tiny + [f"--out_dir={out}", "--mesh=data=2"]) == 2
    assert "data * fsdp = 2 * 1 = 2 must equal the number of devices (1)" in capsys.readouterr().err
    assert main(tiny + [f"--out_dir={out}", "--mesh.fsdp=0"]) == 2
    assert "MeshConfig.fsdp = 0: must be an integer >= 1, or -1" in capsys.readouterr().err
    assert main(tiny + [f"--out_dir={out}", "--distributed.coordinator=nohost"]) == 2
    assert "expected host:port" in capsys.readouterr().err
    assert not out.exists()
