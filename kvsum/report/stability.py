"""The markdown of a `kvsum stability` result (kvsum/stability.py): the precision floor per dtype, the per-layer
drift, and each method against the full cache of its precision."""

from __future__ import annotations


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    s = result["settings"]
    fewer = ", ".join(f"{d}: {v}" for d, v in s.get("dtype_prompts", {}).items() if v < s["prompts"])
    parts = [f"# Numerical stability: {s['model']}", "",
             f"{s['prompts']} prose prompts" + (f" ({fewer})" if fewer else "") +
             f" of {s['prompt_tokens']} tokens, {s['new_tokens']} greedy tokens; "
             f"methods at budget {s['budget']} (entries stored in fp16). "
             + ("" if result["complete"] else "**Incomplete: run the same command again to finish.** "), "",
             "Precision floor: cache-on (DynamicCache) vs cache-off (full recomputation every step). "
             "diverged: prompts whose two greedy generations differ; first: earliest differing position; "
             "mismatch: fraction of generated positions that differ. KL / top-1: teacher-forced on the cache-off "
             "tokens over the decode steps. vs fp32: cache-on generation of this precision against fp32's."
             + (f" **{', '.join(s.get('onepass', []))}: cache-off in one teacher-forced pass** over the cache-on "
                "generation (each position sees only its prefix, computed without a cache; one pass instead of one "
                "per step, which fp16 matmuls on CPU, ~10x slower than fp32, make unaffordable): there diverged, "
                "first and mismatch count positions whose cache-off argmax after the same prefix differs."
                if s.get("onepass") else ""), ""]
    head = "| precision | diverged | first | mismatch | KL (nats) | top-1 % | max logit diff | " \
           "hidden rel. err (mean / last layer) | vs fp32 mismatch |"
    lines = [head, "|" + "---|" * 9]
    for dt, v in result["summary"].items():
        r = v["floor"]
        if r is None:
            continue
        hr = r["hidden_rel"]
        lines.append(f"| {dt} | {r['diverged']}/{r['n']} | {_f(r['first'], 'd')} | {r['rate']:.3f} | {r['kl']:.2e} | "
                     f"{r['top1']:.1f} | {r['logit_maxdiff']:.3g} | {sum(hr) / len(hr):.2e} / {hr[-1]:.2e} | "
                     f"{_f(r.get('vs_fp32_rate'))} |")
    parts += [*lines, "", "Per-layer relative error of the last position's hidden state, cache on vs off "
              "(mean over prompts and decode steps), every 5th layer:", ""]
    floors = {dt: v["floor"] for dt, v in result["summary"].items() if v["floor"]}
    if floors:
        n_l = len(next(iter(floors.values()))["hidden_rel"])
        idx = sorted(set(list(range(0, n_l, 5)) + [n_l - 1]))
        parts += ["| precision | " + " | ".join(f"L{j}" for j in idx) + " |", "|---|" + "---|" * len(idx)]
        parts += [f"| {dt} | " + " | ".join(f"{r['hidden_rel'][j]:.1e}" for j in idx) + " |"
                  for dt, r in floors.items()]
    parts += ["", f"Compression against the full kvsum cache of the same precision (budget {s['budget']}); "
              "the floor row repeats cache on vs off for scale.", ""]
    lines = ["| precision | method | bytes / 16-bit full cache | diverged | first | mismatch | KL (nats) | top-1 % |",
             "|" + "---|" * 8]
    for dt, v in result["summary"].items():
        r = v["floor"]
        if r:
            lines.append(f"| {dt} | *floor: cache on vs off* | 1 | {r['diverged']}/{r['n']} | {_f(r['first'], 'd')} | "
                         f"{r['rate']:.3f} | {r['kl']:.2e} | {r['top1']:.1f} |")
        for name, m in sorted(v["methods"].items(), key=lambda kv: kv[1]["kl"]):
            lines.append(f"| {dt} | {name} | {m['ratio']:.3f} | {m['diverged']}/{m['n']} | {_f(m['first'], 'd')} | "
                         f"{m['rate']:.3f} | {m['kl']:.2e} | {m['top1']:.1f} |")
    parts += lines
    if result["errors"]:
        parts += ["", "Errors:", ""] + [f"- {dt} {k}: {e}" for dt, d in result["errors"].items() for k, e in d.items()]
    return "\n".join(parts) + "\n"
