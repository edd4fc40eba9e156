"""What every evaluation benchmark script shares: its standard arguments and how it writes its results."""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval import write

RESULTS = Path(__file__).parent / "results"


def arguments(doc: str, name: str, threads: int) -> argparse.ArgumentParser:
    """A parser with --model, --threads and --out (default benchmarks/results/<name>)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default=str(RESULTS / name))
    return ap


def start(args):
    """Set the thread count, load the model; returns (model, tokenizer, start time)."""
    torch.set_num_threads(args.threads)
    model, tok = kvsum.load_model(args.model)
    return model, tok, time.perf_counter()


def finish(rows: list[dict], args, t0: float) -> None:
    """Write rows as JSON + markdown with the command line, threads and wall time, and print the table."""
    js, md = write(rows, args.out, model=args.model, command=" ".join(["python", *sys.argv]),
                   threads=args.threads, wall_s=round(time.perf_counter() - t0, 1))
    print(md.read_text())
    print(f"wrote {js} and {md}")


def parse_method(text: str) -> tuple[str, dict]:
    """A method given as `name` or `name:knob=value,knob=value` (values as Python literals, else strings)."""
    name, _, rest = text.partition(":")
    knobs = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            knobs[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            knobs[k] = v
    return name, knobs


@torch.no_grad()
def paired_decode(model, caches: list, tokens: torch.Tensor, skip: int = 2) -> list[list[float]]:
    """Decode `tokens` (1, n) one at a time on top of every cache, step t of every cache back to back (order
    rotated), so the load of a shared machine hits them alike. Returns each cache's step seconds, aligned
    across caches, without the first `skip` steps (warm-up). The caches grow as in generate."""
    times = [[] for _ in caches]
    for t in range(tokens.shape[1]):
        order = list(range(len(caches)))
        for i in order[t % len(order):] + order[:t % len(order)]:
            t0 = time.perf_counter()
            model(tokens[:, t:t + 1], cache=caches[i])
            times[i].append(time.perf_counter() - t0)
    return [ts[skip:] for ts in times]


def paired_medians(times: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per cache: the median step seconds and the median over steps of its step time over the first cache's."""
    return ([statistics.median(ts) for ts in times],
            [statistics.median(a / b for a, b in zip(ts, times[0])) for ts in times])
