"""Long generations: 2,048 greedy tokens on top of a compressed 1k-token context.

Checks that the cache mechanics (RoPE positions, masks, the tail, decoding-time streams) stay right over
thousands of steps and that memory stays where it is configured:

- `exact`: the full method through kvsum (its own cache class and attention wrapper) against
  transformers' DynamicCache: the 2,048 generated tokens must be identical;
- `compressed`: snapkv at 25% (the prompt compressed once, generated tokens kept in the full-precision
  tail: bytes grow by exactly one token's K and V per layer and step), kivi at 25% (generated tokens
  quantized in groups of 32 as they arrive, the 32-63 newest kept exact: bytes stay near the budget of
  everything seen) and decoding-time
  eviction (snapkv scoring holding every head at 256 entries + 64).

Per run: tokens per second, agreement with the full cache's tokens (first divergence, share equal),
non-finite logits (must be 0), bytes right after compression and at the end against the full 16-bit
cache of as many tokens, and the peak resident memory of the process. `--part` keeps locked runs short;
rows merge into benchmarks/results/stability/long_generation.{json,md}.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import kvsum
from kvsum.budget import full_nbytes
from kvsum.decoding import DecodingEviction
from kvsum.eval.text import haystack, join, sep_ids
from kvsum.shape import ModelShape

from .common import arguments, info_line, run_info, start

CONFIGS = ["snapkv 0.25", "kivi 0.25, residual 32 (generated tokens quantized)",
           "snapkv 0.25 + decoding eviction (256 + 64 per head)"]


class Finite(LogitsProcessor):
    """Counts the steps whose logits hold a NaN or a +Inf (greedy decoding would hide them; -Inf is what
    min_new_tokens puts on the end-of-sequence token)."""

    def __init__(self):
        self.bad = self.steps = 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        self.bad += int(bool(torch.isnan(scores).any() or torch.isposinf(scores).any()))
        return scores


def generate(model, ids, cache, new: int) -> tuple[torch.Tensor, float, int]:
    check = Finite()
    t0 = time.perf_counter()
    out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([check]))
    return out[0, ids.shape[1]:], time.perf_counter() - t0, check.bad


def row(name, tokens, seconds, bad, ref, cache=None, after=None, full_end=None):
    same = (tokens == ref).tolist() if ref is not None else [True] * len(tokens)
    first = next((i for i, s in enumerate(same) if not s), None)
    r = dict(config=name, new_tokens=len(tokens), tok_per_s=round(len(tokens) / seconds, 1), nonfinite_steps=bad,
             first_divergence=first, equal_share=round(sum(same) / len(same), 4),
             distinct_last_512=len(set(tokens[-512:].tolist())),
             peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    if cache is not None:
        r.update(bytes_after_compression=after, bytes_end=cache.nbytes(), full_end=full_end,
                 ratio_end=round(cache.nbytes() / full_end, 4), tokens_seen=cache.get_seq_length())
    return r


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, "stability/long_generation", threads=2)
    ap.add_argument("--part", choices=["exact", "compressed"], required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--only", type=int, nargs="+", help="compressed part: run only these configs (0, 1, 2)")
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    ids = torch.tensor([join(haystack(tok, args.context, seed=5), sep_ids(tok))])
    ctx = ids[:, :-1]  # the cached context; generate() feeds the last token (a cache covering all of ids would
    # make transformers' generate re-read the whole prompt)
    shape = ModelShape.of(model)
    full_end = full_nbytes(shape.n_layers, shape.n_kv_heads, shape.head_dim, args.context + args.new - 1)
    # (the last generated token is never cached)
    rows = []
    # the reference: transformers' own cache (its tokens kept in benchmarks/cache/ for the other part)
    saved = Path(__file__).parent / "cache" / f"long_generation_{args.model}_{args.context}_{args.new}.pt"
    if args.part == "exact" or not saved.exists():
        base = model.config._attn_implementation.removeprefix("kvsum_")
        model.set_attn_implementation(base)
        ref_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ctx, past_key_values=ref_cache)
        ref, s, bad = generate(model, ids, ref_cache, args.new)
        model.set_attn_implementation("kvsum_" + base)
        saved.parent.mkdir(exist_ok=True)
        torch.save(ref, saved)
    ref = torch.load(saved)
    if args.part == "exact":
        rows.append(row("transformers DynamicCache", ref, s, bad, None))
        cache = kvsum.compress(model, ctx, method="full")
        after = cache.nbytes()
        tokens, s, bad = generate(model, ids, cache, args.new)
        rows.append(row("kvsum full", tokens, s, bad, ref, cache, after, full_end))
    else:
        for name, make in [
            ("snapkv 0.25", lambda: kvsum.compress(model, ctx, method="snapkv", budget=0.25)),
            ("kivi 0.25, residual 32 (generated tokens quantized)",
             lambda: kvsum.compress(model, ctx, method="kivi", budget=0.25, residual=32)),
            ("snapkv 0.25 + decoding eviction (256 + 64 per head)",
             lambda: kvsum.compress(model, ctx, method="snapkv", budget=0.25).attach(
                 DecodingEviction(model, "snapkv", max_tokens=256, every=64))),
        ]:
            if args.only is not None and not any(name == CONFIGS[i] for i in args.only):
                continue
            cache = make()
            after = cache.nbytes()
            tokens, s, bad = generate(model, ids, cache, args.new)
            rows.append(row(name, tokens, s, bad, ref, cache, after, full_end))
    out = Path(args.out)
    js = out.with_name(out.name + ".json")
    old = json.loads(js.read_text()) if js.exists() else {"rows": [], "runs": []}
    info = run_info(args.model, args.threads, wall_s=round(time.perf_counter() - t0, 1), part=args.part,
                    context=args.context, new=args.new)
    mine = {r["config"] for r in rows}
    runs = [r for r in old["runs"] if r["command"] != info["command"]] + [info]
    data = {"meta": {**info, "command": None, "commands": [r["command"] for r in runs]},
            "rows": [r for r in old["rows"] if r["config"] not in mine] + rows, "runs": runs}
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(data, indent=1) + "\n")
    md = ["# Long generations", "", info_line(data["meta"]), "", __doc__.split("\n\n")[0].splitlines()[0], "",
          "| config | tok/s | non-finite steps | first divergence from full | equal to full | distinct tokens in "
          "last 512 | bytes after compression | bytes at end | / full 16-bit at end | peak RSS MiB |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        b = (f"{r['bytes_after_compression'] / 2**20:.2f} MiB | {r['bytes_end'] / 2**20:.2f} MiB | {r['ratio_end']:.3f}"
             if "bytes_end" in r else " | | ")
        md.append(f"| {r['config']} | {r['tok_per_s']} | {r['nonfinite_steps']} | {r['first_divergence']} | "
                  f"{100 * r['equal_share']:.1f}% | {r['distinct_last_512']} | {b} | {r['peak_rss_mib']} |")
    md += ["", "Full 16-bit cache at the end: "
           f"{full_end / 2**20:.2f} MiB ({args.context} + {args.new - 1} tokens).", "", "## Runs", ""]
    md += [f"- `{r['command']}` ({r['date']}, {r['wall_s']} s, threads {r['threads']})" for r in data["runs"]]
    out.with_name(out.name + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
