"""What a run measures between steps: the validation loss, HellaSwag accuracy and text samples of the current
params (mixed into :class:`jaxgpt.train.run.Run`; every method reads the run's state and writes its logs)."""

from __future__ import annotations

from typing import Any


def on_one_device(tree: Any) -> Any:
    """``tree`` (sharded over a mesh, maybe over several processes) whole on this process's first device:
    what generation runs on. With several processes every process must call it (an all-gather)."""
    import jax

    device = jax.local_devices()[0]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)  # numpy, whole, on every process
    return jax.device_put(tree, device)


class InLoopEvals:
    """``evaluate``, ``score_hellaswag`` and ``sample`` of a :class:`~jaxgpt.train.run.Run`."""

    def evaluate(self) -> float:
        """Mean loss of the same first ``eval_steps`` validation batches every time."""
        import numpy as np

        self.val_loader.load_state_dict(self.val_state)
        losses = []
        for _ in range(self.n_eval):
            x, y = self.val_loader.next_batch()  # (ids checked against the vocabulary by the loader)
            losses.append(self.eval_step(self.state.params, x, y))
        return float(np.mean([float(v) for v in losses]))

    def score_hellaswag(self, step: int) -> None:
        """HellaSwag accuracy of the current params (build-nanogpt's scoring), logged to metrics.jsonl."""
        from flax import nnx

        from jaxgpt.eval import hellaswag

        params = on_one_device(self.state.params)  # every process takes part (a collective with several)
        if not self.is_main:
            return
        if self.hellaswag_scorer is None:  # compiled once, reused at every interval
            self.hellaswag_scorer = hellaswag.Scorer(nnx.merge(self.graphdef, params))
        r = self.hellaswag_scorer.evaluate(self.hellaswag_items, params=params)
        self.metrics.write({"type": "hellaswag", "step": step, "acc": r["acc"], "acc_norm": r["acc_norm"],
                            "n": r["n"], "seconds": r["seconds"]})
        self.say(f"step {step}: HellaSwag acc_norm {r['acc_norm']:.4f} (acc {r['acc']:.4f}, {r['n']} items)")

    def sample(self, step: int) -> None:
        """``sample_num`` samples from the current params, appended to samples.txt and printed."""
        from flax import nnx

        from jaxgpt.generate import generate_text

        cfg = self.cfg
        params = on_one_device(self.state.params)  # every process takes part (a collective with several)
        if not self.is_main:
            return
        texts = generate_text(nnx.merge(self.graphdef, params), cfg.sample_prompt, max_new_tokens=cfg.sample_len,
                              temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                              seed=(cfg.seed + step) % 2**32, num_samples=cfg.sample_num, tokenizer=self.tokenizer)
        block = "".join(f"--- sample {i} (step {step}) ---\n{t}\n" for i, t in enumerate(texts))
        with open(self.run_dir / "samples.txt", "a") as f:
            f.write(block)
        self.metrics.samples(step, texts)
        self.say(block.rstrip())
