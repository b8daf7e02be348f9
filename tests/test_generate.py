"""jaxgpt.generate: shapes, determinism, sampling semantics, block_size cropping, errors, text and CLI.

Compilation dominates the run time on CPU (one compile per shape and sampling mode), so the tests share a
few module-scoped generations; everything uses one tiny model whose padded vocabulary rows are made huge.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxgpt.config import GPTConfig
from jaxgpt.generate import GenerateError, generate, generate_text, main, trace_count
from jaxgpt.model import GPT, TokenError
from jaxgpt.precision import Policy

V, VP, BS = 97, 128, 16  # real vocab, padded vocab rows, block_size
CFG = GPTConfig(block_size=BS, vocab_size=V, padded_vocab_size=VP, n_layer=2, n_head=2, n_embd=32)
PROMPT = [3, 14, 15, 92, 65]
N_NEW = 30  # 5 + 30 > 16: the cached regime, then the cropped recompute regime
PADDED_ROW_VALUE = 50.0


def sharpened_model(config: GPTConfig, seed: int, *, emb_std: float = 0.3, pos_std: float = 0.3) -> GPT:
    """A GPT whose parameters are drawn in numpy (fast: no eager JAX ops): O(1) activations and peaked
    logits instead of GPT-2's tiny init (near-uniform next-token distributions), so that positions and
    context visibly matter and greedy margins dwarf float rounding."""
    abstract = nnx.eval_shape(lambda: GPT(config, policy=Policy.fp32(), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(state):
        shape, name = var.get_value().shape, path[-1]
        if name == "kernel":
            v = rng.normal(0.0, 2.0 / np.sqrt(shape[0]), shape)
        elif name == "embedding":
            v = rng.normal(0.0, pos_std if path[0] == "wpe" else emb_std, shape)
        elif name == "scale":
            v = 1.0 + rng.normal(0.0, 0.1, shape)
        else:  # bias
            v = rng.normal(0.0, 0.1, shape)
        var.set_value(jnp.asarray(v, jnp.float32))
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def model() -> GPT:
    m = sharpened_model(CFG, seed=2)
    # padded rows +-PADDED_ROW_VALUE * e_i: whatever the hidden state, some padded column gets a logit of
    # PADDED_ROW_VALUE * max_i |h_i|, far above every real one; they must still never be produced
    rows = np.zeros((VP - V, CFG.n_embd), np.float32)
    for j in range(VP - V):
        rows[j, j // 2] = PADDED_ROW_VALUE * (1 if j % 2 == 0 else -1)
    emb = m.wte.embedding.get_value()
    m.wte.embedding.set_value(emb.at[V:].set(rows))
    return m


@pytest.fixture(scope="module")
def runs(model):
    """The shared generations, (B=2, T=5, N=30): sampled and greedy, cached and uncached; top_k=1."""
    sampled = dict(temperature=1.0, top_k=None, seed=7, num_samples=2)
    greedy = dict(temperature=0.0, top_k=None, num_samples=2)  # top_k is ignored when greedy
    return {
        "sampled": generate(model, PROMPT, max_new_tokens=N_NEW, **sampled),
        "sampled_uncached": generate(model, PROMPT, max_new_tokens=N_NEW, use_cache=False, **sampled),
        "greedy": generate(model, PROMPT, max_new_tokens=N_NEW, **greedy),
        "greedy_uncached": generate(model, PROMPT, max_new_tokens=N_NEW, use_cache=False, **greedy),
        # (uncached: it compiles faster, and it equals the cached path, as checked below)
        "top1": generate(model, PROMPT, max_new_tokens=N_NEW, temperature=1.3, top_k=1, seed=5,
                         num_samples=2, use_cache=False),
    }


@jax.jit
def _hidden(graphdef, state, idx):
    return nnx.merge(graphdef, state).hidden(idx)[0]


def hidden(model: GPT, idx) -> np.ndarray:
    """Final hidden states of a plain forward pass (jitted: eager dispatch compiles every op per shape)."""
    return np.asarray(_hidden(*nnx.split(model), jnp.asarray(idx)))


def greedy_next(model: GPT, out: np.ndarray, ns) -> np.ndarray:
    """nanoGPT's greedy step for each n in ``ns``: argmax of the logits at the last of the last
    block_size tokens of ``out[0, :n]``, every context of the same length (batched in one forward)."""
    ctx = np.stack([out[0, max(0, n - BS):n] for n in ns])
    h = hidden(model, ctx)[:, -1]
    return (h @ np.asarray(model.wte.embedding.get_value())[:V].T).argmax(-1)


# ---- shapes and the returned prompt ---------------------------------------------------------------------------
def test_shapes_and_prompt(runs, model):
    for out in runs.values():
        assert out.shape == (2, len(PROMPT) + N_NEW)
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out[:, : len(PROMPT)], np.tile(PROMPT, (2, 1)))
    out = generate(model, np.array([PROMPT, PROMPT[::-1]]), max_new_tokens=N_NEW, temperature=0.0,
                   top_k=None)
    assert out.shape == (2, len(PROMPT) + N_NEW)  # a (batch, seq) prompt, one sample per row
    np.testing.assert_array_equal(out[0], runs["greedy"][0])


def test_zero_new_tokens_returns_the_prompt(model):
    out = generate(model, PROMPT, max_new_tokens=0, num_samples=3)
    np.testing.assert_array_equal(out, np.tile(PROMPT, (3, 1)))


# ---- determinism, seeds, compile cache --------------------------------------------------------------------------
def test_same_seed_same_tokens_and_compiled_once(runs, model):
    before = trace_count()
    again = generate(model, PROMPT, max_new_tokens=N_NEW, temperature=1.0, top_k=None, seed=7, num_samples=2)
    np.testing.assert_array_equal(again, runs["sampled"])
    other = generate(model, PROMPT, max_new_tokens=N_NEW, temperature=0.7, top_k=None, seed=8, num_samples=2)
    greedy = generate(model, PROMPT, max_new_tokens=N_NEW, temperature=0.0, top_k=None, num_samples=2)
    assert trace_count() == before  # same shapes and top_k: seed and temperature (even 0) don't recompile
    np.testing.assert_array_equal(greedy, runs["greedy"])
    assert not np.array_equal(other, runs["sampled"])
    # the two samples of one call are independent draws
    assert not np.array_equal(runs["sampled"][0], runs["sampled"][1])


def test_temperature_zero_is_greedy(runs, model):
    out = runs["greedy"]
    np.testing.assert_array_equal(out[0], out[1])
    T0 = len(PROMPT)
    # against direct forward passes: the first token, then every token from a full window on
    # (the window's edge, then the cropped regime with positions restarting at 0)
    assert greedy_next(model, out, [T0])[0] == out[0, T0]
    ns = list(range(BS, T0 + N_NEW))
    np.testing.assert_array_equal(greedy_next(model, out, ns), out[0, ns])
    assert len(set(out[0, T0:].tolist())) > 3  # the sharpened model doesn't just repeat one token


def test_top_k_one_is_greedy(runs):
    np.testing.assert_array_equal(runs["top1"], runs["greedy"])


def test_padded_vocab_is_never_sampled(runs, model):
    # the huge padded rows would win the argmax if the lm_head kept their columns
    h = hidden(model, runs["greedy"][:, :BS])
    full = h @ np.asarray(model.wte.embedding.get_value()).T
    assert (full.argmax(-1) >= V).all()
    for out in runs.values():
        assert out.max() < V and out.min() >= 0
    many = generate(model, PROMPT, max_new_tokens=N_NEW, temperature=1.0, top_k=None, seed=99, num_samples=2)
    assert many.max() < V


def test_kth_largest_matches_lax_top_k():
    """The top-k threshold (bisection on CPU) is lax.top_k's k-th value, ties, zeros, infs and denormals included."""
    from jaxgpt.generate.sampling import _kth_largest_bisect, kth_largest

    rng = np.random.default_rng(0)
    x = (rng.normal(size=(60, 37)) * 10).astype(np.float32)
    x[:, 3] = x[:, 4]
    x[::3] = np.round(x[::3])
    x[::7] = 0.0
    x[1::7, ::2] = -0.0
    x[5, :] = -np.inf
    x[5, 7] = 1.0
    x[6, 3] = np.inf
    x[8] = np.float32(1e-40) * rng.normal(size=37)
    for k in (1, 4, 37):
        want = np.asarray(jax.lax.top_k(x, k)[0][..., -1:])
        np.testing.assert_array_equal(np.asarray(_kth_largest_bisect(jnp.asarray(x), k)), want)
    np.testing.assert_array_equal(np.asarray(kth_largest(jnp.asarray(x), 4)),
                                  np.asarray(jax.lax.top_k(x, 4)[0][..., -1:]))


