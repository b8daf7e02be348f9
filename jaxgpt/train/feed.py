"""The training batches, one step ahead: while the device runs step ``k``, the host reads step ``k+1``'s rows,
checks their token ids and places them on the devices (so no step waits for the disk or the host-to-device copy).

:attr:`BatchFeed.position` is the loader's position after the batches handed out so far, not after the one read
ahead: what a checkpoint must record for an exact resume.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jaxgpt.config import GPTConfig


class BatchFeed:
    """``next()`` -> the next step's ``(x, y)``, int32 ``(micro_steps, micro_batch, seq)`` on the devices."""

    def __init__(self, loader: Any, *, micro_steps: int, batch_size: int, seq_len: int, model_config: GPTConfig,
                 mesh: Mesh):
        self.loader, self.mesh, self.model_config = loader, mesh, model_config
        self.shape = (micro_steps, batch_size, seq_len)
        self.position: dict[str, Any] = loader.state_dict()
        self._ahead: tuple[Any, dict[str, Any]] | None = None

    def _read(self) -> tuple[Any, dict[str, Any]]:
        from jaxgpt import step as step_lib

        x, y = self.loader.next_batch()  # (ids checked against the vocabulary by the loader)
        x, y = x.reshape(self.shape), y.reshape(self.shape)
        step_lib.check_batch(x, y, self.model_config)
        return step_lib.place_batch(x, y, self.mesh), self.loader.state_dict()

    def next(self) -> tuple[Any, Any]:
        batch, self.position = self._ahead if self._ahead is not None else self._read()
        self._ahead = None
        return batch

    def read_ahead(self) -> None:
        """Read and place the next batch now (call it right after dispatching a step)."""
        if self._ahead is None:
            self._ahead = self._read()

    def seek(self, position: dict[str, Any]) -> None:
        """Continue from a saved :attr:`position` (dropping any batch read ahead)."""
        self.loader.load_state_dict(position)
        self._ahead, self.position = None, self.loader.state_dict()

    def skip(self, batches: int) -> None:
        """Advance past ``batches`` global batches, exactly as training on them would (no step runs)."""
        self._ahead = None
        self.loader.skip(batches)
        self.position = self.loader.state_dict()
