"""A compiled program's kernels, read from its optimized HLO text: what each kernel launch reads and writes, the
FLOPs it does, and how many times it runs per step.

Only what the text says is used: shapes of operands and results, the fused computations behind each fusion, the
``dot`` dimension numbers of cuBLAS calls and Triton GEMM fusions, cuDNN attention's operand shapes and mask, and
the ``known_trip_count`` XLA records on every ``while`` loop. A kernel is one top-level instruction of the entry
computation or of a loop body (a fusion, a library call, a copy, a collective); bitcasts, tuples and parameters
move no data. Bytes are each operand's size plus the result's, except where the fused computation shows less
is touched: an operand only sliced is counted at the slice's size, and an in-place ``dynamic-update-slice`` at its
update's size (XLA's own cost analysis makes the same two exceptions).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->\s*.*\{\s*$")
# instructions that launch nothing and move no data
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier",
        "partition-id", "replica-id", "all-reduce-done", "all-gather-done", "collective-permute-done", "copy-done",
        "async-done", "send-done", "recv-done", "add-dependency", "domain", "get-dimension-size", "iota"}
_SYNC_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
                     "ragged-all-to-all", "collective-broadcast"}
# a collective as one instruction, or as an async pair whose "-start" moves the data (its "-done" is only the wait)
COLLECTIVES = _SYNC_COLLECTIVES | {f"{c}-start" for c in _SYNC_COLLECTIVES}
_NOT_FLOPS = FREE | {"broadcast", "reshape", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "copy",
                     "concatenate", "pad", "convert", "gather", "scatter", "reverse", "select", "bitcast-convert"}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


def parse_shapes(text: str) -> list[Array]:
    """Every array in a shape string (a tuple gives several), layouts ignored."""
    return [Array(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(text)]


@dataclasses.dataclass
class Instr:
    name: str
    shapes: list[Array]  # the result (several for a tuple)
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    args: str = ""  # the operand list as written (a parameter's index)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", self.attrs)
        return m.group(1).lstrip("%") if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    def backend_config(self) -> dict:
        m = re.search(r"backend_config=(\{.*\})(?:,\s*\w+=|\s*$)", self.attrs)
        if not m:
            return {}
        try:
            return json.loads(m.group(1))
        except json.JSONDecodeError:
            return {}

    def called(self) -> list[str]:
        out = []
        for key in ("calls", "body", "to_apply", "condition", "true_computation", "false_computation"):
            v = self.attr(key)
            if v and not v.startswith("{"):
                out.append(v)
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            out += [c.strip().lstrip("%") for c in m.group(1).split(",")]
        return out


def _split_operands(rest: str) -> tuple[list[str], str, str]:
    """``a, b), attrs`` -> ([a, b], "a, b", attrs): the operand list up to its closing parenthesis."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inner, attrs = rest[: i - 1], rest[i:]
    names = re.findall(r"%([\w.\-]+)", inner)
    return names, inner, attrs.lstrip(", ")