def test_grouped_kth_largest_is_exact_on_wide_rows():
    """The CPU threshold looks only at the k groups of GROUP values with the largest maxima: the same value
    as lax.top_k, including rows whose top values tie across groups and rows with few finite values."""
    from jaxgpt.generate.sampling import GROUP, _kth_largest_grouped

    rng = np.random.default_rng(1)
    V = 50_257
    x = rng.normal(size=(6, V)).astype(np.float32)
    x[1] = np.round(x[1])  # heavy ties everywhere
    x[2, ::GROUP] = 7.0  # every group's maximum is the same value
    x[3, :] = -np.inf
    x[3, rng.choice(V, 30, replace=False)] = rng.normal(size=30)  # fewer finite values than k
    x[4, -5:] = 9.0  # the top values in the last, padded group
    x[5] = np.float32(1e-40) * rng.normal(size=V)  # denormals
    for k in (1, 2, 50, 196):
        want = np.asarray(jax.lax.top_k(x, k)[0][..., -1:])
        np.testing.assert_array_equal(np.asarray(_kth_largest_grouped(jnp.asarray(x), k)), want)


def test_argmax_is_jnp_argmax():
    from jaxgpt.generate import argmax

    rng = np.random.default_rng(2)
    x = np.round(rng.normal(size=(20, 300)) * 2).astype(np.float32)  # ties: the first index wins
    x[3] = -np.inf
    x[4, 17] = np.inf
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_categorical_draws_from_the_softmax():
    """Two-level inverse CDF: frequencies match softmax(logits) over several groups and the partial last
    one; -inf logits are never drawn; a single finite logit is always drawn."""
    from jaxgpt.generate.sampling import GROUP, categorical

    V, n = 3 * GROUP + 40, 200_000
    logits = np.full(V, -np.inf, np.float32)
    support = np.r_[5, 100, GROUP, GROUP + 1, 2 * GROUP + 7, 3 * GROUP + 39]  # across groups, last one partial
    logits[support] = np.random.default_rng(3).normal(0.0, 1.0, support.size)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    draw = jax.jit(lambda key, x: categorical(key, jnp.broadcast_to(x, (n, V))))
    tokens = np.asarray(draw(jax.random.key(0), jnp.asarray(logits)))
    freq = np.bincount(tokens, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(support)
    np.testing.assert_allclose(freq, probs, atol=5 * np.sqrt(0.25 / n))  # 5 sigma at worst
    one = np.full((4, V), -np.inf, np.float32)
    one[:, V - 1] = 0.0
    assert (np.asarray(categorical(jax.random.key(1), jnp.asarray(one))) == V - 1).all()


# ---- the cache and block_size cropping --------------------------------------------------------------------------
def test_cached_equals_uncached_across_block_size(runs):
    np.testing.assert_array_equal(runs["greedy"], runs["greedy_uncached"])
    np.testing.assert_array_equal(runs["sampled"], runs["sampled_uncached"])


def test_prompt_longer_than_block_size(model):
    prompt = np.random.default_rng(0).integers(0, V, size=25)
    out = generate(model, prompt, max_new_tokens=8, temperature=0.0)
    assert out.shape == (1, 33)
    np.testing.assert_array_equal(out[0, :25], prompt)  # the whole prompt comes back
    # each token: argmax after the last block_size tokens, positions from 0 (so the prompt's head is unused)
    ns = list(range(25, 33))
    np.testing.assert_array_equal(greedy_next(model, out, ns), out[0, ns])


# ---- errors -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=3, temperature=-0.5), "temperature"),
    (dict(max_new_tokens=3, temperature=float("nan")), "temperature"),
    (dict(max_new_tokens=3, top_k=-2), "top_k"),
    (dict(max_new_tokens=3, num_samples=0), "num_samples"),
    (dict(max_new_tokens=3, seed=-1), "seed"),
])
def test_bad_arguments(model, kwargs, match):
    with pytest.raises(GenerateError, match=match):
        generate(model, PROMPT, **kwargs)


