"""Which HLO instruction launched each kernel of a GPU trace, also when XLA ran the step as CUDA-graph command
buffers; reading and trimming ``jax.profiler`` traces.

Outside a command buffer a kernel's trace event names its instruction (the ``hlo_op`` argument). Inside one,
``hlo_op`` is only the buffer (``command_buffer_N``, a thunk name the HLO text does not hold) and the event name is
the kernel's: for an XLA fusion its kernel name (the fusion's name with ``.`` as ``_``; XLA compiles identical
fusions once, so ``wrapped_convert.3`` runs the kernel ``wrapped_convert`` of the first of its
``deduplicated_name`` group), for a library call (cuBLAS, cuDNN) the library's kernels. Those are mapped by
position, walking the module's schedule (the entry computation's instructions in order, a while loop's body
repeated its ``known_trip_count`` times) along the events of one stream in time order:

* a fusion launches one kernel, named as one of its group (a dynamic-slice fusion may run as ``memcpy32_post``);
  a copy launches one memcpy-like event; a while loop's condition may launch nothing (a counted loop);
* a Pallas kernel (a ``__gpu$xla.gpu.triton`` custom-call) launches one kernel named as its ``pallas_call`` was
  (``gemm_nn_bias_gelu``; Triton may append ``__1``, ``__2`` to tell apart kernels of one name);
* consecutive library calls (custom-calls) take the events up to the next kernel XLA named (the names of every
  fusion of the module): each call launches one main kernel (a GEMM, the flash-attention kernel), with helpers
  before it (``Memset``, cuDNN's ``compute_dot_do_o``) or after it (``splitKreduce``, ``convert_dq``); a call's
  events begin at a ``Memset`` or at a main kernel when the call being filled already has one.

The walk restarts at the schedule's start after its end (the next step); every event must fit, and a GEMM call
must have got a GEMM, an attention call an attention kernel, or the mapping fails with the first misfit named.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
from pathlib import Path
from typing import Any

NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "fusion-done", "copy-done",
             "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "slice-done"}
MAIN_KERNEL = re.compile(r"nvjet|gemm|cutlass|xmma|s16816|hmma|wgmma|sdpa|fmha|flash", re.I)
ATTN_KERNEL = re.compile(r"cudnn|fmha|flash|sdpa", re.I)
MEMSET = re.compile(r"^memset", re.I)
MEMCPY = re.compile(r"memcpy", re.I)
HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
PALLAS_NAME = re.compile(r'\bname\s*=\s*"([^"]*)"')  # in a Pallas custom-call's backend config
DEDUP = re.compile(r"__\d+$")  # Triton's suffix on a second kernel of the same name


def kernel_name(event: str) -> str:
    """A kernel event's name less Triton's ``__N`` suffix (what a Pallas instruction's name is matched against)."""
    return DEDUP.sub("", event)


@dataclasses.dataclass
class Instr:
    """One HLO instruction: ``kind`` is a fusion's kind (kLoop, kInput, kCustom; ``__triton`` kinds appended) or a
    custom-call's target; ``shape`` its result type as printed."""

    name: str
    opcode: str
    computation: str
    op_name: str = ""
    kind: str = ""
    shape: str = ""
    calls: str = ""
    dedup: str = ""
    trip_count: int | None = None
    condition: str = ""
    body: str = ""
    text: str = ""
    pallas: str = ""  # a Pallas kernel's name (pallas_call(name=...)), "" for anything else

    @property
    def kernel(self) -> str:
        return self.name.replace(".", "_")


@dataclasses.dataclass
class Module:
    """An optimized HLO module's text, parsed: computations (instructions in schedule order) and the entry."""

    name: str
    entry: str
    computations: dict[str, list[Instr]]
    instrs: dict[str, Instr]
    with_dot: set[str]  # computations holding a dot or convolution (a fusion calling one is a GEMM)
    lines: dict[str, list[str]]  # each computation's instruction lines

    def fingerprint(self, comp: str) -> str:
        """A computation's text without names and metadata: fusions with equal fingerprints compile to one
        kernel (XLA's kernel reuse), launched under the name of the first."""
        ids: dict[str, str] = {}

        def canon(m: re.Match) -> str:
            return ids.setdefault(m.group(1), f"%{len(ids)}")

        body = [re.sub(r",?\s*metadata=\{[^}]*\}", "", ln) for ln in self.lines.get(comp, [])]
        return "\n".join(re.sub(r"%([\w.\-]+)", canon, ln) for ln in body)

    def fused_op_names(self, ins: Instr) -> list[str]:
        return [i.op_name for i in self.computations.get(ins.calls, []) if i.op_name]

    def is_gemm(self, ins: Instr) -> bool:
        if ins.opcode == "custom-call":
            return "matmul" in ins.kind or "gemm" in ins.kind.lower() or "cublas" in ins.kind.lower()
        return ins.opcode in ("dot", "convolution") or (ins.opcode in ("fusion", "fusion-start")
                                                         and ins.calls in self.with_dot)


def parse(hlo: str) -> Module:
    """Parse an optimized HLO module's text (``compiled.as_text()``)."""
    first = hlo.lstrip().splitlines()[0] if hlo.strip() else ""
    m = re.match(r"HloModule\s+([\w.\-]+)", first)
    if not m:
        raise ValueError("not an HLO module's text (its first line should be 'HloModule NAME, ...')")
    comps: dict[str, list[Instr]] = {}
    lines: dict[str, list[str]] = {}
    instrs, with_dot, cur, entry = {}, set(), None, ""
    for line in hlo.splitlines():
        h = HEAD.match(line)
        if h:
            cur = h.group(1)
            comps[cur], lines[cur] = [], []
            if line.startswith("ENTRY"):
                entry = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        i = INSTR.match(line) if cur else None
        if not i:
            continue
        _, name, shape, opcode, rest = i.groups()
        ins = Instr(name=name, opcode=opcode, computation=cur, shape=shape, text=line)
        if (g := re.search(r'op_name="([^"]*)"', rest)):
            ins.op_name = g.group(1)
        if (g := re.search(r'custom_call_target="([^"]*)"', rest)):
            ins.kind = g.group(1)
            if "xla.gpu.triton" in ins.kind and (g := PALLAS_NAME.search(rest)):
                ins.pallas = g.group(1)
        elif (g := re.search(r"kind=(k\w+)", rest)):
            ins.kind = g.group(1) + (" __triton" + ("_gemm" if "triton_gemm" in rest else "")
                                     if '"kind":"__triton' in rest else "")
        if (g := re.search(r"calls=%?([\w.\-]+)", rest)):
            ins.calls = g.group(1)
        if (g := re.search(r'deduplicated_name="([^"]*)"', rest)):
            ins.dedup = g.group(1)
        if (g := re.search(r"condition=%?([\w.\-]+), body=%?([\w.\-]+)", rest)):
            ins.condition, ins.body = g.groups()
        if (g := re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)):
            ins.trip_count = int(g.group(1))
        if opcode in ("dot", "convolution"):
            with_dot.add(cur)
        comps[cur].append(ins)
        lines[cur].append(line.replace("ROOT ", "", 1))
        instrs[name] = ins
    if not entry:
        raise ValueError("the HLO text has no ENTRY computation")
    return Module(name=m.group(1), entry=entry, computations=comps, instrs=instrs, with_dot=with_dot, lines=lines)