class Module:
    """The computations of an optimized HLO module, each a list of instructions."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instr]] = {}
        self.entry = ""
        current: list[Instr] | None = None
        for line in text.splitlines():
            if current is None:
                m = _COMP.match(line)
                if m:
                    current = self.computations.setdefault(m.group(2), [])
                    if m.group(1):
                        self.entry = m.group(2)
                continue
            if line.startswith("}"):
                current = None
                continue
            m = _INSTR.match(line)
            if m:
                operands, args, attrs = _split_operands(m.group(4))
                current.append(Instr(m.group(1), parse_shapes(m.group(2)), m.group(3), operands, attrs, args))
        if not self.entry:
            raise ValueError("no ENTRY computation in the HLO text")
        self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}

    def instr_shape(self, comp: str, name: str) -> list[Array]:
        i = self.by_name[comp].get(name)
        return i.shapes if i else []

    def root(self, comp: str) -> Instr:
        return self.computations[comp][-1]


@dataclasses.dataclass
class Kernel:
    """One kernel launch site: ``count`` launches per step."""

    name: str
    opcode: str  # fusion kind, custom-call target or opcode
    category: str
    flops: float
    bytes: float
    count: int
    matmul_dtype: str | None  # operand dtype of its GEMM, if it has one
    op_name: str
    loop_depth: int = 0  # 0: runs once per step; 1: inside the accumulation loop; ...
    gemm: str = ""  # a GEMM's engine (cublas, triton: XLA's; pallas: jaxgpt's kernels), dtypes and layout:
    #                 "cublas bf16->f32 NT" (N: contracted on the operand's own side of a row-major matmul, lhs
    #                 columns / rhs rows; T: the other), "" if no GEMM
    pallas: str = ""  # a Pallas kernel's name (pallas_call(name=...)): its GEMM and its epilogue carry it both


def _dot_flops(result: Array, lhs: Array, contracting: list[int]) -> float:
    k = math.prod(lhs.dims[d] for d in contracting) if contracting else 1
    return 2.0 * result.elements * k


def _dims(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


class Rollup:
    """Walks a :class:`Module` from its entry, through loop bodies times their trip counts, into kernels."""

    def __init__(self, module: Module):
        self.m = module
        self.kernels: list[Kernel] = []
        self.unknown_trip_counts = 0
        self._walk(module.entry, 1, loop_depth=0)

    # ---- traversal ----------------------------------------------------------------------------------------
    def _walk(self, comp: str, times: int, loop_depth: int) -> None:
        for ins in self.m.computations[comp]:
            if ins.opcode == "while":
                trip = ins.backend_config().get("known_trip_count", {}).get("n")
                if trip is None:
                    self.unknown_trip_counts += 1
                body = ins.attr("body")
                self._walk(body, times * int(trip or 1), loop_depth + 1)
                continue
            if ins.opcode in ("call", "conditional", "async-start"):
                for c in ins.called():
                    self._walk(c, times, loop_depth)
                continue
            if ins.opcode in FREE or ins.opcode.endswith("-done"):  # async "-done": the wait, no data moved
                continue
            kernel = self._kernel(comp, ins, times, loop_depth)
            self.kernels += self._pallas_gemm(comp, ins, kernel) if pallas_name(ins).startswith(("gemm_", "gemm2_")) \
                else [kernel]

    # ---- one kernel -----------------------------------------------------------------------------------------
    def _operand_bytes(self, comp: str, ins: Instr) -> float:
        shapes = [self.m.instr_shape(comp, o) for o in ins.operands]
        full = [sum(a.bytes for a in s) for s in shapes]
        if ins.opcode != "fusion":
            return sum(full)
        fused = ins.attr("calls")
        instrs = self.m.computations.get(fused, [])
        params = {int(i.args): i.name for i in instrs if i.opcode == "parameter"}
        users: dict[str, list[Instr]] = {}
        for i in instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        root = instrs[-1] if instrs else None
        total = 0.0
        for idx, b in enumerate(full):
            pname = params.get(idx)
            us = users.get(pname, []) if pname else []
            if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == pname for u in us):
                total += sum(u.shapes[0].bytes for u in us)
            elif root is not None and root.opcode == "dynamic-update-slice" and root.operands[0] == pname:
                total += 0.0  # updated in place: only the update is written (counted with the result)
            else:
                total += b
        return total

    def _result_bytes(self, comp: str, ins: Instr) -> float:
        shapes = ins.shapes
        if ins.opcode.endswith("-start") and len(shapes) > len(ins.operands):
            # an async collective's result is (its operands, its outputs[, scratch]): the operands are not written
            shapes = shapes[len(ins.operands):]
        if ins.opcode == "custom-call":  # library workspaces (u8/s8 scratch) are not data
            shapes = [a for a in shapes if a.dtype not in ("u8", "s8")]
        if ins.opcode == "fusion":
            root = self.m.root(ins.attr("calls")) if ins.attr("calls") in self.m.computations else None
            if root is not None and root.opcode == "dynamic-update-slice":
                fused = ins.attr("calls")
                return sum(a.bytes for a in self.m.instr_shape(fused, root.operands[1]))
        return sum(a.bytes for a in shapes)

    def _fused_flops(self, comp: str) -> tuple[float, str | None]:
        """FLOPs inside a fused computation (dots, elementwise, reductions; nested fusions too) and the operand
        dtype of its dot, if any."""
        flops, dot_dtype = 0.0, None
        for i in self.m.computations.get(comp, []):
            if i.opcode == "dot":
                lhs = self.m.instr_shape(comp, i.operands[0])[0]
                flops += _dot_flops(i.shapes[0], lhs, _dims(i.attr("lhs_contracting_dims")))
                dot_dtype = lhs.dtype
            elif i.opcode == "fusion":
                f, d = self._fused_flops(i.attr("calls"))
                flops += f
                dot_dtype = dot_dtype or d
            elif i.opcode == "reduce":
                flops += sum(a.elements for s in i.operands[: len(i.operands) // 2]
                             for a in self.m.instr_shape(comp, s))
            elif i.opcode not in _NOT_FLOPS and i.shapes:
                flops += i.shapes[0].elements
        return flops, dot_dtype

    def _kernel(self, comp: str, ins: Instr, times: int, loop_depth: int) -> Kernel:
        flops, dot_dtype, kind, gemm = 0.0, None, ins.opcode, ""
        if ins.opcode == "fusion":
            cfg = ins.backend_config().get("fusion_backend_config", {})
            kind = cfg.get("kind") or (ins.attr("kind") or "fusion")
            flops, dot_dtype = self._fused_flops(ins.attr("calls"))
            if dot_dtype is not None:
                gemm = self._fused_gemm(ins.attr("calls"), ins.shapes[0].dtype if ins.shapes else "?")
        elif ins.opcode == "custom-call":
            kind = re.search(r'custom_call_target="([^"]*)"', ins.attrs).group(1)
            flops, dot_dtype = self._library_flops(comp, ins, kind)
            if dot_dtype is not None and "fmha" not in kind:
                dn = ins.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
                ranks = [len(s[0].dims) if s else 2 for s in (self.m.instr_shape(comp, o) for o in ins.operands[:2])]
                gemm = _gemm_class("cublas", dot_dtype, ins.shapes[0].dtype, ranks,
                                   [int(x) for x in dn.get("lhs_contracting_dimensions", [])],
                                   [int(x) for x in dn.get("rhs_contracting_dimensions", [])])
        elif ins.opcode not in _NOT_FLOPS and ins.shapes and ins.opcode not in COLLECTIVES:
            flops = ins.shapes[0].elements
        nbytes = self._operand_bytes(comp, ins) + self._result_bytes(comp, ins)
        return Kernel(ins.name, kind, categorize(ins, kind, dot_dtype), flops, nbytes, times, dot_dtype, ins.op_name,
                      loop_depth, gemm, pallas_name(ins))

    def _pallas_gemm(self, comp: str, ins: Instr, kernel: Kernel) -> list[Kernel]:
        """A Pallas GEMM (a Pallas Triton kernel named ``gemm_nn_*`` or ``gemm_nt_*``: jaxgpt.kernels.gemm's; ``gemm_ntsum_*``:
        :meth:`_pallas_sum_gemm`) as two kernels:
        the GEMM (its first operand is the lhs (M, K), its second the rhs, (K, N) for nn or (N, K) for nt, its first
        result (M, N): 2 M N K FLOPs and those three arrays' bytes, the lhs's at the rhs's dtype) and its epilogue
        (every other operand and result, and what an lhs wider than the rhs adds: an fp32 gradient the kernel rounds
        as it reads it; bytes only). Priced apart, one after the other, they cost what the GEMM alone would plus the
        epilogue's extra traffic. A kernel named ``gemm2_<l1><l2>_*`` (``gemm2_ntnn_*``) holds two GEMMs onto the
        same (M, N) tile: operands lhs_1, rhs_1, lhs_2, rhs_2 first, read as one GEMM of both's FLOPs and bytes. A
        kernel named ``gemm_nn_colblock_*`` (``gemm_bias_cast(column_block=)``: q, k or v of c_attn's weight) reads one
        of its (K, c N) rhs's c column blocks in place, and of a (1, c N) operand after it (the bias) the same block:
        the block's bytes are the GEMM's (or the epilogue's), the other columns are not read."""
        name = pallas_name(ins)
        if name.startswith("gemm_ntsum_"):
            return self._pallas_sum_gemm(comp, ins, kernel, name)
        two = name.startswith("gemm2_")
        layouts = [name[6:8], name[8:10]] if two else [name[5:7]]
        out = ins.shapes[0]
        flops = nbytes = unread = 0.0
        for n, layout in enumerate(layouts):
            lhs, rhs = (self.m.instr_shape(comp, o)[0] for o in ins.operands[2 * n:2 * n + 2])
            m, k = lhs.dims if len(lhs.dims) == 2 else (0, 0)
            want = {"nn": (k, out.dims[-1]), "nt": (out.dims[-1], k)}.get(layout)
            colblock = name.startswith("gemm_nn_colblock_") and len(rhs.dims) == len(out.dims) == 2 and \
                out.dims[-1] and rhs.dims[1] % out.dims[-1] == 0
            blocks = rhs.dims[1] // out.dims[-1] if colblock else 1
            if want is None or len(out.dims) != 2 or out.dims[0] != m or rhs.dims != (want[0], want[1] * blocks):
                raise ValueError(f"{ins.name}: a Pallas GEMM ({name!r}) is named gemm_nn_* or gemm_nt_* (gemm2_ and two "
                                 "layouts: two GEMMs) and takes (M, K) and (K, N) (nn, or (K, c N): a column block) or "
                                 f"(N, K) (nt) operands first and writes (M, N) first, got {lhs}, {rhs} -> {out}")
            if n == 0:
                gemm = _gemm_class("pallas", rhs.dtype, out.dtype, [2, 2], [1], [0] if layout == "nn" else [1])
                dtype = rhs.dtype
            flops += 2.0 * out.elements * k
            nbytes += min(lhs.bytes, lhs.elements * DTYPE_BYTES.get(rhs.dtype, 4)) + rhs.bytes / blocks
            unread += rhs.bytes * (blocks - 1) / blocks
            if blocks > 1:  # the bias's other blocks
                unread += sum(a.bytes * (blocks - 1) / blocks for o in ins.operands[2:]
                              for a in self.m.instr_shape(comp, o) if a.dims == (1, rhs.dims[1]))
        return _gemm_and_epilogue(ins, dataclasses.replace(kernel, bytes=kernel.bytes - unread), flops,
                                  nbytes + out.bytes, gemm, dtype)

    def _pallas_sum_gemm(self, comp: str, ins: Instr, kernel: Kernel, name: str) -> list[Kernel]:
        """A Pallas GEMM named ``gemm_ntsum_*`` (jaxgpt.kernels.gemm.gemm_sum_nt): the lhs blocks (every operand but the last,
        (M, K_s) each) split the K of its last operand, (N, sum K_s); it writes (M, N) first: 2 M N sum K_s FLOPs and
        those arrays' bytes; its other results are its epilogue's."""
        shapes = [self.m.instr_shape(comp, o)[0] for o in ins.operands]
        *lhs, rhs = shapes
        out = ins.shapes[0]
        if len(rhs.dims) != 2 or len(out.dims) != 2 or any(len(a.dims) != 2 or a.dims[0] != out.dims[0] for a in lhs) \
                or sum(a.dims[1] for a in lhs) != rhs.dims[1] or rhs.dims[0] != out.dims[1]:
            raise ValueError(f"{ins.name}: a Pallas GEMM ({name!r}) takes (M, K_s) lhs blocks and an (N, sum K_s) "
                             f"rhs and writes (M, N), got {lhs}, {rhs} -> {out}")
        gemm = _gemm_class("pallas", rhs.dtype, out.dtype, [2, 2], [1], [1])
        return _gemm_and_epilogue(ins, kernel, 2.0 * out.elements * rhs.dims[1],
                                  sum(a.bytes for a in shapes) + out.bytes, gemm, rhs.dtype)

    def _fused_gemm(self, comp: str, out_dtype: str) -> str:
        """The class of the (first) dot inside a fused GEMM computation (a Triton GEMM fusion)."""
        for i in self.m.computations.get(comp, []):
            if i.opcode == "dot":
                shapes = [self.m.instr_shape(comp, o) for o in i.operands[:2]]
                return _gemm_class("triton", shapes[0][0].dtype if shapes[0] else "?", out_dtype,
                                   [len(s[0].dims) if s else 2 for s in shapes], _dims(i.attr("lhs_contracting_dims")),
                                   _dims(i.attr("rhs_contracting_dims")))
            if i.opcode == "fusion" and (found := self._fused_gemm(i.attr("calls"), out_dtype)):
                return found
        return ""

    def _library_flops(self, comp: str, ins: Instr, target: str) -> tuple[float, str | None]:
        operands = [self.m.instr_shape(comp, o) for o in ins.operands]
        if "cublas" in target or "gemm" in target:
            dn = ins.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
            lhs = operands[0][0]
            contracting = [int(x) for x in dn.get("lhs_contracting_dimensions", [])]
            return _dot_flops(ins.shapes[0], lhs, contracting), lhs.dtype
        if "fmha" in target:  # q, k, v (B, T, H, D) (or as laid out), causal mask halves the work
            q = operands[0][0]
            k = operands[1][0]
            b, t, h, d = _bthd(q)
            s = _bthd(k)[1]
            causal = "CAUSAL" in json.dumps(ins.backend_config())
            pairs = b * h * t * s * (0.5 if causal and t == s else 1.0)
            matmuls = 5 if "Backward" in target else 2  # fwd: QK^T, PV; bwd: QK^T again, dV, dP, dQ, dK
            return 2.0 * matmuls * pairs * d, q.dtype
        return 0.0, None


def _gemm_and_epilogue(ins: Instr, kernel: Kernel, flops: float, gemm_bytes: float, gemm: str, dtype: str
                       ) -> list[Kernel]:
    """A Pallas GEMM kernel as its GEMM (``flops``, the GEMM's own ``gemm_bytes``, class ``gemm``) and its epilogue
    (the rest of the kernel's bytes, no FLOPs)."""
    return [dataclasses.replace(kernel, flops=flops, bytes=gemm_bytes, matmul_dtype=dtype, gemm=gemm,
                                category=categorize(ins, kernel.opcode, dtype)),
            dataclasses.replace(kernel, name=f"{kernel.name} epilogue", flops=0.0, bytes=kernel.bytes - gemm_bytes)]


def is_epilogue(k: Kernel) -> bool:
    """Whether ``k`` is the epilogue half of a Pallas GEMM (:func:`_gemm_and_epilogue`): bytes only, timed with its GEMM."""
    return bool(k.pallas) and k.name.endswith(" epilogue")


def pallas_name(ins: Instr) -> str:
    """The name a Pallas Triton kernel was given (``pallas_call(name=...)``, kept in its backend config), or ""."""
    if ins.opcode != "custom-call" or "xla.gpu.triton" not in ins.attrs:
        return ""
    m = re.search(r'\bname\s*=\s*"([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def _gemm_class(engine: str, in_dtype: str, out_dtype: str, ranks: list[int], lhs_c: list[int],
                rhs_c: list[int]) -> str:
    """"cublas bf16->f32 NT": lhs N when it is contracted on its last dimension, rhs N on its second-to-last."""
    lhs = "N" if lhs_c == [ranks[0] - 1] else "T"
    rhs = "N" if len(ranks) > 1 and rhs_c == [ranks[1] - 2] else "T"
    return f"{engine} {in_dtype}->{out_dtype} {lhs}{rhs}"


def _bthd(a: Array) -> tuple[int, int, int, int]:
    """(batch, seq, heads, head_dim) of a cuDNN attention operand as jaxgpt passes it, (B, T, H, D)."""
    if len(a.dims) != 4:
        raise ValueError(f"unexpected attention operand {a}")
    b, t, h, d = a.dims
    return b, t, h, d


def categorize(ins: Instr, kind: str, dot_dtype: str | None) -> str:
    """The table row a kernel belongs to, from its opcode, library call and named scope (jaxgpt's
    ``jax.named_scope``s: attention, layer_norm, gelu, embed, cross_entropy, optimizer)."""
    name = ins.op_name
    if ins.opcode in COLLECTIVES:
        return "collectives"
    if "fmha" in kind:
        return "attention bwd (cuDNN)" if "Backward" in kind else "attention fwd (cuDNN)"
    if "/optimizer/" in name or name.endswith("/optimizer"):
        return "optimizer"
    if "cross_entropy" in name:
        return "lm_head + cross-entropy"
    bwd = "transpose(" in name
    if dot_dtype is not None:
        if "attention" in name:
            return "attention (einsum)"
        return "matmuls bwd" if bwd else "matmuls fwd"
    if "attention" in name:
        return "attention: casts, layout"
    if "layer_norm" in name:
        return "LayerNorm"
    if "gelu" in name:
        return "GELU"
    if "embed" in name:
        return "embedding"
    if ins.opcode in ("copy", "transpose") or "copy" in ins.name or "transpose" in ins.name \
            or "concatenate" in ins.name or "slice" in ins.name or "pad" in ins.name:
        return "copies / layout"
    return "other elementwise"


def kernels(hlo_text: str) -> tuple[list[Kernel], int]:
    """Every kernel of an optimized HLO module and the number of loops whose trip count XLA did not record."""
    r = Rollup(Module(hlo_text))
    return r.kernels, r.unknown_trip_counts