@pytest.mark.parametrize("prompt, err, match", [
    ([1, V], TokenError, "outside"),
    ([-1, 2], TokenError, "outside"),
    ([V + 5] + [1] * 20, TokenError, "outside"),  # out of range in the part cropped away, still refused
    ([1.0, 2.0], TokenError, "integer"),
    ([], GenerateError, "empty"),
    ([[[1]]], GenerateError, "shape"),
])
def test_bad_prompts(model, prompt, err, match):
    with pytest.raises(err, match=match):
        generate(model, prompt, max_new_tokens=3)


# ---- text and the command line ------------------------------------------------------------------------------------
TEXT_ARGS = dict(max_new_tokens=6, temperature=0.9, top_k=20, seed=3, num_samples=2)


@pytest.fixture(scope="module")
def tiny_text_model() -> GPT:
    return GPT(GPTConfig.preset("tiny"), policy=Policy.fp32(), rngs=nnx.Rngs(0))  # = random:tiny


def test_generate_text(tiny_text_model):
    pytest.importorskip("jaxgpt.tokenizer")
    texts = generate_text(tiny_text_model, "Hello, world", **TEXT_ARGS)
    assert len(texts) == 2 and all(t.startswith("Hello, world") for t in texts)
    assert texts == generate_text(tiny_text_model, "Hello, world", **TEXT_ARGS)
    with pytest.raises(GenerateError, match="prompt"):
        generate_text(tiny_text_model, 123, max_new_tokens=2)


