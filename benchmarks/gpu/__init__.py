"""The GPU benchmark tools, in one place (each runs on the CPU too, ``--dry``, at tiny shapes: the tests' path).

=====================  =====================================================================================
``bench``              jaxgpt against torch_ref (torch.compile, eager) on one GPU; the one-knob A/B (``ab``)
``worker``             one GPU train-step measurement in its own process (launched by ``bench``)
``profile``            a traced train step, summarised by where the time goes
``session``            the runbook: ``table``, ``ab``, ``profile``, ``parity``, ``char``, ``compare``, ``kernels``
``compare``            the default, the fast set and torch.compile measured in one budgeted command (issue 43)
``kernel_check``       the Pallas kernels compiled on the GPU against XLA's path, in one budgeted command
``budget``             a part's steps run within a time budget, every step recorded (measured or not)
``fastset``            the fast set's settings, named once
``pallas_tiles``       the tile configuration of every Pallas kernel a step or test built
``results``            results as measured: ``benchmarks/results/<device>-<date>/`` with ``run.json``; unpack
``report``             BENCHMARKS.md's GPU parts and docs/benchmark-history.md
``calibrate``          jaxgpt.compile's calibration of one device, fitted from its profiles
``carry``              packs what an offline GPU machine lacks (wheels, the end-to-end run's text)
``e2e_check``          a ``python -m jaxgpt.train`` run's speed against the harness's row
``scaling``            N GPUs projected from the one-GPU step (docs/scaling.md)
=====================  =====================================================================================

Imports go one way: these modules build on ``benchmarks.common``, ``benchmarks.impl`` and ``benchmarks.worker``,
which import nothing from here. Outside this package only ``benchmarks.train_step`` (``--device gpu`` hands over
to ``bench``) and ``benchmarks.report`` (BENCHMARKS.md's GPU section) import it. ``tests/test_benchmarks.py``
fails on any import cycle under ``benchmarks/``.
"""