@dataclasses.dataclass
class Launch:
    """One execution of an instruction in the schedule: ``library`` for a custom-call (any number of library
    kernels), ``optional`` for a while condition's kernels (a counted loop may not run them)."""

    instr: Instr
    library: bool
    optional: bool = False


def schedule(mod: Module) -> list[Launch]:
    """The launches of one execution of the module, in order."""
    out: list[Launch] = []

    def walk(comp: str, optional: bool) -> None:
        for ins in mod.computations[comp]:
            if ins.opcode in NO_LAUNCH:
                continue
            if ins.opcode == "while":
                if ins.trip_count is None:
                    raise ValueError(f"while loop {ins.name} has no known_trip_count: its launches per step are "
                                     "unknown")
                for _ in range(ins.trip_count):
                    walk(ins.condition, True)
                    walk(ins.body, optional)
                walk(ins.condition, True)
            elif ins.opcode in ("call", "async-start") and ins.calls:
                walk(ins.calls, optional)
            elif ins.opcode == "conditional":
                for b in re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", ins.text).group(1)
                                    if "branch_computations" in ins.text else ""):
                    walk(b, True)
            else:
                out.append(Launch(ins, library=ins.opcode == "custom-call" and not ins.pallas, optional=optional))

    walk(mod.entry, False)
    return out


class MappingError(ValueError):
    pass


def _groups(mod: Module, launches: list[Launch]) -> dict[str, set[str]]:
    """instruction name -> the kernel names it may run under: those of the fusions with the same fingerprint (a
    Pallas kernel: its pallas_call name)."""
    members: dict[str, set[str]] = {}
    key = {}
    for la in launches:
        ins = la.instr
        if ins.name not in key:
            key[ins.name] = ("pallas", ins.pallas) if ins.pallas else mod.fingerprint(ins.calls) if ins.calls \
                else ins.name
            members.setdefault(key[ins.name], set()).add(ins.pallas or ins.kernel)
    return {n: members[k] for n, k in key.items()}


