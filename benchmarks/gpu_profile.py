"""Where a decoding step's time goes on the GPU (issue 34): CUDA kernels launched, the GPU's busy time and the wall
time of one step, per cache, from PyTorch's profiler.

The step benchmark (benchmarks/gpu.py) says how long a step takes; this says why. Per length and method: the
step's wall time (median of --rounds, CUDA-synchronised), the CUDA kernels one profiled step launches, the sum of
their device times (the GPU's busy time: what a CUDA graph of the step could not remove) and the aten operations
dispatched on the host (nested ones included); and the five kernels with the most device time.

    python -m benchmarks.gpu_profile --random-weights .gpu/qwen --lengths 8192 32768   # on a CUDA machine

Arguments as benchmarks/gpu.py's (--random-weights DIR, --dtype, --methods with their budgets after @).
"""

from __future__ import annotations

import statistics
import sys

import torch

from .gpu import METHODS, _sync, _timed, attempt, made, prefilled, prompt, ready
from .gpu import parser as gpu_parser


def parser():
    from .common import RESULTS

    ap = gpu_parser()
    ap.description = __doc__.splitlines()[0]
    ap.set_defaults(out=str(RESULTS / "gpu" / "gpu_profile"), lengths=[8192, 32768], rounds=10,
                    methods=["full@1", *METHODS])
    return ap


@torch.no_grad()
def profiled(model, cache, token, rounds: int, device: str) -> dict:
    """One cache's step: wall median, then one step under the profiler (the cache cropped back after each)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for r in range(3 + rounds):  # three warm-up steps first
        _, s = _timed(lambda: model(token, cache=cache), device)
        cache.crop(-1)
        if r >= 3:
            walls.append(s)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        model(token, cache=cache)
        _sync(device)
    cache.crop(-1)
    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in gpu:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return dict(step_ms=statistics.median(walls) * 1e3, kernels=len(gpu),
                gpu_busy_ms=sum(by_name.values()) / 1e3,
                aten_ops=sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")),
                top=[(name[:60], round(us, 1)) for name, us in top])


@torch.no_grad()
def measure(model, tok, args, rows: list, failed: list) -> None:
    """Rows per length and method into `rows`, one prefill per length and prefill kind (failures into `failed`)."""
    import kvsum

    methods = made(args.methods)
    ids = prompt(model, tok, args)
    for L in sorted(args.lengths):
        prefills = {}
        for spec, (method, budget) in methods.items():
            got = prefilled(model, tok, ids[:, :L], method, prefills, failed, args.device)
            r = got and attempt(failed, f"{spec} at {L}", lambda m=method, b=budget, p=got[0]: profiled(
                model, kvsum.compress_prefill(p, m, b), ids[:, :1], args.rounds, args.device))
            if r:
                rows.append(dict(length=L, method=spec.rpartition("@")[0] or spec, budget=budget, **r))
                print(rows[-1], flush=True)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


def table(rows: list[dict]) -> list[str]:
    full = {r["length"]: r for r in rows if r["method"] == "full"}
    out = ["One decoding step per cache: wall time (median, CUDA-synchronised) and over the full cache's; CUDA "
           "kernels one step launches; the GPU's busy time (the kernels' device times summed) and over the full "
           "cache's; aten operations dispatched (nested included); the kernels with the most device time.", "",
           "| length | method | budget | step ms | x full | kernels | GPU busy ms | x full | aten ops | "
           "top kernels (µs) |",
           "|---" * 10 + "|"]
    for r in rows:
        f = full.get(r["length"])
        top = "; ".join(f"{n} {us:g}" for n, us in r["top"][:3])
        out.append(f"| {r['length']} | `{r['method']}` | {r['budget']:g} | {r['step_ms']:.2f} | "
                   f"{r['step_ms'] / f['step_ms'] if f else float('nan'):.2f} | {r['kernels']} | "
                   f"{r['gpu_busy_ms']:.2f} | "
                   f"{r['gpu_busy_ms'] / f['gpu_busy_ms'] if f and f['gpu_busy_ms'] else float('nan'):.2f} | "
                   f"{r['aten_ops']} | {top} |")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    got = ready(args, "benchmarks.gpu_profile")
    if got is None:
        return 2
    from .common import write_page

    model, tok, t0, device = got
    rows, failed = [], []
    measure(model, tok, args, rows, failed)
    write_page(rows, args, t0, "Where a decoding step's time goes on the GPU", table(rows), device=device,
               dtype=args.dtype, failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
