"""jaxgpt's lm-evaluation-harness model (jaxgpt.eval.harness) against lm-eval's own ``hf`` model on the exported
Hugging Face directory of the same weights, offline, on three local tasks this test writes (task YAMLs over
jsonl files): multiple choice (loglikelihood), rolling perplexity (loglikelihood_rolling) and generate_until.

What the tasks hold: a multiple-choice item one of whose choices *is* the model's greedy continuation (the greedy
flag must be True on both sides) and one whose context is longer than the model's block (cut from the left);
a text longer than the block (several rolling windows); generation contexts longer than ``block_size -
max_gen_toks`` (cut from the left), of several lengths in one batch (each row at its own positions: the model's
position embedding is scaled up so that its greedy tokens depend on the position), with ``until`` strings taken
from the model's own greedy continuations (computed here with ``transformers``), so that generations are cut by
them and a batch ends before ``max_gen_toks``. Every request's log-likelihood agrees to 1e-4, greedy flags and
generations are identical, and the union of both sides' metric keys is compared: accuracy and exact match
identical, the perplexities to 1e-5 relative.

The harness is imported at the top, before lm-eval has looked up any model: the order in which registering
``jaxgpt`` used to hide lm-eval's built-in ``hf`` model."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[eval]'")

from jaxgpt.eval.harness import JaxGPTLM
from jaxgpt.tokenizer import decode, encode
from parity_tests.tolerances import LM_EVAL_LOGLIK_ABS, LM_EVAL_PPL_REL

BLOCK, MAX_GEN, BATCH = 32, 12, 3
LONG = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity.")  # 37 tokens > BLOCK

MC = [("The capital of France is", [" Paris.", " a banana.", " the moon.", " blue."], 0),
      ("To boil an egg, put it in", [" boiling water for ten minutes.", " the freezer.", " a letter.", " a shoe."], 0),
      ("Cats like to chase", [" mice.", " airplanes made of cheese.", " taxes.", " the number seven."], 0),
      (LONG + " After the rain stopped, the children", [" went outside to play in the puddles.", " melted.",
                                                        " flew.", " became teachers."], 0)]
GREEDY_CANDIDATES = ["Once upon a time", "The weather today is", "My favourite food is", "He opened the door and"]
TEXTS = [LONG + " It was the season of Light, it was the season of Darkness.",  # three rolling windows
         "Call me Ishmael.", "In the beginning <|endoftext|> there was text."]
GEN = ["Q: What is two plus two?\nA:", "Q: Name a color.\nA:", "Once upon a time", "The capital of France is",
       LONG, "Cats like to chase"]


def task_yaml(name: str, data, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A jaxgpt model exported as a complete Hugging Face directory (weights and tokenizer files): token embedding
    x3 (clear greedy choices), position embedding x30 (greedy tokens that depend on the absolute position)."""
    import jax
    from flax import nnx

    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.weights import save_hf

    model = GPT(GPTConfig.preset("tiny", block_size=BLOCK), rngs=nnx.Rngs(5))
    scale = {"['wte']": 3.0, "['wpe']": 30.0}
    nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, x: x * next(
        (f for k, f in scale.items() if jax.tree_util.keystr(p).startswith(k)), 1.0), nnx.state(model, nnx.Param)))
    return save_hf(model, tmp_path_factory.mktemp("export") / "hf")


@pytest.fixture(scope="module")
def greedy(export):
    """greedy(ids, n): the next n tokens after ids by transformers' own greedy generate on the export."""
    import torch
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(export).eval()

    def run(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, pad_token_id=50256)
        return out[0, len(ids):].tolist()

    return run


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, greedy):
    """The task directory, and what the generation task expects: each context's untruncated greedy text and the
    stop strings."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    mc = list(MC)
    for context in GREEDY_CANDIDATES:  # a choice that is the greedy continuation, token for token
        g = greedy(encode(context), 2)
        if encode(context + decode(g)) == encode(context) + g:
            mc.append((context, [" a banana.", decode(g), " the moon.", " blue."], 1))
            break
    else:
        pytest.fail("no candidate context whose greedy continuation re-tokenizes as itself")
    continuations = [greedy(encode(c)[-(BLOCK - MAX_GEN):], MAX_GEN) for c in GEN]
    common = Counter(t for c in continuations for t in set(c)).most_common(1)[0][0]  # in most rows
    until = [decode([common]), decode(continuations[0][2:4])]
    files = {
        "jaxgpt_mc": ([{"ctx": c, "endings": e, "label": label} for c, e, label in mc], """
