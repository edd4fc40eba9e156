"""How closely each cache reproduces the full cache's own answer: its values' tokens, teacher-forced.

String-match recall moves 25 points an example on the long suite's list tasks, too coarse to tell apart codes that
differ in how well they copy a value. Here the full cache answers first (greedy, as long_suite scores it) and every
configuration is teacher-forced on that answer: the mean negative log-likelihood of the tokens that spell the
expected values the full cache gave (the copy), how many of those tokens its argmax misses, and the NLL of the
expected values written out as the task's reference answer (the same for every cache, whatever the full cache
said). Each example is prefilled once; every configuration compresses that prefill. Paired over the same examples.
"""

from __future__ import annotations

import copy
import statistics

import torch

import kvsum
from kvsum.eval.runner import prompt_length
from kvsum.eval.tasks import DEPTHS, example_seed, get_task
from kvsum.methods import make_method, prefill_needs
from kvsum.stability import DTYPES

from .common import arguments, start, write_page
from .diagnose import build
from .long_suite import answer, configs


@torch.no_grad()
def forced_nll(model, prefix: torch.Tensor, target: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Per target token (1, n) after `prefix` (1, q) on top of `cache`: its NLL and whether the argmax is it."""
    q = prefix.shape[1]
    logits = model(torch.cat([prefix, target], -1), cache=cache, use_cache=True).logits[0, q - 1:-1].float()
    nll = -logits.log_softmax(-1).gather(1, target[0][:, None])[:, 0]
    return nll, logits.argmax(-1) == target[0]


def value_mask(tok, ids: torch.Tensor, text: str, values) -> torch.Tensor:
    """(n,) which of the answer's tokens overlap a span where one of `values` is spelled in `text`."""
    spans = [(i, i + len(v)) for v in values if (i := text.find(v)) >= 0]
    ends = [len(tok.decode(ids[0, :j + 1])) for j in range(ids.shape[1])]
    return torch.tensor([any(s < b and e > a for a, b in spans) for s, e in zip([0, *ends[:-1]], ends)], dtype=bool)


def run(model, tok, args) -> list[dict]:
    cfgs = [c for c in configs(args.methods, [0.25]) if c[1] != "full"]
    built = [build(name, **knobs) for _, name, knobs, _ in cfgs]
    opts = prefill_needs(built)
    recs = []
    for i in range(args.n):
        for task in (get_task(name, chat=True) for name in args.tasks):
            ex = task.example(tok, prompt_length(model, task, args.length), example_seed(args.seed, i),
                              DEPTHS[i % len(DEPTHS)])
            pre = kvsum.prefill(model, ex.context_ids, tokenizer=tok, **opts)
            full = kvsum.compress_prefill(pre, make_method("full"), 1.0)
            score, text = answer(model, tok, task, ex, copy.deepcopy(full))
            said = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            mask = value_mask(tok, said, text, ex.expected)
            ref = tok(ex.answer, add_special_tokens=False, return_tensors="pt").input_ids
            caches = [("full", 1.0, full)] + [(label, b, kvsum.compress_prefill(pre, m, b))
                                              for (label, _, _, b), m in zip(cfgs, built)]
            for label, budget, cache in caches:
                nll, hit = forced_nll(model, ex.question_ids, said, copy.deepcopy(cache))
                ref_nll, _ = forced_nll(model, ex.question_ids, ref, cache)
                recs.append(dict(task=task.name, index=i, config=label, budget=budget, full_score=score,
                                 value_tokens=int(mask.sum()), value_nll=float(nll[mask].sum()),
                                 value_misses=int((~hit[mask]).sum()), reference_nll=float(ref_nll.mean()),
                                 bytes=cache.nbytes() / cache.reference_nbytes))
            print(f"{task.name} #{i}: full {score:.2f}, {int(mask.sum())} value tokens", flush=True)
    return recs


def rows_of(recs: list[dict]) -> list[dict]:
    """Per configuration, over the examples: value-token NLL (pooled over tokens), its excess over the full
    cache's, the examples where it is below the cover's (the first configuration after full), argmax misses, and
    the reference answer's NLL."""
    out, labels = [], list(dict.fromkeys((r["config"], r["budget"]) for r in recs))
    by = {key: [r for r in recs if (r["config"], r["budget"]) == key] for key in labels}
    tokens = max(1, sum(r["value_tokens"] for r in by[labels[0]]))  # none where the full cache answered nothing
    full = sum(r["value_nll"] for r in by[labels[0]]) / tokens
    first = by[labels[1]] if len(labels) > 1 else by[labels[0]]
    for key in labels:
        rs = by[key]
        nll = sum(r["value_nll"] for r in rs) / tokens
        lower = sum(r["value_nll"] < f["value_nll"] for r, f in zip(rs, first) if r["value_tokens"])
        out.append(dict(config=key[0], budget=key[1], examples=len(rs), value_tokens=tokens,
                        bytes=round(statistics.mean(r["bytes"] for r in rs), 3), value_nll=round(nll, 4),
                        excess=round(nll - full, 4), below_first=lower,
                        answered_examples=sum(r["value_tokens"] > 0 for r in rs),
                        value_misses=sum(r["value_misses"] for r in rs),
                        reference_nll=round(statistics.mean(r["reference_nll"] for r in rs), 4)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "long/answer_nll", threads=2)
    ap.add_argument("--tasks", nargs="+", default=["niah_multikey_code", "niah_multivalue", "niah_multiquery",
                                                   "niah_multikey"])
    ap.add_argument("--length", "--lengths", dest="length", type=int, default=16384)
    ap.add_argument("--n", type=int, default=4, help="examples a task")
    ap.add_argument("--seed", type=int, default=1000, help="the dev split by default: a diagnosis chooses")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--methods", nargs="+", required=True, help="spec strings (name:knob=value,...@budget)")
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    recs = run(model, tok, args)
    rows = rows_of(recs)
    table = ["| configuration | budget | bytes held | value-token NLL | over the full cache's | examples below "
             f"`{rows[1]['config'] if len(rows) > 1 else 'full'}` | argmax misses | reference answer NLL |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| `{r['config']}` | {r['budget']:g} | {r['bytes']:.3f} | {r['value_nll']:.4f} | {r['excess']:+.4f} | "
              f"{r['below_first']} of {r['answered_examples']} | {r['value_misses']} | {r['reference_nll']:.4f} |"
              for r in rows]
    write_page(rows, args, t0, "Teacher-forced answers: how closely each cache copies the full cache's values", [
        f"{args.model} ({args.dtype}, chat format), {args.length}-token prompts, tasks {', '.join(args.tasks)}, "
        f"{args.n} examples a task from seed {args.seed}; {rows[0]['value_tokens']} value tokens in the full cache's "
        "answers (examples where it gave none count only in the reference NLL).", "", *table], records=recs)


if __name__ == "__main__":
    main()
