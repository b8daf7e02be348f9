"""jaxgpt.kernels.registry and Policy.kernels: what each op can run, where, under which numerics; the presets; the
one place choices are validated; the TrainConfig / CLI flags (--kernels, --kernels.OP) and the old per-op flags'
refusal. Each implementation's values against its reference: the op's own test file beside this one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt.config import ConfigError
from jaxgpt.kernels import registry
from jaxgpt.precision import Kernels, Policy

ROOT = Path(__file__).resolve().parents[2]


def test_every_op_has_a_reference_and_says_where_each_implementation_runs():
    assert registry.OPS == ("layer_norm", "attention", "qkv", "mlp", "loss")
    for op, impls in registry.REGISTRY.items():
        ref = "reference" if op == "attention" else "xla"
        assert impls[ref].numerics == "reference" and set(impls[ref].platforms) == set(registry.PLATFORMS), op
        assert all(i.numerics in ("reference", "reordered", "changes") and i.summary for i in impls.values()), op
    assert registry.implementations("mlp") == ["xla", "pallas-gemm", "pallas-recompute"]
    assert registry.implementations("mlp", "cpu") == ["xla"]  # the kernels run on GPUs only
    assert registry.implementations("mlp", "gpu", "bfloat16") == ["xla", "pallas-gemm", "pallas-recompute"]
    assert registry.implementations("attention", "gpu", "float32") == ["auto", "xla", "reference"]
    assert registry.implementations("loss", "gpu", "bfloat16", Policy.bf16()) == ["xla"]  # fp32 logits
    assert registry.implementations("loss", "gpu", "bfloat16", Policy.bf16(logits_dtype="bfloat16")) == ["xla", "pallas"]
    with pytest.raises(ConfigError, match="kernels: unknown op 'gelu'; the ops are layer_norm, attention, qkv, mlp, loss"):
        registry.implementations("gelu")


def test_presets_resolve_against_the_numerics():
    assert Policy().implementations == {"layer_norm": "xla", "attention": "auto", "qkv": "xla", "mlp": "xla", "loss": "xla"}
    fast = Policy.bf16(kernels="pallas", logits_dtype="bfloat16", gelu_h_dtype="bfloat16")
    assert fast.implementations == {"layer_norm": "pallas", "attention": "auto", "qkv": "pallas", "mlp": "pallas-gemm",
                           "loss": "pallas"}
    # the same numerics as the precision says: where they rule a kernel out, the preset takes the reference
    assert Policy.bf16(kernels="pallas").kernel("loss") == "xla"  # fp32 logits
    auto = Policy.bf16_autocast(kernels="pallas").implementations
    assert (auto["layer_norm"], auto["qkv"], auto["mlp"], auto["loss"]) == ("pallas", "xla", "xla", "pallas")
    fp8 = Policy.fp8_policy("all", kernels="pallas").implementations
    assert (fp8["qkv"], fp8["mlp"], fp8["loss"]) == ("xla", "xla", "xla")
    assert Policy.fp8_policy("lm_head", kernels="pallas").kernel("mlp") == "pallas-gemm"
    # a per-op choice over the preset; the policy's str names what each op runs (the benchmarks record it)
    p = Policy.bf16(kernels=Kernels("pallas", mlp="pallas-recompute"))
    assert p.kernel("mlp") == "pallas-recompute" and "mlp=pallas-recompute" in str(p)
    assert Policy.bf16(kernels={"preset": "pallas", "qkv": "xla"}).kernel("qkv") == "xla"


def test_one_line_errors_name_the_valid_choices():
    for kernels, msg in (("fast", "kernels = 'fast': the presets are xla, pallas"),
                         ({"mlp": "pallas"}, r"^kernels.mlp = 'pallas': valid choices are xla, pallas-gemm, "
                                             r"pallas-recompute \(GPU: pallas-gemm, pallas-recompute\)$"),
                         ({"attention": "flash"}, r"^kernels.attention = 'flash': valid choices are auto, xla, cudnn, "
                                                  r"einsum, reference \(GPU: cudnn; CPU: einsum\)$"),
                         ({"gelu": "pallas"}, "Kernels: unknown key")):
        with pytest.raises(ConfigError, match=msg):
            Policy.bf16(kernels=kernels)
    with pytest.raises(ConfigError, match="kernels.loss = 'pallas' needs logits_dtype bfloat16; valid choices with "
                                          "this precision are xla$"):
        Policy.bf16(kernels={"loss": "pallas"})
    with pytest.raises(ConfigError, match="kernels.mlp = 'pallas-recompute' needs gelu_h_dtype float32"):
        Policy.bf16(kernels={"mlp": "pallas-recompute"}, gelu_h_dtype="bfloat16")


def test_train_config_flags():
    from jaxgpt.compile.program import resolve_policy
    from jaxgpt.train.config import TrainConfig

    cfg = TrainConfig.load(None, {"kernels": "pallas", "kernels.mlp": "pallas-recompute", "precision": "bf16"})
    assert cfg.kernels == Kernels("pallas", mlp="pallas-recompute")
    assert resolve_policy(cfg, "gpu").kernel("mlp") == "pallas-recompute"
    assert TrainConfig.load(None, {"kernels.mlp": "pallas-gemm", "kernels": "pallas"}).kernels == Kernels(
        "pallas", mlp="pallas-gemm")  # either order
    for old, op in (("layer_norm", "layer_norm"), ("gelu", "mlp"), ("qkv", "qkv"), ("lm_head", "loss"),
                    ("c_proj", "layer_norm"), ("attention", "attention")):
        with pytest.raises(ConfigError, match=f"^{old}: replaced by kernels \\(docs/kernels.md\\): --kernels=pallas "
                                              f"selects the Pallas set, --kernels.{op}=NAME one op's implementation$"):
            TrainConfig.load(None, {old: "pallas"})
    with pytest.raises(ConfigError, match="kernels.qkv = 'fused': valid choices are xla, pallas"):
        TrainConfig.load(None, {"kernels.qkv": "fused"})


def test_print_config_shows_the_fast_set():
    r = subprocess.run([sys.executable, "-m", "jaxgpt.train", "--config", "configs/gpt2-124m.yaml", "--kernels=pallas",
                        "--logits_dtype=bfloat16", "--print-config"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "kernels:\n  preset: pallas\n" in r.stdout
    assert "# kernels (GPUs; precision auto as bf16): layer_norm=pallas, attention=auto, qkv=pallas, " \
           "mlp=pallas-gemm, loss=pallas" in r.stdout
    r = subprocess.run([sys.executable, "-m", "jaxgpt.train", "--gelu=pallas-gemm", "--print-config"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("error: gelu: replaced by kernels (docs/kernels.md): "
                                                      "--kernels=pallas selects the Pallas set, --kernels.mlp=NAME one "
                                                      "op's implementation")