def test_cli_random_init(tiny_text_model, capsys):
    pytest.importorskip("jaxgpt.tokenizer")
    expected = generate_text(tiny_text_model, "Hello, world", **TEXT_ARGS)
    rc = main(["--init-from", "random:tiny", "--prompt", "Hello, world", "--max-new-tokens", "6",
               "--temperature", "0.9", "--top-k", "20", "--seed", "3", "--num-samples", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out == expected[0] + "\n" + "-" * 40 + "\n" + expected[1] + "\n"


@pytest.mark.parametrize("argv, match", [
    (["--init-from", "random:nope"], "unknown preset"),
    (["--init-from", "random:tiny", "--prompt", "x", "--seed", str(2**40)], "seed"),
    (["--init-from", "random:tiny", "--step", "3"], "--step"),
])
def test_cli_bad_values(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and match in err and "Traceback" not in err


def test_cli_prompt_ids_print_ids_and_the_special_token(tiny_text_model, capsys):
    """--prompt-ids is the same prompt as its text; --print-ids prints each sample's ids as a JSON line; a typed
    <|endoftext|> is literal (seven tokens) unless --allow-special makes it the token 50256."""
    pytest.importorskip("jaxgpt.tokenizer")
    from jaxgpt.tokenizer import EOT_TOKEN, encode

    greedy = ["--init-from", "random:tiny", "--max-new-tokens", "3", "--temperature", "0", "--print-ids"]
    assert main([*greedy, "--prompt", "Hello, world"]) == 0
    by_text = capsys.readouterr().out
    assert main([*greedy, "--prompt-ids", " ".join(map(str, encode("Hello, world")))]) == 0
    assert capsys.readouterr().out == by_text
    text, ids_line = by_text.splitlines()
    ids = json.loads(ids_line)
    assert ids["sample"] == 0 and ids["ids"][:3] == encode("Hello, world") and len(ids["ids"]) == 6
    assert text.startswith("Hello, world")

    for flag, expected in (([], encode("a<|endoftext|>b")), (["--allow-special"], [64, EOT_TOKEN, 65])):
        assert main([*greedy, "--prompt", "a<|endoftext|>b", *flag]) == 0
        prompt_ids = json.loads(capsys.readouterr().out.splitlines()[-1])["ids"][:-3]
        assert prompt_ids == expected
    assert len(encode("a<|endoftext|>b")) == 9  # a, seven literal pieces, b
    assert generate_text(tiny_text_model, "<|endoftext|>", max_new_tokens=1, temperature=0,
                         allow_special=True)[0].startswith("<|endoftext|>")

    assert main(["--init-from", "random:tiny", "--prompt-ids", "60000"]) == 2
    assert "outside [0, 50257)" in capsys.readouterr().err
    for bad in (["--prompt-ids", "x,1"], ["--prompt-ids", "-1"], ["--prompt-ids", "1", "--prompt", "a"]):
        with pytest.raises(SystemExit):
            main(["--init-from", "random:tiny", *bad])
        assert "Traceback" not in capsys.readouterr().err
    assert main([*greedy, "--prompt-ids", "1", "--allow-special"]) == 2
    assert "--allow-special applies to --prompt text" in capsys.readouterr().err


TEXT_ARGV = ["--prompt", "Hello, world", "--max-new-tokens", "6", "--temperature", "0.9", "--top-k", "20",
             "--seed", "3", "--num-samples", "2"]


def test_cli_loads_hf_dir_and_training_run(tiny_text_model, tmp_path, capsys):
    pytest.importorskip("jaxgpt.tokenizer")
    from jaxgpt import weights
    from jaxgpt.checkpoint import Checkpoints
    from jaxgpt.config import to_dict

    expected = capsys.readouterr().out if main(["--init-from", "random:tiny", *TEXT_ARGV]) == 0 else None
    traces = trace_count()
    weights.save_hf(tiny_text_model, tmp_path / "hf")
    assert main(["--init-from", str(tmp_path / "hf"), *TEXT_ARGV]) == 0
    assert capsys.readouterr().out == expected
    with Checkpoints(tmp_path / "run", async_save=False) as ckpts:
        ckpts.save(3, params=nnx.state(tiny_text_model, nnx.Param), opt_state={"count": jnp.zeros(())},
                   config={"model": to_dict(tiny_text_model.config)})
    for init_from in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        assert main(["--init-from", str(init_from), "--step", "3", *TEXT_ARGV]) == 0
        assert capsys.readouterr().out == expected
    assert main(["--init-from", str(tmp_path / "run"), "--step", "4", *TEXT_ARGV]) == 2
    assert "no checkpoint for step 4" in capsys.readouterr().err
    assert trace_count() == traces  # the same shapes from any source reuse the compiled function


def test_cli_directory_that_is_neither(tmp_path, capsys):
    assert main(["--init-from", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "checkpoint" in err and "Traceback" not in err


def test_cli_a_missing_directory_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """A typo of a run directory (runs/ exists here) is a missing directory, not a model the hub could not give."""
    (tmp_path / "runs" / "shakespeare-char-cpu").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for init_from, close in (("runs/shakespeare-char-cpy", " (did you mean runs/shakespeare-char-cpu?)"),
                             (str(tmp_path / "elsewhere" / "run"), ""), ("./run", " (did you mean runs?)"), ("./zzz", "")):
        assert main(["--init-from", init_from]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: --init-from {init_from!r}: no such directory: {init_from}{close}; give a training run "
                       "directory, a Hugging Face GPT-2 directory or name (gpt2, ...), or random:PRESET\n"), err


def test_cli_sampling_defaults_are_a_training_runs_own(capsys):
    """generate samples as the run's own samples do (nanoGPT's sample.py: 0.8, 200), and says so on stderr."""
    from jaxgpt.generate.cli import SAMPLE_TEMPERATURE, SAMPLE_TOP_K, build_parser
    from jaxgpt.train.config import TrainConfig

    args = build_parser().parse_args([])
    assert (args.temperature, args.top_k) == (SAMPLE_TEMPERATURE, SAMPLE_TOP_K) == (
        TrainConfig.sample_temperature, TrainConfig.sample_top_k) == (0.8, 200)
    help_text = " ".join(build_parser().format_help().split())
    assert "default: 0.8, as a training run's own samples" in help_text and "(default: 200, as a" in help_text
    assert main(["--init-from", "random:tiny", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "; temperature 0.8, top-k 200 (the defaults, a training run's own: --temperature, --top-k to change)]" in err
    assert main(["--init-from", "random:tiny", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().err.endswith("; greedy]\n")


@pytest.mark.parametrize("argv", [["--max-new-tokens", "-3"], ["--temperature", "hot"],
                                  ["--precision", "fp16"], ["--top-k", "-1"], ["--num-samples", "0"]])
def test_cli_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_cli_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "jaxgpt.generate", "--temperature", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--temperature" in proc.stderr


def test_the_package_re_exports_its_modules_names_and_imports_them_only_when_used():
    """``jaxgpt.generate``'s names are its modules' own objects; importing the package imports no jax (so that
    ``python -m jaxgpt.generate`` imports jax under jaxgpt.interrupt.run_cli, where a Ctrl-C is the tool's line)."""
    import importlib

    import jaxgpt.generate as package

    assert package.__all__ == sorted(package._EXPORTS)
    for name, module in package._EXPORTS.items():
        assert getattr(package, name) is getattr(importlib.import_module(f"jaxgpt.generate.{module}"), name), name
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018
    code = "import sys, jaxgpt.generate; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_bf16_decoding_casts_the_weights_once_with_the_same_tokens(monkeypatch):
    """Under a bf16 policy the decoder casts the Linear kernels and the tied head to bf16 once per call, not once
    per token. The matmuls cast their operands anyway, so sampling is bit-for-bit what per-token casting gives."""
    from jaxgpt.generate import decode

    fp32 = sharpened_model(CFG, seed=4)
    graphdef, state = nnx.split(fp32)
    bf16 = nnx.merge(nnx.split(GPT(CFG, policy=Policy.bf16(), rngs=nnx.Rngs(0)))[0], state)
    cast = decode._matmul_weights_in_compute_dtype(*nnx.split(bf16))
    dtypes = {jax.tree_util.keystr(p): v.dtype for p, v in jax.tree_util.tree_leaves_with_path(cast)}
    assert {k for k, d in dtypes.items() if d == jnp.bfloat16} == {k for k in dtypes if "kernel" in k}
    assert decode._matmul_weights_in_compute_dtype(graphdef, state) is state  # fp32: untouched
    fast = generate(bf16, PROMPT, max_new_tokens=N_NEW, temperature=0.8, seed=3, num_samples=2)
    monkeypatch.setattr(decode, "_matmul_weights_in_compute_dtype", lambda graphdef, state: state)
    decode._generate_compiled.clear_cache()  # retrace without the cast
    slow = generate(bf16, PROMPT, max_new_tokens=N_NEW, temperature=0.8, seed=3, num_samples=2)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(slow))
