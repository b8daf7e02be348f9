"""jaxgpt's lm-evaluation-harness model (jaxgpt.eval.harness) against lm-eval's own ``hf`` model on the exported
Hugging Face directory of the same weights, offline, on three local tasks this test writes (task YAMLs over
jsonl files): multiple choice (loglikelihood), rolling perplexity (loglikelihood_rolling) and generate_until.
Every request's log-likelihood agrees to 1e-4, the greedy flags and generations are identical, accuracy and
exact match are identical and the perplexities agree to 1e-5 relative."""

from __future__ import annotations

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[eval]'")

from jaxgpt.eval.harness import JaxGPTLM  # noqa: E402  (registers --model jaxgpt)
from parity_tests.tolerances import LM_EVAL_LOGLIK_ABS, LM_EVAL_PPL_REL  # noqa: E402

MC = [("The capital of France is", [" Paris.", " a banana.", " the moon.", " blue."], 0),
      ("To boil an egg, put it in", [" boiling water for ten minutes.", " the freezer.", " a letter.", " a shoe."], 0),
      ("Cats like to chase", [" mice.", " airplanes made of cheese.", " taxes.", " the number seven."], 0),
      ("After the rain stopped, the children", [" went outside to play in the puddles.", " melted.", " flew.",
                                                  " became teachers."], 0)]
TEXTS = ["It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
         "foolishness, it was the epoch of belief, it was the epoch of incredulity.",  # longer than the window
         "Call me Ishmael.", "In the beginning <|endoftext|> there was text."]
QA = [("Q: What is two plus two?\nA:", "4"), ("Q: Name a color.\nA:", "red"), ("Once upon a time", "there")]

TASKS = {
    "jaxgpt_mc": ("mc.jsonl", [{"ctx": c, "endings": e, "label": label} for c, e, label in MC], """
output_type: multiple_choice
doc_to_text: "{{ctx}}"
doc_to_choice: "{{endings}}"
doc_to_target: "{{label}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""),
    "jaxgpt_ppl": ("ppl.jsonl", [{"text": t} for t in TEXTS], """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""),
    "jaxgpt_gen": ("gen.jsonl", [{"question": q, "answer": a} for q, a in QA], """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""),
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, (fname, rows, body) in TASKS.items():
        (d / fname).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        f"    test: {d / fname}\ntest_split: test\n" + body)
    return d


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A jaxgpt model exported as a complete Hugging Face directory (weights and tokenizer files)."""
    from flax import nnx

    from jaxgpt.config import GPTConfig
    from jaxgpt.model import GPT
    from jaxgpt.weights import save_hf

    model = GPT(GPTConfig.preset("tiny", block_size=32), rngs=nnx.Rngs(5))  # the first text needs 2 windows
    nnx.update(model, jax_tree_scale(nnx.state(model, nnx.Param), "wte", 3.0))  # peaked: clear greedy choices
    return save_hf(model, tmp_path_factory.mktemp("export") / "hf")


def jax_tree_scale(params, name, factor):
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda p, x: x * factor if jax.tree_util.keystr(p).startswith(f"['{name}']") else x, params)


def run(model, model_args: str, tasks_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return simple_evaluate(model=model, model_args=model_args, tasks=sorted(TASKS), log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir)), bootstrap_iters=0,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def test_every_request_and_metric_matches_lm_evals_hf_model(tasks, export, monkeypatch, parity_report):
    ours = run("jaxgpt", f"pretrained={export},batch_size=3", tasks, monkeypatch)
    hf = run("hf", f"pretrained={export},batch_size=3,device=cpu,dtype=float32", tasks, monkeypatch)
    worst = 0.0
    for task in TASKS:
        a, b = ours["samples"][task], hf["samples"][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and len(a) == len(TASKS[task][1])
        for sa, sb in zip(a, b):
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                if task == "jaxgpt_gen":
                    assert ra == rb, (sa["doc"], ra, rb)
                    continue
                if task == "jaxgpt_ppl":
                    (la,), (lb,) = ra, rb
                else:
                    (la, ga), (lb, gb) = ra[0], rb[0]
                    assert ga == gb, (sa["doc"], ra, rb)
                worst = max(worst, abs(la - lb))
                assert abs(la - lb) <= LM_EVAL_LOGLIK_ABS, (task, sa["doc"], la, lb)
        for metric, va in ours["results"][task].items():
            if not isinstance(va, float) or "stderr" in metric:
                continue
            vb = hf["results"][task][metric]
            if metric.startswith(("acc", "exact_match")):
                assert va == vb, (task, metric, va, vb)
            else:
                assert math.isclose(va, vb, rel_tol=LM_EVAL_PPL_REL), (task, metric, va, vb)
    assert ours["results"]["jaxgpt_mc"]["acc,none"] >= 0.0  # (the numbers themselves: a random model)
    assert isinstance(JaxGPTLM, type)
    parity_report("lm_eval_vs_hf", max_abs_loglik=worst)
