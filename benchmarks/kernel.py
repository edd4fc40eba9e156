"""The packed-code kernel (kvsum/methods/quant/codes.c) against the PyTorch lookup path and exact attention.

Per layer and decoding step: TurboQuant's rotated-path scores and mix over T coded tokens (one query token,
G query rows per KV head), through the kernel and through the PyTorch path that expands every code to a
float first (the same state, the kernel switched off), beside exact fp32 attention over the same T tokens
(what the full cache pays for its attention). Shapes of the bundled models: SmolLM2 (3 KV heads, head dim
64, 3 query rows) and Gemma 3 (1 KV head, head dim 256, 4 rows). The timed calls of a row are interleaved
round by round and their medians taken, so the ratios come from one run. Codes are of random data: timing
does not depend on their values. Writes benchmarks/results/quant/quant_kernel.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvsum.methods.quant import native
from kvsum.methods.quant.turboquant import TurboQuant

from .common import info_line, run_info
from .experiments import RESULTS

SHAPES = {"smollm2": (3, 64, 3), "gemma3": (1, 256, 4)}  # KV heads, head dim, query rows per KV head


def _exact(q, k, v, scale):
    return torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v


def _lookup(fn):
    saved, native.usable = native.usable, lambda *a: False
    try:
        return fn()
    finally:
        native.usable = saved


def measure(shape: str, T: int, bits: float, rounds: int) -> dict:
    H, d, M = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(H, T, d, generator=g), torch.randn(H, T, d, generator=g)
    state = TurboQuant(bits=bits).build(k, v, bits, 0)
    q, scale = torch.randn(1, H, M, d, generator=g), d ** -0.5
    p = torch.softmax(state.scores(q, scale), -1)
    calls = {"exact": lambda: _exact(q, k[None], v[None], scale),
             "kernel": lambda: (state.scores(q, scale), state.mix(p)),
             "lookup": lambda: _lookup(lambda: (state.scores(q, scale), state.mix(p)))}
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(ts[2:]) * 1000 for name, ts in times.items()}  # the first rounds warm up
    return dict(shape=shape, T=T, bits=bits, threads=torch.get_num_threads(), exact_ms=ms["exact"],
                kernel_ms=ms["kernel"], lookup_ms=ms["lookup"], kernel_over_exact=ms["kernel"] / ms["exact"],
                lookup_over_kernel=ms["lookup"] / ms["kernel"],
                coded_over_full_bytes=state.nbytes() / (2 * H * T * d * 2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--bits", type=float, nargs="+", default=[2, 2.5, 3, 3.5, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=str(RESULTS / "quant" / "quant_kernel"))
    args = ap.parse_args(argv)
    if native.library() is None:
        sys.exit("the packed-code kernel is not available here (no C compiler, no AVX2, or KVSUM_NATIVE=0)")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in SHAPES:
            for T in args.lengths:
                for bits in args.bits:
                    rows.append(measure(shape, T, bits, args.rounds))
                    print(rows[-1], flush=True)
    out = Path(args.out)
    info = run_info(None, args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
    lines = [f"# Packed-code kernel, one layer's attention at one decoding step ({info['date']})", "",
             info_line(info), "",
             "Scores + mix over T coded tokens (TurboQuant rotated path, one query token) through the kernel and "
             "through the PyTorch lookup path, beside exact fp32 attention over the same T tokens; medians of "
             f"{args.rounds - 2} interleaved rounds. Bytes: the coded state over the 16-bit keys and values.", "",
             "| model shape | threads | T | bits | bytes | exact ms | kernel ms | lookup ms | kernel / exact | "
             "lookup / kernel |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['threads']} | {r['T']} | {r['bits']} | {r['coded_over_full_bytes']:.3f} | "
              f"{r['exact_ms']:.3f} | {r['kernel_ms']:.3f} | {r['lookup_ms']:.3f} | {r['kernel_over_exact']:.2f} | "
              f"{r['lookup_over_kernel']:.1f} |" for r in rows]
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