def _split_library(events: list[dict], calls: list[Launch]) -> list[list[dict]]:
    """Divide the library events between consecutive custom-calls (see the module's docstring)."""
    if len(calls) == 1:
        return [events]
    parts: list[list[dict]] = []
    has_main = False
    for e in events:
        main = bool(MAIN_KERNEL.search(e["name"]))
        if not parts or MEMSET.search(e["name"]) and has_main or main and has_main:
            parts.append([])
            has_main = False
        parts[-1].append(e)
        has_main = has_main or main
    if len(parts) != len(calls):
        raise MappingError(f"{len(events)} library kernels ({', '.join(e['name'][:40] for e in events[:6])}...) "
                           f"split into {len(parts)} calls, the schedule has {len(calls)} here "
                           f"({', '.join(c.instr.name for c in calls)})")
    return parts


def _check_library(call: Launch, evs: list[dict], mod: Module) -> None:
    mains = [e["name"] for e in evs if MAIN_KERNEL.search(e["name"])]
    attn = "fmha" in call.instr.kind or "cudnn" in call.instr.kind.lower()
    if not evs or (mod.is_gemm(call.instr) and not any(not ATTN_KERNEL.search(n) for n in mains)) \
            or (attn and not any(ATTN_KERNEL.search(n) for n in mains)):
        raise MappingError(f"{call.instr.name} ({call.instr.kind}) got kernels {[e['name'][:50] for e in evs]}")


def align(events: list[dict], mod: Module,
          skip: set[str] = frozenset()) -> tuple[list[tuple[dict, Instr]], int, collections.Counter]:
    """Map command-buffer events (one stream, in time order; each {"name", ...}) to the instructions of ``mod``'s
    schedule, less the instructions in ``skip`` (those that ran outside a command buffer, named by their events).
    Returns (event, instruction) pairs of the whole steps the events cover (a partial last step is left out), their
    number, and how often each instruction ran in them; raises MappingError naming the first event that does not
    fit."""
    sched = [la for la in schedule(mod) if la.instr.name not in skip]
    if not sched:
        raise MappingError("the module's schedule launches nothing")
    names = _groups(mod, sched)
    xla_names = set().union(*(names[la.instr.name] for la in sched if not la.library))
    pallas = {la.instr.name for la in sched if la.instr.pallas}

    def named(event: str, instr: str) -> bool:  # the event is a kernel of the instruction (Pallas: less __N)
        return event in names[instr] or (instr in pallas and kernel_name(event) in names[instr])

    def xla_named(event: str) -> bool:
        return event in xla_names or kernel_name(event) in xla_names
    out: list[tuple[dict, Instr]] = []
    runs: collections.Counter = collections.Counter()
    i, steps, n = 0, 0, len(events)
    while i < n:
        start, k, ran = i, 0, collections.Counter()
        while k < len(sched) and i < n:
            la = sched[k]
            if la.library:
                calls = [la]
                while k + len(calls) < len(sched) and sched[k + len(calls)].library:
                    calls.append(sched[k + len(calls)])
                j = i
                while j < n and not xla_named(events[j]["name"]) and not MEMCPY.search(events[j]["name"]):
                    j += 1
                if j == i:
                    raise MappingError(f"event {i} ({events[i]['name'][:60]}): expected the library kernels of "
                                       f"{calls[0].instr.name}")
                for call, part in zip(calls, _split_library(events[i:j], calls)):
                    _check_library(call, part, mod)
                    out += [(e, call.instr) for e in part]
                    ran[call.instr.name] += 1
                i, k = j, k + len(calls)
                continue
            name = events[i]["name"]
            copyish = la.instr.opcode in ("copy", "copy-start", "fusion-start") or "dynamic" in la.instr.calls
            if named(name, la.instr.name) or (copyish and MEMCPY.search(name)):
                out.append((events[i], la.instr))
                ran[la.instr.name] += 1
                i += 1
            elif not la.optional:
                raise MappingError(f"event {i} ({name[:60]}, step {steps + 1}): expected {la.instr.name} "
                                   f"(kernel {sorted(names[la.instr.name])[:3]})")
            k += 1
        if k < len(sched) and any(not la.optional for la in sched[k:]):
            if steps == 0:
                raise MappingError(f"the trace ends inside the first step (at {sched[k].instr.name})")
            del out[len(out) - (i - start):]  # a partial last step: left out
            break
        steps += 1
        runs.update(ran)
    return out, steps, runs


def gpu_events(trace: dict[str, Any] | list) -> list[dict]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in procs.items() if "/device:GPU" in name}
    out = []
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e["pid"] in gpu_pids:
            args = e.get("args", {})
            out.append({"name": e["name"], "hlo_op": args.get("hlo_op") or args.get("long_name", "").split(":")[0],
                        "hlo_module": args.get("hlo_module", ""), "ts": float(e["ts"]), "dur": float(e["dur"])})
    out.sort(key=lambda e: (e["ts"], -e["dur"]))
    return out


