"""From measured numbers to advice: the operational-complexity table and the recommendation rules.

Every rule is a function of the report's own rows and returns text that quotes the numbers it used; the
thresholds are the module constants below, printed in the report next to the rules.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..methods import REGISTRY, make_method, prefill_needs

ACC_DROP = 10.0  # points of retrieval accuracy below the full cache on the same examples, at most
KL_MAX = 0.1  # nats of KL(full || compressed) on the lm task, at most
SHORT_RATIO = 0.97  # throughput at short prompts relative to the full cache, at least, to call a method free there
SLOW_DECODE = 1.5  # decode step relative to the full cache above which a method is flagged for latency
RULES = [
    f"Quality holds when, at that budget, the mean retrieval accuracy (passkey, multikey) is at most {ACC_DROP:g} "
    f"points below the full cache on the same examples and the lm KL(full || compressed) is at most {KL_MAX:g} nats.",
    "Long, memory-bound contexts: the configuration with the fewest bytes held among those where quality holds "
    "(ties: lower KL).",
    "Quality first at moderate savings: at each budget, the lowest KL among configurations where retrieval holds.",
    f"Short contexts with memory headroom: a method is free there if its end-to-end throughput at the shortest "
    f"prompt is at least {SHORT_RATIO:g}x the full cache's; otherwise keep the full cache (or the cheapest "
    f"low-bit quantizer where quality holds, when memory binds even there).",
    f"Latency-bound decoding: methods whose decode step at the longest measured context exceeds {SLOW_DECODE:g}x the "
    "full cache's are flagged.",
    "Precision: a method whose KL against the full cache is within 10x of the cache-on/off floor of the same "
    "precision is indistinguishable from rounding; validate generations against a cache-on run of the same "
    "precision, since cache-on and cache-off already differ.",
    "Operations: a method that needs a calibration artifact is preferred only if its KL beats every "
    "calibration-free method at the same budget; otherwise the calibration-free one is recommended.",
]


def family(name: str) -> str:
    if "+" in name:
        return "composition"
    mod = REGISTRY[name].__module__ if name in REGISTRY else ""
    for fam in ("evict", "quant", "summary", "reconstruct"):
        if f".{fam}" in mod:
            return {"evict": "eviction", "quant": "quantization", "summary": "summarization",
                    "reconstruct": "reconstruction"}[fam]
    return "baseline" if name in ("full", "random", "streaming_llm") else "other"


def needs_artifact(name: str) -> bool:
    return any(part in REGISTRY and "artifact" in REGISTRY[part].knobs() for part in name.split("+"))


def artifact_info(knobs: dict, reconstruct_json: Path | None = None) -> dict | None:
    """Calibration seconds and artifact bytes of a method's `artifact` knob (from the artifact's own metadata)."""
    if "artifact" not in knobs:
        return None
    try:
        from ..calibrate import Artifact

        meta = Artifact.load(knobs["artifact"]).meta
        return dict(seconds=meta.get("seconds"), nbytes=meta.get("nbytes"), tokens=meta.get("knobs", {}).get("tokens"))
    except Exception:
        if reconstruct_json and reconstruct_json.is_file():
            cal = json.loads(reconstruct_json.read_text()).get("calibration", {})
            return dict(seconds=cal.get("seconds"), nbytes=cal.get("nbytes"), tokens=cal.get("knobs", {}).get("tokens"))
    return dict(seconds=None, nbytes=None, tokens=None)


def complexity(specs, rows: list[dict], scaling: list[dict], reconstruct_json: Path | None = None) -> list[dict]:
    """One row per method: family, knobs, what prefill must capture, calibration, training, measured costs."""
    out = []
    longest = max((r["length"] for r in scaling if r.get("decode_ratio") is not None), default=None)
    for name, knobs in specs:
        m = make_method(name, **knobs)
        comp = [r["compress_s"] for r in rows if r["method"] == name]
        dec = [r for r in scaling if r["method"] == name and r["length"] == longest]
        art = artifact_info(knobs, reconstruct_json)
        extras = list(prefill_needs([m]))
        if getattr(m, "needs_queries", False):
            extras.insert(0, "reference queries")
        if "+" in name:  # a composition's knobs are its parts' knobs
            names = [f"{part}.{k}" for part in name.split("+") if part in REGISTRY for k in REGISTRY[part].knobs()]
        else:
            names = [f.name for f in dataclasses.fields(m)] if dataclasses.is_dataclass(m) else []
        out.append(dict(method=name, family=family(name), knobs=[k for k in names if k != "artifact"],
                        prefill_extras=extras, calibration=art,
                        training="no" if art is None else "no (closed-form calibration fit, no gradients)",
                        compress_s=sum(comp) / len(comp) if comp else None,
                        decode_ratio=dec[0]["decode_ratio"] if dec else None, decode_length=longest))
    return out


def _quality(rows: list[dict]) -> dict:
    """(method, budget) -> {drop, kl, ratio, scores}: retrieval drop (mean over tasks) and lm KL."""
    q: dict = {}
    for r in rows:
        d = q.setdefault((r["method"], r["budget"]), dict(ratio=[], drops={}, kl=None))
        d["ratio"].append(r["ratio"])
        if "kl" in r:
            d["kl"] = r["kl"]
        else:
            d["drops"][r["task"]] = (r["full_score"] - r["score"], r["score"], r["full_score"])
    for d in q.values():
        d["ratio"] = sum(d["ratio"]) / len(d["ratio"])
        d["drop"] = sum(v[0] for v in d["drops"].values()) / len(d["drops"]) if d["drops"] else None
    return q


def _holds(d: dict) -> bool:
    return (d["drop"] is None or d["drop"] <= ACC_DROP) and (d["kl"] is None or d["kl"] <= KL_MAX)


def _cite(m: str, b: float, d: dict) -> str:
    parts = [f"{m} at budget {b:g}: {d['ratio']:.3f} of the fp16 full-cache bytes"]
    for task, (_, s, f) in d["drops"].items():
        parts.append(f"{task} {s:.0f}% (full {f:.0f}%)")
    if d["kl"] is not None:
        parts.append(f"lm KL {d['kl']:.4f} nats")
    return ", ".join(parts)


def recommend(rows: list[dict], complexity_rows: list[dict], throughput: list[dict], scaling: list[dict],
              stability: dict | None) -> list[dict]:
    """Recommendations [{"case", "advice", "evidence"}], each derived by one of RULES from the measured rows."""
    q = {k: v for k, v in _quality(rows).items() if k[0] != "full"}
    recs = []
    holding = sorted((v["ratio"], v["kl"] if v["kl"] is not None else 0.0, k) for k, v in q.items() if _holds(v))
    if holding:
        _, _, (m, b) = holding[0]
        runner_up = next((k for _, _, k in holding[1:] if family(k[0]) != family(m)), None)
        ev = _cite(m, b, q[(m, b)]) + (f". Next family: {_cite(*runner_up, q[runner_up])}" if runner_up else "")
        recs.append(dict(case="long context, memory-bound", advice=f"{m} ({family(m)}) at budget {b:g}", evidence=ev))
    else:
        recs.append(dict(case="long context, memory-bound", advice="full cache: no configuration held quality",
                         evidence="no (method, budget) met both thresholds"))
    for b in sorted({k[1] for k in q}, reverse=True):
        cands = [(v["kl"], k) for k, v in q.items() if k[1] == b and v["kl"] is not None
                 and (v["drop"] is None or v["drop"] <= ACC_DROP)]
        if cands:
            kl, (m, _) = min(cands)
            recs.append(dict(case=f"quality first at budget {b:g}", advice=f"{m} ({family(m)})",
                             evidence=_cite(m, b, q[(m, b)])))
    if any(family(r["method"]) != "other" for r in throughput):
        short = min(r["length"] for r in throughput if family(r["method"]) != "other")
        at = sorted((r for r in throughput if r["length"] == short and family(r["method"]) != "other"),
                    key=lambda r: -r["ratio_to_full"])  # methods only (not the routing policy's row)
        free = [r for r in at if r["ratio_to_full"] >= SHORT_RATIO]
        full_tok_s = at[0]["full_tok_s"]
        if free:
            r = free[0]
            recs.append(dict(case=f"short context ({short} tokens), memory headroom",
                             advice=f"{r['method']} costs nothing measurable there",
                             evidence=f"{r['tok_s']:.1f} tok/s vs full cache {r['full_tok_s']:.1f} tok/s "
                                      f"({r['ratio_to_full']:.2f}x)"))
        else:
            best = at[0]
            quant = [r for r in at if family(r["method"]) == "quantization"
                     and any(_holds(v) for k, v in q.items() if k[0] == r["method"])]
            extra = ""
            if quant:
                qr = max(quant, key=lambda r: r["ratio_to_full"])
                held = "" if qr.get("bytes_ratio") is None else f"{qr['bytes_ratio']:.3f} of the bytes, "
                extra = (f"; if memory binds even there: {qr['method']} ({held}"
                         f"{qr['ratio_to_full']:.2f}x the full cache's throughput)")
            recs.append(dict(case=f"short context ({short} tokens), memory headroom", advice="full cache" + extra,
                             evidence=f"full cache {full_tok_s:.1f} tok/s; the fastest method always on, "
                                      f"{best['method']}, reaches {best['ratio_to_full']:.2f}x (< {SHORT_RATIO:g}x)"))
    scaling = [r for r in scaling if r.get("decode_ratio") is not None]
    if scaling:
        longest = max(r["length"] for r in scaling)
        slow = sorted((r for r in scaling if r["length"] == longest and r["decode_ratio"] > SLOW_DECODE),
                      key=lambda r: -r["decode_ratio"])
        if slow:
            recs.append(dict(case="latency-bound decoding", advice="avoid " + ", ".join(r["method"] for r in slow),
                             evidence="; ".join(f"{r['method']} {r['step_ms']:.0f} ms/step vs full "
                                                f"{r['full_step_ms']:.0f} ms ({r['decode_ratio']:.2f}x) at {longest} "
                                                f"tokens" for r in slow)))
    if stability:
        for dt, v in stability.get("summary", {}).items():
            fl = v.get("floor")
            if not fl:
                continue
            close = [m for m, r in v["methods"].items() if r["kl"] <= 10 * max(fl["kl"], 1e-12)]
            first = "" if fl["first"] is None else f" (first at token {fl['first']})"
            ev = (f"{dt}: cache on vs off diverged on {fl['diverged']}/{fl['n']} prompts{first}, mismatch "
                  f"{fl['rate']:.3f}, KL {fl['kl']:.2e}, largest logit difference {fl['logit_maxdiff']:.3g}")
            adv = ("compare against a cache-on run of the same precision" if fl["diverged"] else
                   "cache on/off agree on these prompts")
            if close:
                adv += "; within rounding of the full cache: " + ", ".join(close)
            recs.append(dict(case=f"precision {dt}", advice=adv, evidence=ev))
    for c in complexity_rows:
        if c["calibration"] is None:
            continue
        m, wins, ev = c["method"], [], []
        for b in sorted({k[1] for k in q if k[0] == m}, reverse=True):
            mine = q[(m, b)]["kl"]
            free = [(v["kl"], k[0]) for k, v in q.items() if k[1] == b and v["kl"] is not None
                    and k[0] != m and not needs_artifact(k[0])]
            if mine is None or not free:
                continue
            best_kl, best = min(free)
            if mine < best_kl:
                wins.append(f"{b:g}")
            ev.append(f"{b:g}: KL {mine:.4f} vs {best} {best_kl:.4f}")
        if not ev:
            continue
        cal = c["calibration"]
        cost = (f"calibration {cal['seconds']:.0f} s, artifact {cal['nbytes'] / 2**20:.1f} MiB; "
                if cal.get("seconds") is not None and cal.get("nbytes") else "")
        adv = (f"{m} is worth its calibration at budget {', '.join(wins)}" if wins else
               f"prefer a calibration-free method over {m} at every budget")
        recs.append(dict(case=f"operations: {m}", advice=adv,
                         evidence=cost + "best calibration-free KL per budget: " + "; ".join(ev)))
    return recs
