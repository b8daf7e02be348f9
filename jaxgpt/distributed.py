"""Multi-process (multi-host) start-up on JAX's own distributed runtime.

Every process of a multi-process run calls :func:`initialize_from_env` before anything touches a JAX device
(``python -m jaxgpt.train`` does it first thing). It reads, in this order:

1. explicit settings: :class:`DistributedConfig` fields (``TrainConfig.distributed``, i.e. the CLI flags
   ``--distributed.coordinator=HOST:PORT --distributed.num_processes=N --distributed.process_id=I``), else
   the environment variables ``JAXGPT_COORDINATOR`` (``host:port`` of process 0; the port must be free there),
   ``JAXGPT_NUM_PROCESSES`` and ``JAXGPT_PROCESS_ID`` (and optionally ``JAXGPT_LOCAL_DEVICE_IDS``, e.g. ``0,1``:
   the GPUs this process drives when several processes share a host). All three or none.
2. otherwise a cluster JAX itself recognises (``jax._src.clusters`` in JAX 0.10.2: SLURM, Open MPI /
   ``mpirun``, Kubernetes JobSet, Cloud TPU; ``Mpi4pyCluster`` only when asked for). Under SLURM (``srun``)
   JAX reads ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID`` and
   ``SLURM_LOCALID``: the coordinator is the first node of the step, on port ``61440 + SLURM_JOB_ID % 4096``
   (``JAX_COORDINATOR_PORT`` overrides it), and -- unless local device ids are given -- each task drives
   exactly one GPU, number ``SLURM_LOCALID``: launch one task per GPU (``--ntasks-per-node=<GPUs>``, every
   GPU visible to every task), or one task per node with ``JAXGPT_LOCAL_DEVICE_IDS=0,1,...,7``. A step
   with one task is a single-process run.
3. otherwise: a single process, nothing to initialise.

Failure is bounded, never a hang:

* ``init_timeout`` (``JAXGPT_INIT_TIMEOUT``, default 300 s): when not every process has joined by then
  (one was never started, the coordinator is unreachable, a port is taken), each waiting process prints
  ``error: jaxgpt.distributed: process I of N: the run did not come together ...`` and exits with status 4
  (:data:`EXIT_DISTRIBUTED`); settings that fail at once raise :class:`DistributedError`;
* ``heartbeat_timeout`` (``JAXGPT_HEARTBEAT_TIMEOUT``, default 60 s): when a process dies mid-run, JAX's
  coordination service notices (at once when process 0, which hosts it, dies; after the missed heartbeats
  otherwise) and every survivor ends with JAX's fatal error "Terminating process because the JAX
  distributed service detected fatal errors. This most likely indicates that another task died" (SIGABRT,
  exit status 134 / -6). JAX runs that from a C++ thread; no Python handler can soften it;
* ``shutdown_timeout`` (``JAXGPT_SHUTDOWN_TIMEOUT``, default 60 s): the exit barrier waits at most that long.

On CPU the cross-process collectives are gloo's (TCP); :func:`initialize_from_env` selects them
(``jax_cpu_collectives_implementation = "gloo"``, JAX 0.10.2's default too) before the backends start.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any

from jaxgpt.config import ConfigError

ENV_COORDINATOR = "JAXGPT_COORDINATOR"
ENV_NUM_PROCESSES = "JAXGPT_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXGPT_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXGPT_LOCAL_DEVICE_IDS"
ENV_INIT_TIMEOUT = "JAXGPT_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "JAXGPT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "JAXGPT_SHUTDOWN_TIMEOUT"


class DistributedError(RuntimeError):
    """Multi-process start-up failed (bad settings, an unreachable coordinator, a peer that never joined)."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (every field None: from the environment, see the module
    docstring). Timeouts in seconds; None: from ``JAXGPT_*_TIMEOUT``, else the defaults."""

    coordinator: str | None = None  # "host:port" of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # the accelerators this process drives (None: all)
    init_timeout: int | None = None  # default 300
    heartbeat_timeout: int | None = None  # default 60
    shutdown_timeout: int | None = None  # default 60

    def __post_init__(self) -> None:
        n = type(self).__name__
        if self.coordinator is not None and not _ADDRESS.fullmatch(str(self.coordinator)):
            raise ConfigError(f"{n}.coordinator = {self.coordinator!r}: expected host:port (e.g. 10.0.0.1:12355)")
        for field, low in (("num_processes", 1), ("process_id", 0), ("init_timeout", 1),
                           ("heartbeat_timeout", 1), ("shutdown_timeout", 1)):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ConfigError(f"{n}.{field} = {v!r}: must be null or an integer >= {low}")
        if self.local_device_ids is not None and not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.local_device_ids):
            raise ConfigError(f"{n}.local_device_ids = {self.local_device_ids!r}: must be null or a list of "
                              "integers >= 0")
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ConfigError(f"{n}.process_id = {self.process_id}: must be < num_processes ({self.num_processes})")


_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|[\w.\-]+):\d{1,5}")
EXIT_DISTRIBUTED = 4  # exit status of a process that gave up joining (python -m jaxgpt.train uses it too)
INIT_TIMEOUT_MARGIN_S = 30
DEFAULT_TIMEOUTS = {"init_timeout": 300, "heartbeat_timeout": 60, "shutdown_timeout": 60}


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` decided: ``how`` is ``"single"``, ``"explicit"`` or a JAX cluster name."""

    how: str
    coordinator: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None
    init_timeout: int
    heartbeat_timeout: int
    shutdown_timeout: int