def map_events(trace: dict[str, Any] | list, mod: Module) -> dict[str, Any]:
    """Every device event of ``trace`` with the instruction that launched it: {"pairs": [(event, Instr | None)],
    "source", "steps" (whole steps found by the command-buffer walk; None where there was none), "mapping"
    (how: by hlo_op, by the command-buffer walk, or why the walk failed), "executions" (the walk's count of each
    instruction's runs; None without a walk)}. GPU kernels (events of a ``/device:GPU``
    process) where there are any, else XLA:CPU thunks (host events named like an HLO instruction)."""
    evs = gpu_events(trace)
    if not evs:
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        cpu = [{"name": e["name"], "hlo_op": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])}
               for e in events if e.get("ph") == "X" and "dur" in e and e["name"] in mod.instrs]
        return {"pairs": [(e, mod.instrs[e["hlo_op"]]) for e in cpu], "source": "XLA:CPU thunks", "steps": None,
                "mapping": "thunk names", "executions": None}
    direct = [e for e in evs if e["hlo_op"] in mod.instrs]
    buffered = [e for e in evs if e["hlo_op"] not in mod.instrs and e["hlo_module"] == mod.name]
    pairs = [(e, mod.instrs[e["hlo_op"]]) for e in direct]
    steps, how, runs = None, "hlo_op", None
    if buffered:
        try:
            walked, steps, runs = align(buffered, mod, skip={e["hlo_op"] for e in direct})
            pairs += walked
            how = "command buffers walked along the HLO schedule"
        except MappingError as err:
            how = f"command-buffer walk failed ({err}); only kernel names matched"
            kern = {i.kernel: i for i in mod.instrs.values()}
            pairs += [(e, kern.get(e["name"])) for e in buffered]
    seen = {id(e) for e, _ in pairs}
    pairs += [(e, None) for e in evs if id(e) not in seen]  # other modules, memcpys outside any module
    pairs.sort(key=lambda p: (p[0]["ts"], -p[0]["dur"]))
    return {"pairs": pairs, "source": "GPU kernels", "steps": steps, "mapping": how, "executions": runs}


def exclusive_us(events: list[dict]) -> list[float]:
    """Each event's time not already covered by an event that started before it (events in start order): the
    device-busy time, divided so that the parts sum to ``busy_union`` (kernels a CUDA graph runs side by side
    overlap a little)."""
    out, end = [], float("-inf")
    for e in events:
        stop = e["ts"] + e["dur"]
        out.append(max(0.0, stop - max(e["ts"], end)))
        end = max(end, stop)
    return out


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def read_trace(path: Path) -> dict[str, Any]:
    """A trace file (``.json`` or ``.json.gz``) or the newest ``*.trace.json.gz`` under a directory."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace file or directory")
    if path.is_dir():
        return load_trace(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def load_trace(trace_dir: Path) -> dict[str, Any]:
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir} "
                                "(jax.profiler.trace(create_perfetto_trace=True))")
    with gzip.open(files[-1]) as f:
        return json.load(f)


def trim_to_one_step(trace: dict[str, Any], hlo: str, out: Path) -> dict[str, Any]:
    """Write a copy of ``trace`` (gzipped) holding one step: the GPU events of the traced step whose device-busy
    time is the median of all, with only the arguments the summariser reads (and the kernels' launch shapes),
    and the process/thread names; host events are dropped. Returns what was kept."""
    mod = parse(hlo)
    m = map_events(trace, mod)
    if not m["steps"]:
        raise ValueError(f"no whole step found by the command-buffer walk ({m['mapping']}): nothing to trim to")
    walked = [e for e, i in m["pairs"] if i is not None and e["hlo_op"] not in mod.instrs]
    per = len(walked) // m["steps"]
    chunks = [walked[k * per:(k + 1) * per] for k in range(m["steps"])]
    busy = [sum(e["dur"] for e in c) for c in chunks]
    pick = sorted(range(len(chunks)), key=lambda k: busy[k])[len(chunks) // 2]
    lo, hi = chunks[pick][0]["ts"], max(e["ts"] + e["dur"] for e in chunks[pick])
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "/device:GPU" in e.get("args", {}).get("name", "")}
    keep_args = ("hlo_op", "hlo_module", "cuda_graph_id", "cuda_graph_node_id", "kernel_details", "long_name")
    kept = [e for e in events if e.get("ph") == "M"]
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and lo <= float(e["ts"]) < hi:
            kept.append({**{k: e[k] for k in ("ph", "pid", "tid", "ts", "dur", "name")},
                         "args": {k: v for k, v in e.get("args", {}).items() if k in keep_args}})
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"displayTimeUnit": "ns", "traceEvents": kept}, separators=(",", ":"))
    with open(out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:  # same bytes
        f.write(text.encode())
    return {"step": pick + 1, "of_steps": m["steps"], "events": len(kept), "busy_ms": busy[pick] / 1e3}
