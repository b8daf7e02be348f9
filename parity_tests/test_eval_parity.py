"""HellaSwag scoring: jaxgpt.eval.hellaswag against torch_ref (build-nanogpt's evaluate) and
transformers.GPT2LMHeadModel on the same weights: per item, the four endings' summed and mean losses agree to
relative 1e-5 (fp32, matmul precision "highest") and the chosen endings are identical. The items are
HellaSwag-format jsonl the test writes itself (no copy of the dataset in the repository)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jaxgpt.eval import hellaswag
from jaxgpt.precision import Policy
from jaxgpt.tokenizer import encode
from jaxgpt.weights import from_hf
from parity_tests.tolerances import EVAL_LOSS_REL
from torch_ref.eval import ending_losses
from torch_ref.load import from_hf as torch_from_hf

ITEMS = [  # (context, four endings, label): realistic English, lengths from 5 to ~45 tokens
    ("A man is standing on a ladder next to a house. He", ["reaches up and cleans leaves out of the gutter.",
     "jumps into a swimming pool full of oranges.", "reads the newspaper to the ladder.",
     "begins to paint the window frames a dark shade of green, working slowly from left to right."], 0),
    ("The chef cracks two eggs into a steel bowl and", ["whisks them.", "throws the bowl through the window.",
     "sings to the microwave while the toaster dances.", ("places the shells in the compost bin before adding a "
     "pinch of salt and beating the mixture until it turns pale and frothy.")], 3),
    ("A woman in a red jacket walks her dog along the beach at sunset. The dog", ["runs into the waves and barks.",
     "flies over the ocean.", "files a tax return.", "rolls in the sand."], 0),
    ("Two kids are playing soccer in a park while their parents watch from a bench. One of them", [
     "kicks the ball toward the goal, and the other dives to stop it.", "eats the ball.", "becomes a tree.",
     "calls the president to discuss the price of tea in distant countries."], 0),
    ("How to make a cup of tea. Boil fresh water in a kettle. Place a tea bag in a mug and", [
     "pour the hot water over it, letting it steep for three to five minutes.", "freeze the mug overnight.",
     "plant the tea bag in the garden.", "mail it."], 0),
    ("The mechanic lifts the hood of the old pickup truck, wipes his hands on a rag, and", [
     "checks the oil level with the dipstick.", "takes a nap inside the engine.", "sells the truck to a pigeon.",
     "starts knitting a long scarf for the radiator."], 0),
]


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    path = tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps({"ind": i, "ctx": c, "endings": e, "label": label, "split": "val",
                                        "activity_label": "test"}) + "\n" for i, (c, e, label) in enumerate(ITEMS)))
    return hellaswag.load(path)


def reference_scores(model, item, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    rows, ctx_len, _ = hellaswag.render(item, encode, block_size)
    tokens, mask = hellaswag.pad(rows, [ctx_len] * 4, max(map(len, rows)), 4)
    total, mean = ending_losses(model, torch.from_numpy(tokens).long(), torch.from_numpy(mask))
    return total.double().numpy(), mean.double().numpy()


class HFAdapter(torch.nn.Module):
    """transformers' GPT2LMHeadModel behind torch_ref's forward signature (logits, loss)."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, idx):
        return self.hf(idx).logits.float(), None


@pytest.mark.parametrize("name", ["tiny", pytest.param("gpt2", marks=pytest.mark.slow)])  # gpt2 shapes: ~30 s
def test_hellaswag_losses_match_torch_ref_and_transformers(name, items, hf_checkpoint, parity_report):
    directory, hf = hf_checkpoint(name, wte_scale=3.0)  # a peaked init: clear favourites among the endings
    jax_model = from_hf(directory, policy=Policy.fp32())
    ref = torch_from_hf(directory, attention="math")
    results = hellaswag.Scorer(jax_model, batch_size=4).score(items)  # 2 batches: padding rows too
    worst = 0.0
    for item, r in zip(items, results):
        for other in (ref, HFAdapter(hf)):
            total, mean = reference_scores(other, item, jax_model.config.block_size)
            for ours, theirs in ((r["sum_losses"], total), (r["mean_losses"], mean)):
                rel = np.abs(np.asarray(ours) - theirs) / np.abs(theirs)
                worst = max(worst, float(rel.max()))
                assert rel.max() <= EVAL_LOSS_REL, (item.ind, ours, theirs)
            assert r["pred"] == int(np.argmin(total)) and r["pred_norm"] == int(np.argmin(mean))
        assert r["n_tokens"] == [len(encode(" " + e)) for e in item.endings]
    parity_report(f"hellaswag_{name}", max_rel_ending_loss=worst)
