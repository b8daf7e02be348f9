"""Weight round trips, bit for bit: Hugging Face -> jaxgpt -> Hugging Face (``save_hf``, re-read by
``transformers``), and jaxgpt <-> torch_ref state dicts; and the padded vocabulary, which must change
nothing a user can observe (logits, loss, exported checkpoint)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import CHECKPOINTS, jax_logits_and_loss, on_device, random_tokens
from jaxgpt.config import GPTConfig
from jaxgpt.precision import Policy
from jaxgpt.weights import from_hf, from_torch_state_dict, params_to_ref, save_hf, to_torch_state_dict
from tolerances import LOSS_FP32_REL, fp32_logits_pairwise
from torch_ref.model import GPT as RefGPT

PADDED = 50304  # 64 * 786: nanoGPT's padded GPT-2 vocabulary

ROUND_TRIP = [pytest.param(n, marks=pytest.mark.slow) if n == "gpt2" else n for n in CHECKPOINTS]


def _hf_state(directory) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(directory).state_dict()


def _assert_state_dicts_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), f"{k}: max |diff| {(got[k] - want[k]).abs().max():g}"


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", ROUND_TRIP)
def test_hf_jaxgpt_hf_round_trip_is_bit_exact(name, padded, hf_checkpoint, tmp_path):
    directory, _ = hf_checkpoint(name)
    model = from_hf(directory, padded_vocab_size=PADDED if padded else None)
    out = save_hf(model, tmp_path / "export")

    # the export is a plain GPT-2: real vocabulary only, whatever the padding in memory
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 50257 and config["model_type"] == "gpt2"
    from safetensors.numpy import load_file

    stored = load_file(str(out / "model.safetensors"))
    assert stored["transformer.wte.weight"].shape == (50257, model.config.n_embd)

    # every tensor transformers reads back (including the tied lm_head) equals the original, bit for bit
    _assert_state_dicts_identical(_hf_state(out), _hf_state(directory))


@pytest.mark.parametrize("config", [
    GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    GPTConfig(n_layer=3, n_head=3, n_embd=48, block_size=37, padded_vocab_size=PADDED),
    GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=10, vocab_size=50, padded_vocab_size=64, bias=False),
], ids=["tiny", "odd-padded", "nobias-padded"])
def test_jaxgpt_torch_ref_round_trip_is_bit_exact(config):
    """torch_ref -> jaxgpt -> torch_ref -> jaxgpt: every tensor bit for bit, names and shapes strict."""
    original = RefGPT(config, seed=0).state_dict()
    model = from_torch_state_dict(original, config)
    sd = to_torch_state_dict(model)
    _assert_state_dicts_identical(sd, original)
    ref = RefGPT(config, seed=1)  # different init: every value must come from the state dict
    ref.load_state_dict(sd, strict=True)  # same names, same shapes, nothing missing or extra
    _assert_state_dicts_identical(ref.state_dict(), original)
    want, got = params_to_ref(model), params_to_ref(from_torch_state_dict(ref.state_dict(), config))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    if config.padded_vocab_size:  # the padded rows travel as zeros
        assert not want["wte.weight"][config.vocab_size:].any()


@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_padded_vocab_changes_nothing(name, device, hf_checkpoint, parity_report):
    """A padded vocabulary adds zero rows to wte that the logits and the loss never see: each logit is the same
    C-long dot product h . wte[v] whatever the number of rows, and the padded columns are sliced off (or masked
    in the fused cross-entropy) before the softmax. So the results agree to fp32 rounding, not necessarily
    bitwise: torch_ref's are bitwise equal (measured 0), but XLA:CPU picks a different GEMM blocking for
    N = 50304 than for N = 50257, which reorders the C-term sums (measured max |diff| ~3.6e-7 on O(0.5) logits,
    i.e. ~3 ulps; loss diff 0). Asserted: bitwise for torch_ref; the fp32 summation-order tolerances
    (fp32_logits_pairwise, LOSS_FP32_REL) for jaxgpt."""
    import torch_ref.load

    directory, _ = hf_checkpoint(name)
    _, seq = CHECKPOINTS[name]
    tokens = random_tokens(2, seq, seed=2)
    results = {}
    with on_device(device):
        for padded in (None, PADDED):
            model = from_hf(directory, policy=Policy.fp32(matmul_precision="highest"), padded_vocab_size=padded)
            results[padded] = jax_logits_and_loss(model, tokens)
    (a, la), (b, lb) = results[None], results[PADDED]
    assert a.shape == b.shape == (2, seq, 50257)

    t = torch.from_numpy(tokens).to(device)
    torch_out = {}
    for padded in (None, PADDED):
        ref = torch_ref.load.from_hf(directory, padded_vocab_size=padded).to(device)
        assert ref.wte.weight.shape[0] == (padded or 50257)
        with torch.no_grad():
            torch_out[padded] = (ref(t)[0].cpu().numpy(), float(ref(t[:, :-1], t[:, 1:])[1]))
    (ta, tla), (tb, tlb) = torch_out[None], torch_out[PADDED]

    parity_report(f"padded/{name}/{device}", jax_logits_max_abs=np.abs(a - b).max(), jax_loss_abs=abs(la - lb),
                  torch_ref_logits_max_abs=np.abs(ta - tb).max(), torch_ref_loss_abs=abs(tla - tlb))
    assert np.abs(a - b).max() <= fp32_logits_pairwise(float(np.abs(a).max()), n_layer=CHECKPOINTS[name][0]["n_layer"])
    assert abs(la - lb) <= LOSS_FP32_REL * abs(la)
    np.testing.assert_array_equal(ta, tb)
    assert tla == tlb