output_type: multiple_choice
doc_to_text: "{{ctx}}"
doc_to_choice: "{{endings}}"
doc_to_target: "{{label}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""),
        "jaxgpt_ppl": ([{"text": t} for t in TEXTS], """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""),
        "jaxgpt_gen": ([{"question": q, "answer": decode(c[:3])} for q, c in zip(GEN, continuations)], f"""
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(until)}
  max_gen_toks: {MAX_GEN}
  do_sample: false
metric_list:
  - metric: exact_match
"""),
    }
    for name, (rows, body) in files.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / f"{name}.yaml").write_text(task_yaml(name, d / f"{name}.jsonl", body))
    return d, {"mc": mc, "full": [decode(c) for c in continuations], "until": until}


def run(model, model_args: str, tasks_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return simple_evaluate(model=model, model_args=model_args, tasks=["jaxgpt_gen", "jaxgpt_mc", "jaxgpt_ppl"],
                           log_samples=True, task_manager=TaskManager(include_path=str(tasks_dir)),
                           bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def same(metric: str, va, vb) -> bool:
    if isinstance(va, float) and isinstance(vb, float):
        if math.isnan(va) and math.isnan(vb):
            return True
        if not metric.startswith(("acc", "exact_match")):  # perplexities, bits per byte and their stderrs
            return math.isclose(va, vb, rel_tol=LM_EVAL_PPL_REL)
    return va == vb


def test_every_request_and_metric_matches_lm_evals_hf_model(tasks, export, monkeypatch, parity_report):
    tasks_dir, expect = tasks
    ours = run("jaxgpt", f"pretrained={export},batch_size={BATCH}", tasks_dir, monkeypatch)
    hf = run("hf", f"pretrained={export},batch_size={BATCH},device=cpu,dtype=float32", tasks_dir, monkeypatch)
    worst, greedy_flags, cut = 0.0, [], []
    for task in ("jaxgpt_mc", "jaxgpt_ppl", "jaxgpt_gen"):
        a, b = ours["samples"][task], hf["samples"][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and len(a) > 0
        for sa, sb in zip(a, b):
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                if task == "jaxgpt_gen":
                    assert ra == rb, (sa["doc"], ra, rb)
                    cut.append(ra[0] != expect["full"][sa["doc_id"]])
                    continue
                if task == "jaxgpt_ppl":
                    (la,), (lb,) = ra, rb
                else:
                    (la, ga), (lb, gb) = ra[0], rb[0]
                    assert ga == gb, (sa["doc"], ra, rb)
                    greedy_flags.append(ga)
                worst = max(worst, abs(la - lb))
                assert abs(la - lb) <= LM_EVAL_LOGLIK_ABS, (task, sa["doc"], la, lb)
        ra, rb = ours["results"][task], hf["results"][task]
        for metric in sorted(set(ra) | set(rb)):
            assert metric in ra and metric in rb, (task, metric, sorted(ra), sorted(rb))
            assert same(metric, ra[metric], rb[metric]), (task, metric, ra[metric], rb[metric])
    # the cases are there: a greedy choice, long contexts, generations cut by the stop strings (and some not)
    assert any(greedy_flags) and not all(greedy_flags)
    assert len(encode(MC[-1][0])) > BLOCK and len(encode(LONG)) > BLOCK - MAX_GEN
    assert any(cut) and not all(cut), (expect["until"], [s["resps"] for s in ours["samples"]["jaxgpt_gen"]])
    assert isinstance(JaxGPTLM, type)
    parity_report("lm_eval_vs_hf", max_abs_loglik=worst)
