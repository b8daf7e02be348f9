"""Train GPT-2: ``python -m jaxgpt.train [--config configs/NAME.yaml] [--field=value ...]``.

Without ``--config`` the default preset ``configs/shakespeare-char-cpu.yaml`` (nanoGPT's first run, on a CPU) is
used. Any field of :class:`TrainConfig` can be overridden on the command line, nested ones with dots, values parsed
as YAML scalars::

    python -m jaxgpt.train --config configs/gpt2-124m.yaml --optim.lr=3e-4 --max_steps=100 --model.n_layer=2

Other flags: ``--print-config`` (print the resolved config as YAML and exit), ``-h/--help``.

The run directory (``out_dir``) gets ``config.yaml``, ``metrics.jsonl`` (one JSON record per logged step and
per evaluation), ``samples.txt``, ``loss.png``, TensorBoard events under ``tb/`` (when tensorboardX or
torch's tensorboard is installed), orbax checkpoints under ``checkpoints/`` (see :mod:`jaxgpt.checkpoint`) and,
with ``--wandb``, a Weights & Biases run (``wandb.json`` names it, W&B's files under ``wandb/``).
With ``resume: auto`` (the default) a run directory that holds a checkpoint is resumed from it: the
continued run repeats the uninterrupted one's losses bit for bit on CPU.

Several devices and hosts: ``--mesh.data=D --mesh.fsdp=F`` (or ``--mesh=data=2,fsdp=4``) lays the devices out
as a ``('data', 'fsdp')`` mesh (default: all devices data parallel; see :mod:`jaxgpt.mesh`); a multi-process
run starts every process with ``JAXGPT_COORDINATOR`` / ``JAXGPT_NUM_PROCESSES`` / ``JAXGPT_PROCESS_ID`` (or
``--distributed.*``, or under SLURM's ``srun``; see :mod:`jaxgpt.distributed` and docs/scaling.md). Each
process reads its own part of the data; process 0 alone writes the run directory's files; all processes
save the (sharded) checkpoints together.

Exit codes: 0 done, 2 bad configuration, command line, data or checkpoint (a damaged step asked for by
``resume_step``, settings a checkpoint cannot take), 3 training diverged (a non-finite loss or gradient norm, or a
spike over the guard's factor; the last good checkpoint is kept), 4 the processes of a multi-process run did
not all join, 130 interrupted.

Modules: :mod:`~jaxgpt.train.config` (TrainConfig), :mod:`~jaxgpt.train.run` (the run's phases),
:mod:`~jaxgpt.train.resume` (continuing from a checkpoint), :mod:`~jaxgpt.train.changes` (what a resume may
change), :mod:`~jaxgpt.train.safety` (checked checkpoints, rollback), :mod:`~jaxgpt.train.guard` (divergence
rules), :mod:`~jaxgpt.train.evals` (validation, HellaSwag, samples), :mod:`~jaxgpt.train.feed` (batches one step
ahead), :mod:`~jaxgpt.train.metrics` (metrics.jsonl, loss.png, throughput), :mod:`~jaxgpt.train.wandb_log`
(``--wandb``), :mod:`~jaxgpt.train.cli` (the command).
"""

from jaxgpt.train.cli import (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_NONFINITE, MALLOC_TUNABLES, UsageError, main,
                              parse_args, usage)
from jaxgpt.train.config import DEFAULT_CONFIG, TrainConfig, set_dotted
from jaxgpt.train.metrics import (MetricsLog, count_params, device_peak_flops, flops_per_step, plot_losses,
                                  read_metrics)
from jaxgpt.train.run import NonFiniteLoss, build_model, train

__all__ = [
    "EXIT_CONFIG", "EXIT_INTERRUPTED", "EXIT_NONFINITE", "MALLOC_TUNABLES", "UsageError", "main", "parse_args",
    "usage", "DEFAULT_CONFIG", "TrainConfig", "set_dotted", "MetricsLog", "count_params", "device_peak_flops",
    "flops_per_step", "plot_losses", "read_metrics", "NonFiniteLoss", "build_model", "train",
]