def _env_int(environ: Mapping[str, str], name: str, low: int) -> int | None:
    text = environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(f"${name} = {text!r}: expected an integer >= {low}") from None
    if v < low:
        raise ConfigError(f"${name} = {text!r}: expected an integer >= {low}")
    return v


def _detect_cluster() -> Any:
    """The JAX ClusterEnv class that recognises this environment (auto-detectable ones only), or None."""
    from jax._src import clusters

    return next((c for c in clusters.ClusterEnv._cluster_types
                 if not c.opt_in_only_method and c.is_env_present()), None)


def resolve(cfg: DistributedConfig | None = None, environ: Mapping[str, str] | None = None) -> Resolved:
    """Decide how this process starts (see the module docstring), without starting anything."""
    cfg = cfg or DistributedConfig()
    env = os.environ if environ is None else environ
    timeouts = {}
    for field, var in (("init_timeout", ENV_INIT_TIMEOUT), ("heartbeat_timeout", ENV_HEARTBEAT_TIMEOUT),
                       ("shutdown_timeout", ENV_SHUTDOWN_TIMEOUT)):
        v = getattr(cfg, field)
        timeouts[field] = v if v is not None else (_env_int(env, var, 1) or DEFAULT_TIMEOUTS[field])

    coordinator = cfg.coordinator if cfg.coordinator is not None else (env.get(ENV_COORDINATOR) or None)
    num = cfg.num_processes if cfg.num_processes is not None else _env_int(env, ENV_NUM_PROCESSES, 1)
    pid = cfg.process_id if cfg.process_id is not None else _env_int(env, ENV_PROCESS_ID, 0)
    ids = cfg.local_device_ids
    if ids is None and env.get(ENV_LOCAL_DEVICE_IDS, "").strip():
        text = env[ENV_LOCAL_DEVICE_IDS]
        try:
            ids = tuple(int(t) for t in text.split(","))
        except ValueError:
            raise ConfigError(f"${ENV_LOCAL_DEVICE_IDS} = {text!r}: expected comma-separated device ids, "
                              "e.g. 0,1") from None
    given = {"coordinator": coordinator, "num_processes": num, "process_id": pid}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            names = {"coordinator": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
                     "process_id": ENV_PROCESS_ID}
            raise ConfigError(
                f"multi-process settings are incomplete: {', '.join(f'{k}={v!r}' for k, v in given.items())}; "
                f"set all three (missing: {', '.join(f'{k} (${names[k]})' for k in missing)})")
        DistributedConfig(coordinator=coordinator, num_processes=num, process_id=pid)  # validates
        if num == 1:
            return Resolved("single", None, 1, 0, ids, **timeouts)
        return Resolved("explicit", coordinator, num, pid, ids, **timeouts)
    cluster = _detect_cluster() if environ is None else None  # JAX's cluster classes read os.environ
    if cluster is not None and cluster.get_process_count() > 1:
        try:  # for the log line only: jax.distributed.initialize asks the cluster again
            coordinator = cluster.get_coordinator_address(timeout_secs=timeouts["init_timeout"],
                                                          override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
        except Exception:  # some clusters look it up over the network
            coordinator = None
        return Resolved(cluster.name, coordinator, cluster.get_process_count(), cluster.get_process_id(), ids,
                        **timeouts)
    return Resolved("single", None, 1, 0, ids, **timeouts)


def initialize_from_env(cfg: DistributedConfig | None = None, *, verbose: bool = True) -> Resolved:
    """Join the multi-process run this process belongs to (no-op for a single process; idempotent).

    Must run before JAX's backends start (before ``jax.devices()``, any array, any jit)."""
    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    r = resolve(cfg)
    if r.how == "single":
        return r
    if jax_distributed.global_state.client is not None:  # already joined (e.g. a test calling twice)
        return r
    if xla_bridge.backends_are_initialized():
        raise DistributedError(
            "initialize_from_env() must run before JAX starts its backends (before jax.devices(), creating an "
            "array or calling a jitted function); call it first thing in the process")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(heartbeat_timeout_seconds=r.heartbeat_timeout,
                                  shutdown_timeout_seconds=r.shutdown_timeout)
    if r.local_device_ids is not None:
        kwargs["local_device_ids"] = list(r.local_device_ids)
    if r.how == "explicit":
        kwargs.update(coordinator_address=r.coordinator, num_processes=r.num_processes, process_id=r.process_id)
        where = f"coordinator {r.coordinator}"
    else:
        kwargs.update(cluster_detection_method=r.how)
        where = f"{r.how} cluster" + (f" (coordinator {r.coordinator})" if r.coordinator else "")
    if verbose:
        print(f"jaxgpt.distributed: process {r.process_id} of {r.num_processes} joining ({where}, "
              f"init timeout {r.init_timeout} s, heartbeat timeout {r.heartbeat_timeout} s)", flush=True)
    hint = (f"Check that all {r.num_processes} processes were started with the same coordinator address and "
            f"distinct process ids in [0, {r.num_processes}), that process 0 is running, and that its port is "
            "reachable (firewall, a port already in use)")
    # JAX's own init timeout ends the process with a C++ fatal error (SIGABRT, "DEADLINE_EXCEEDED ...
    # RegisterTask"); this watchdog fires first and says what happened. connect() releases the GIL.
    kwargs["initialization_timeout"] = r.init_timeout + INIT_TIMEOUT_MARGIN_S

    def give_up() -> None:
        print(f"error: jaxgpt.distributed: process {r.process_id} of {r.num_processes}: the run did not come "
              f"together through the {where} within the init timeout ({r.init_timeout} s): not every process "
              f"joined. {hint}", file=sys.stderr, flush=True)
        os._exit(EXIT_DISTRIBUTED)

    watchdog = threading.Timer(r.init_timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:  # XlaRuntimeError (UNAVAILABLE, ...), ValueError, RuntimeError
        raise DistributedError(
            f"process {r.process_id} of {r.num_processes} could not join the run through the {where}: "
            f"{type(e).__name__}: {_first_line(e)}. {hint}") from e
    finally:
        watchdog.cancel()
    return r


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else "(no message)"


def is_multiprocess() -> bool:
    import jax

    return jax.process_count() > 1


def shutdown() -> None:
    """Leave the run (waits at the exit barrier for at most ``shutdown_timeout``); never raises."""
    import jax
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is None:
        return
    try:
        jax.distributed.shutdown()
    except Exception as e:  # a peer already gone: nothing left to coordinate
        print(f"jaxgpt.distributed: shutdown: {type(e).__name__}: {_first_line(e)}", flush=True)
