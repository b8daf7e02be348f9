"""What a compiled train step is made of, checked from its optimized HLO: how attention lowered, the dtypes of
every GEMM, the loss's dtype, which state buffers are donated, and where the collectives run."""

from __future__ import annotations

import collections
import dataclasses
import re

from jaxgpt.compile.hlo import COLLECTIVES, Kernel, Module


@dataclasses.dataclass(frozen=True)
class Structure:
    cudnn_attention_fwd: int  # fused attention calls in the program text (each runs once per layer per micro-step)
    cudnn_attention_bwd: int
    square_buffers: int  # arrays (rank >= 3) ending in (seq, seq): a materialised attention matrix
    gemms: dict[str, int]  # "bf16 x bf16 -> f32": count of GEMM sites (cuBLAS calls and dots in fusions)
    loss_reductions: dict[str, int]  # result dtype -> count of the cross-entropy's reductions
    donated_params: int  # entry parameters aliased to outputs (input_output_alias)
    collectives: dict[str, dict[int, int]]  # opcode -> {loop depth: launches per step}
    # fp8 GEMM sites by engine: "cublaslt" (__cublas$lt$matmul$f8 calls), "triton" (Triton GEMM fusions of an fp8
    # dot), "other" (an fp8 dot anywhere else); empty for a program without fp8 operands
    fp8_gemms: dict[str, int] = dataclasses.field(default_factory=dict)

    def lines(self, seq_len: int) -> list[str]:
        gemm = ", ".join(f"{n} {k}" for k, n in sorted(self.gemms.items(), key=lambda kv: -kv[1]))
        loss = ", ".join(f"{n} in {k}" for k, n in sorted(self.loss_reductions.items()))
        if self.collectives:
            coll = "; ".join(f"{op}: " + ", ".join(
                f"{n} {'per optimizer step (outside the accumulation loop)' if d == 0 else f'inside loop depth {d}'}"
                for d, n in sorted(by.items())) for op, by in sorted(self.collectives.items()))
        else:
            coll = "none (one device)"
        return [f"attention: {self.cudnn_attention_fwd} cuDNN fused forward + {self.cudnn_attention_bwd} backward "
                f"calls; {self.square_buffers} ({seq_len}, {seq_len}) buffers",
                f"GEMMs (operands -> result): {gemm}"
                + (f"; fp8 GEMMs by engine: {', '.join(f'{n} {k}' for k, n in sorted(self.fp8_gemms.items()))}"
                   if self.fp8_gemms else ""),
                f"loss reductions: {loss or 'none found'}",
                f"donated (aliased) entry parameters: {self.donated_params}",
                f"collectives per optimizer step: {coll}"]


def _gemm_signatures(m: Module) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for comp, instrs in m.computations.items():
        for i in instrs:
            if i.opcode == "dot" or (i.opcode == "custom-call" and '_call_target="__cublas' in i.attrs):
                ops = [m.instr_shape(comp, o) for o in i.operands[:2]]
                if len(ops) == 2 and ops[0] and ops[1]:
                    out[f"{ops[0][0].dtype} x {ops[1][0].dtype} -> {i.shapes[0].dtype}"] += 1
    return out


def _fp8_gemm_engines(m: Module) -> collections.Counter:
    """fp8 GEMM sites by engine: cuBLASLt's fp8 custom calls, and dots with an f8 operand by where they sit (inside
    a Triton GEMM fusion's computation, or elsewhere: an unfused dot, XLA's own emitter)."""
    triton_comps = set()
    for instrs in m.computations.values():
        for i in instrs:
            kind = i.backend_config().get("fusion_backend_config", {}).get("kind", "") if i.opcode == "fusion" else ""
            if kind.startswith("__triton") and "gemm" in kind:  # __triton_gemm, __triton_nested_gemm_fusion
                triton_comps.update(_called_closure(m, i.attr("calls")))
    out: collections.Counter = collections.Counter()
    for comp, instrs in m.computations.items():
        for i in instrs:
            if i.opcode == "custom-call" and '_call_target="__cublas$lt$matmul$f8"' in i.attrs:
                out["cublaslt"] += 1
            elif i.opcode == "dot":
                ops = [m.instr_shape(comp, o) for o in i.operands[:2]]
                if any(s and s[0].dtype.startswith("f8") for s in ops):
                    out["triton" if comp in triton_comps else "other"] += 1
    return out


def _called_closure(m: Module, comp: str | None) -> set[str]:
    """``comp`` and every computation it calls (nested fusions), transitively."""
    seen: set[str] = set()
    todo = [comp] if comp else []
    while todo:
        c = todo.pop()
        if c in seen or c not in m.computations:
            continue
        seen.add(c)
        for i in m.computations[c]:
            todo.extend(i.called())
    return seen


def structure(hlo_text: str, kernels: list[Kernel], *, seq_len: int) -> Structure:
    m = Module(hlo_text)
    fwd = bwd = square = 0
    loss: collections.Counter = collections.Counter()
    for comp, instrs in m.computations.items():
        for i in instrs:
            target = re.search(r'custom_call_target="([^"]*)"', i.attrs) if i.opcode == "custom-call" else None
            if target and "fmha" in target.group(1):
                if "Backward" in target.group(1):
                    bwd += 1
                else:
                    fwd += 1
            if any(len(a.dims) >= 3 and a.dims[-2:] == (seq_len, seq_len) for a in i.shapes):
                square += 1
            if i.opcode == "reduce" and "cross_entropy" in i.op_name:
                loss[i.shapes[0].dtype] += 1
    header = hlo_text.split("\n", 1)[0]
    donated = len(re.findall(r"\{[\d,\s]*\}:\s*\(\d+,", header)) if "input_output_alias" in header else 0
    coll: dict[str, dict[int, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for k in kernels:
        if k.opcode in COLLECTIVES:
            coll[k.opcode.removesuffix("-start")][k.loop_depth] += k.count
    return Structure(fwd, bwd, square, dict(_gemm_signatures(m)), dict(loss), donated,
                     {op: dict(by) for op, by in coll.items()}, dict(_fp8_gemm_engines(m)))
