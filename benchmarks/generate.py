"""Generation benchmark: jaxgpt (KV cache) vs torch_ref (plain generate, NO cache) vs transformers (KV cache).

    python -m benchmarks.generate                          # gpt2 124M random init, 1 and 8 prompts, 128 new tokens
    python -m benchmarks.generate --prompts 1 --rounds 1 --variants jax_bf16_cache,hf_bf16_cache

Each (variant, prompt count, round) runs in its own subprocess with the same environment, round-robin. A
worker generates once cold (includes jit compilation for jaxgpt), then ``--repeats`` timed generations;
tokens/s = prompts x new tokens / seconds (prefill included). Sampling: temperature 1, top_k 50, no early stop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks.gen_impl import GEN_VARIANTS


def run(*, preset: str, prompt_counts: list[int], variants: list[str], new: int, prompt_len: int, rounds: int,
        repeats: int, allocator: str, log=print) -> dict[str, Any]:
    init = common.ensure_init(preset)
    env = common.worker_env(allocator)
    started, load_start = time.time(), common.loadavg()
    raw: dict[str, list[dict]] = {}
    # variants whose precision this machine cannot run in reasonable time (torch bf16 without avx512_bf16/AMX)
    skip = common.unusable_variants(variants, env, log=log)
    for v, why in skip.items():
        for n in prompt_counts:
            raw[f"{v}@{n}"] = [common.skipped_row(why)]
    variants = [v for v in variants if v not in skip]
    for r in range(rounds if variants else 0):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for n in prompt_counts:
            for v in order:
                spec = {"task": "generate", "variant": v, "config": preset, "num_prompts": n, "max_new_tokens": new,
                        "prompt_len": prompt_len, "init": str(init),
                        # plain recompute without a cache is eager and slow: its single run is the sample
                        "repeats": 0 if v == "torch_ref_fp32_nocache" else repeats}
                res = common.run_worker(spec, env)
                res["round"] = r
                raw.setdefault(f"{v}@{n}", []).append(res)
                if "error" in res:
                    log(f"  round {r + 1} {v} x{n}: ERROR {res['error'][-600:]}")
                else:
                    t = statistics.median(res["times_s"])
                    log(f"  round {r + 1} {v:24s} x{n}: {res['new_tokens'] / t:8.1f} tok/s  ({t:.2f} s, cold "
                        f"{res['cold_s']:.1f} s, rss {res['peak_rss_mib']:.0f} MiB, load {res['loadavg_start'][0]:.1f})")
    rows = {}
    for key, runs in raw.items():
        ok = [x for x in runs if "error" not in x]
        if not ok:
            rows[key] = runs[0] if runs[0].get("skipped") else {"error": runs[0]["error"]}
            continue
        times = [t for x in ok for t in x["times_s"]]
        st = common.summarize(times)
        ntok = ok[0]["new_tokens"]
        rows[key] = {"variant": ok[0]["variant"], "num_prompts": ok[0]["num_prompts"], "impl": ok[0].get("impl"),
                     "time_s": st, "tokens_per_s": {"median": ntok / st["median"], "min": ntok / st["max"],
                                                    "max": ntok / st["min"]},
                     "cold_s": statistics.median(x["cold_s"] for x in ok),
                     "peak_rss_mib": max(x["peak_rss_mib"] for x in ok),
                     "loadavg": [x["loadavg_start"][0] for x in ok]}
    for n in prompt_counts:
        hf = [rows[k]["tokens_per_s"]["median"] for k in rows if k.endswith(f"@{n}") and k.startswith("hf_")
              and "error" not in rows[k]]
        for k, row in rows.items():
            if k.endswith(f"@{n}") and "error" not in row and hf:
                row["vs_fastest_hf"] = row["tokens_per_s"]["median"] / max(hf)
    return {"benchmark": "generate", "preset": preset, "prompt_counts": prompt_counts, "max_new_tokens": new,
            "prompt_len": prompt_len, "rounds": rounds, "repeats": repeats, "allocator": allocator, "rows": rows,
            "machine": common.cpu_info(), "versions": common.versions(), "env": common.recorded_env(env),
            "git": common.git_rev(), "uncommitted_library_files": common.dirty_files(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "duration_s": time.time() - started, "loadavg_start": load_start, "loadavg_end": common.loadavg(),
            "command": common.command_line(), "raw": raw}


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"**generate**: preset `{res['preset']}` (random init), prompt length {res['prompt_len']}, "
        f"{res['max_new_tokens']} new tokens, temperature 1, top_k 50; allocator `{res['allocator']}`; "
        f"{res['rounds']} rounds x {res['repeats']} timed generations after a cold one (torch_ref without a "
        f"cache: its one eager run per round is timed); load avg "
        f"{res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}; {res['started']}, git {res['git']}.",
        "",
        "| variant | prompts | new tok/s median | min-max | s per generate | cold s | peak RSS MiB | vs fastest HF | implementation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, r in sorted(res["rows"].items(), key=lambda kv: (int(kv[0].split("@")[1]), kv[0])):
        v, n = key.split("@")
        if "error" in r:
            what = r["error"] if r.get("skipped") else f"error: {r['error'][-150:]}"
            lines.append(f"| {v} | {n} | {what.replace('|', '/').replace(chr(10), ' ')} |||||||")
            continue
        t = r["tokens_per_s"]
        lines.append(f"| {v} | {n} | {t['median']:,.1f} | {t['min']:,.1f}-{t['max']:,.1f} | {r['time_s']['median']:.2f} "
                     f"| {r['cold_s']:.1f} | {r['peak_rss_mib']:,.0f} | {r.get('vs_fastest_hf', 0):.2f}x | {r['impl']} |")
    return "\n".join(lines)


def save(res: dict[str, Any], name: str = "generate") -> None:
    common.save_result(name, res, markdown(res))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--prompts", default="1,8", help="comma list of prompt counts (batch sizes)")
    p.add_argument("--variants", default="all", help=f"all, or a comma list of {GEN_VARIANTS}")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="timed generations per worker (after a cold one)")
    p.add_argument("--allocator", default="tuned", choices=sorted(common.ALLOCATORS))
    p.add_argument("--out", default="generate")
    a = p.parse_args(argv)
    variants = GEN_VARIANTS if a.variants == "all" else [v.strip() for v in a.variants.split(",")]
    bad = [v for v in variants if v not in GEN_VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; valid: {GEN_VARIANTS}")
    counts = [int(n) for n in a.prompts.split(",")]
    print(f"generate: {variants}, prompts {counts}, load {common.loadavg()}", flush=True)
    res = run(preset=a.preset, prompt_counts=counts, variants=variants, new=a.new_tokens, prompt_len=a.prompt_len,
              rounds=a.rounds, repeats=a.repeats, allocator=a.allocator, log=lambda s: print(s, flush=True))
    save(res, a.out)
    print(markdown(res))
    return 1 if any(common.failed(r) for r in res["rows"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
