"""Where in the teacher-forced continuation a configuration's lm KL lies: KL(full || compressed) by position.

A continuation's first tokens read the newest prompt tokens hardest, its later ones read themselves: a KL that
sits in the first positions says the recent context was lost or coded too coarsely, one spread evenly says the
older context was (docs/results/flagship.md). Every configuration is run on the same prefilled lm examples.
"""

from __future__ import annotations

import torch

from kvsum.compress import compress_prefill
from kvsum.eval.metrics import token_kl
from kvsum.eval.runner import forced_logits, prefill_example
from kvsum.eval.tasks import get_task
from kvsum.methods import make_method
from kvsum.spec import Spec

from .common import arguments, method_rows, start, write_page

SPANS = ((0, 8), (8, 32), (32, 64), (64, 128))  # continuation positions, the lm task's 128 tokens


def by_position(model, tok, specs: list[str], budgets: list[float], length: int, n: int, seed: int) -> list[dict]:
    """One row per configuration and budget: the mean KL over the n examples, per span of positions and in all."""
    task, configs = get_task("lm"), [(name, knobs, b) for name, knobs, bs in method_rows(specs, budgets) for b in bs]
    kls: list[list[torch.Tensor]] = [[] for _ in configs]
    for ex in task.examples(tok, length, n, seed):
        pre, _, (ref, _) = prefill_example(model, tok, task, ex, configs)
        for (name, knobs, budget), out in zip(configs, kls):
            out.append(token_kl(ref, forced_logits(model, ex, compress_prefill(pre, make_method(name, **knobs),
                                                                              budget))))
    rows = []
    for (name, knobs, budget), out in zip(configs, kls):
        kl = torch.stack(out)  # (n, positions)
        spans = {f"{a}-{b}": round(kl[:, a:b].mean().item(), 4) for a, b in SPANS if a < kl.shape[1]}
        rows.append(dict(method=name, knobs=knobs, budget=budget, n=n, length=length, kl=round(kl.mean().item(), 4),
                         spans=spans, per_example=[round(v, 4) for v in kl.mean(1).tolist()]))
    return rows


def table(rows: list[dict]) -> list[str]:
    spans = list(rows[0]["spans"]) if rows else []
    out = ["| configuration | budget | KL | " + " | ".join(f"positions {s}" for s in spans) + " |",
           "|---|---|---|" + "---|" * len(spans)]
    for r in rows:
        spec = Spec(r["method"], r["knobs"])
        cells = " | ".join(f"{v:.4f}" for v in r["spans"].values())
        out.append(f"| `{spec}` | {r['budget']:g} | {r['kl']:.4f} | {cells} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "frontier/kl_positions", threads=2)
    ap.add_argument("--length", "--lengths", dest="length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=16, help="lm examples")
    ap.add_argument("--seed", type=int, default=1000, help="the dev split by default: a diagnosis chooses")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1])
    ap.add_argument("--methods", nargs="+", required=True, help="spec strings (name:knob=value,...[@budgets])")
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    rows = by_position(model, tok, args.methods, args.budgets, args.length, args.n, args.seed)
    write_page(rows, args, t0, "lm KL by continuation position", [
        f"SmolLM2 lm task, {args.length}-token prompts, {args.n} examples from seed {args.seed}: KL(full || "
        "compressed) in nats, by the continuation's positions (the first ones read the newest prompt tokens).", "",
        *table(rows)])


if __name__ == "__main__":
    main()
