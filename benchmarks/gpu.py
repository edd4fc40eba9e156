"""The GPU path (issue 34): decode step, KV memory and prefill + compression time on a CUDA machine.

For each context length, the prompt (real prose) is prefilled once per prefill kind and compressed by every
method; then one-token decoding steps over every cache, the full one included (transformers' SDPA attention,
bit for bit), are timed round-robin with CUDA synchronisation around each step (medians over --rounds; the
token is cropped off again, so every round sees the same cache). Compressed caches read their packed codes
and ragged heads through the Triton kernels (kvsum/kernels/). Reported per method and length: step ms and its
ratio to the full cache's, KV bytes held (cache.nbytes(), and the full cache's over them), the CUDA memory
allocated while stepping, and the prefill and compression seconds.

    python -m benchmarks.gpu                       # qwen2.5-coder-0.5b, bf16, 4k..32k, the four methods below
    python -m benchmarks.gpu --lengths 4096 --rounds 5 --out /tmp/gpu   # a quick look

A GPU machine that cannot install the bundled model (no registry, a 64 MiB upload) takes `--random-weights DIR`:
DIR holds the bundled model's config.json and tokenizer files (`python -m benchmarks.gpu --export DIR` copies them
from the converted model here), and the model is built from that config with seeded random weights. Step times,
bytes held and compression times depend on the shapes, which are the bundled model's; only quality would need the
real weights, and this benchmark measures none. benchmarks/gpu.sh runs the kernel tests on the GPU and then this.
A configuration that fails is printed with its traceback and named in the page's `failed`; the others still run.
The page is rewritten after each length, so a run cut short keeps what it measured.

Without CUDA (or without triton) it refuses in one line with exit code 2. `--device cpu` runs the script itself
at small --lengths for a smoke check (the CPU kernel then serves, not Triton: not the benchmark).
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback

import torch

METHODS = ("summary@0.25", "summary@0.1", "turboquant:bits=3.5@0.3",
           "turboquant:bits=2.5@0.25", "kivi:bits=4@0.5")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parser():
    from .common import arguments

    ap = arguments(__doc__, "gpu/gpu", threads=4)
    ap.set_defaults(model="qwen2.5-coder-0.5b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="context tokens")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help="method specs, own budget after @")
    ap.add_argument("--rounds", type=int, default=20, help="timed steps per cache (medians)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the model's dtype")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run of the script)")
    ap.add_argument("--random-weights", metavar="DIR", help="build the model from DIR's config with random weights")
    ap.add_argument("--export", metavar="DIR", help="copy --model's config and tokenizer files to DIR and stop")
    return ap


CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")


def export(model: str, folder: str) -> None:
    """The files --random-weights reads, copied from the converted bundled model (weights left behind)."""
    import shutil
    from pathlib import Path

    from kvsum.models import resolve

    src, dst = resolve(model), Path(folder)
    dst.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def load(args):
    """(model, tokenizer) on args.device: the bundled model, or its shapes with seeded random weights."""
    import kvsum

    dtype = DTYPES[args.dtype]
    if not args.random_weights:
        model, tok = kvsum.load_model(args.model, dtype=dtype)
        return model.to(args.device), tok
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvsum.attention import use_kvsum_attention

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.random_weights)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    use_kvsum_attention(model)
    return model, AutoTokenizer.from_pretrained(args.random_weights)


def refusal(device: str, who: str = "benchmarks.gpu") -> str | None:
    """Why this machine cannot run the benchmark `who` (one line), or None."""
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return f"{who}: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine"
    import kvsum.kernels

    if not kvsum.kernels.enabled():
        return f"{who}: the Triton kernels are off (triton not installed: pip install 'kvsum[gpu]', " \
               "or KVSUM_NATIVE=0)"
    return None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def attempt(failed: list, what: str, fn):
    """fn(), or None where it fails: a budget the length cannot hold is said; any other failure is printed with its
    traceback and kept in `failed`, and the run goes on without that configuration."""
    from kvsum.errors import KVSumError

    try:
        return fn()
    except KVSumError as e:
        print(f"{what}: {e}", flush=True)
    except Exception as e:  # noqa: BLE001 (a device run is short: one failure must not cost the others)
        traceback.print_exc()
        failed.append(f"{what}: {type(e).__name__}: {e}")
    return None


@torch.no_grad()
def steps(model, caches: dict, token: torch.Tensor, rounds: int, device: str, failed: list, L: int) -> dict:
    """Per cache: median step seconds and peak memory allocated while stepping (bytes; 0 on the CPU)."""
    for k, cache in list(caches.items()):  # warm-up (Triton compiles each kernel once per shape class)
        if attempt(failed, f"{k} at {L} (decode)", lambda c=cache: (model(token, cache=c), c.crop(-1))) is None:
            del caches[k]
    times = {k: [] for k in caches}
    peak = {}
    for r in range(rounds):
        for k, cache in caches.items():
            if device.startswith("cuda") and r == 0:
                torch.cuda.reset_peak_memory_stats()
            _, s = _timed(lambda c=cache: model(token, cache=c), device)
            if device.startswith("cuda") and r == 0:
                peak[k] = torch.cuda.max_memory_allocated()
            times[k].append(s)
            cache.crop(-1)
    return {k: (statistics.median(v), peak.get(k, 0)) for k, v in times.items()}


def _bench(fn, device: str, graph: bool = False) -> float | None:
    """Median seconds of fn(): on CUDA by triton's do_bench (eager: launches and Python included) or, with
    `graph`, by replaying a CUDA graph of it (the GPU's time alone; None where fn cannot be captured); on the
    CPU by the clock (no graph)."""
    if not device.startswith("cuda"):
        if graph:
            return None
        times = []
        for _ in range(10):
            _, s = _timed(fn, device)
            times.append(s)
        return statistics.median(times)
    import triton.testing

    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    except Exception as e:  # noqa: BLE001 (a state whose read path cannot be captured: said on its row)
        print(f"no {'graph' if graph else 'timing'}: {type(e).__name__}: {e}", flush=True)
        return None


@torch.no_grad()
def step_attention(model, cache, device: str) -> dict:
    """The attention of one decoding step alone, every layer in turn, as the model's attention calls run it: SDPA
    over each full layer, kvsum's joint attention over each compressed state and a one-token tail. Eager and GPU
    (CUDA graph) seconds, and the bytes the layers hold (with the whole model's layers, more than the GPU's L2)."""
    import torch.nn.functional as F

    from kvsum.attention import joint_attention

    g = torch.Generator(device=device).manual_seed(0)
    calls, held = [], 0
    for layer in cache.layers:
        H, d = layer.keys.shape[1], layer.keys.shape[3]
        q, k1, v1 = (torch.randn(1, n, 1, d, generator=g, device=device, dtype=model.dtype)
                     for n in (model.config.num_attention_heads, H, H))
        keys, values = torch.cat([layer.keys, k1], 2), torch.cat([layer.values, v1], 2)
        held += layer.nbytes() + k1.nbytes + v1.nbytes
        if layer.state is None:
            calls.append(lambda q=q, k=keys, v=values, c=d ** -0.5: F.scaled_dot_product_attention(
                q, k, v, scale=c, enable_gqa=True))
        else:
            calls.append(lambda s=layer.state, q=q, k=keys, v=values, c=d ** -0.5: joint_attention(s, q, k, v, None, c))

    def fn():
        for call in calls:
            call()
    return dict(attn_s=_bench(fn, device), attn_gpu_s=_bench(fn, device, graph=True), attn_bytes=held)


def made(specs: list[str]) -> dict:
    """spec -> (built method, budget) for method specs with their budget after @ (0.25 where none is given)."""
    from kvsum.methods import make_method

    from .specs import parse_row

    return {s: (make_method(name, **knobs), (budgets or [0.25])[0])
            for s, (name, knobs, budgets) in ((s, parse_row(s)) for s in specs)}


@torch.no_grad()
def prompt(model, tok, args):
    """The longest prompt (real prose) on args.device, after a warm-up forward (the first forward's library set-up
    stays out of the prefill times)."""
    from kvsum.eval.text import prose_ids

    ids = prose_ids(tok, max(args.lengths)).to(args.device)
    model(ids[:, :256])
    return ids


def prefilled(model, tok, x, method, prefills: dict, failed: list, device: str):
    """(prefill, seconds) of prompt x with what `method` asks for, one per prefill kind (kept in `prefills`), or
    None where the prefill failed."""
    import kvsum
    from kvsum.methods import prefill_needs

    opts = tuple(sorted(prefill_needs([method]).items()))
    if opts not in prefills:
        prefills[opts] = attempt(failed, f"prefill {dict(opts)} at {x.shape[1]}", lambda o=dict(opts):
                                 _timed(lambda: kvsum.prefill(model, x, tokenizer=tok, **o), device))
    return prefills[opts]


@torch.no_grad()
def measure(model, tok, args, rows: list, failed: list, done) -> None:
    """Rows per length and method into `rows` (failures into `failed`); done() after each length."""
    import kvsum
    from kvsum.methods import make_method

    methods = made(args.methods)
    ids = prompt(model, tok, args)
    for L in sorted(args.lengths):
        caches, info = {}, {}
        prefills = {}
        for spec, (method, budget) in [("full", (make_method("full"), 1.0)), *methods.items()]:
            got = prefilled(model, tok, ids[:, :L], method, prefills, failed, args.device)
            if got is None:
                continue
            pre, t_pre = got
            done_ = attempt(failed, f"{spec} at {L}", lambda m=method, b=budget, p=pre:
                            _timed(lambda: kvsum.compress_prefill(p, m, b), args.device))
            if done_ is None:
                continue
            cache, t_comp = done_
            caches[spec] = cache
            info[spec] = dict(budget=budget, prefill_s=t_pre, compress_s=t_comp, kv_bytes=cache.nbytes(),
                              full_kv_bytes=cache.reference_nbytes)
        del prefills
        timed = steps(model, caches, ids[:, :1], args.rounds, args.device, failed, L)
        for spec in timed:  # after the steps: a call that cannot be captured in a graph is tried last
            info[spec].update(attempt(failed, f"{spec} at {L} (attention alone)",
                                      lambda c=caches[spec]: step_attention(model, c, args.device)) or {})
        full_step = timed["full"][0] if "full" in timed else float("nan")
        for spec, (s, peak) in timed.items():
            i = info[spec]
            rows.append(dict(length=L, method=spec.rpartition("@")[0] or spec, **i, step_ms=s * 1e3,
                             over_full=s / full_step, kv_less=i["full_kv_bytes"] / max(1, i["kv_bytes"]),
                             step_peak_mib=peak / 2 ** 20, **_over_sdpa(i, info.get("full"))))
            print(rows[-1], flush=True)
        del caches
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        done()


def _over_sdpa(i: dict, full: dict | None) -> dict:
    """The step's attention times over SDPA's on the full cache, and its GPU read rate (GB/s)."""
    def ratio(key):
        return i[key] / full[key] if full and i.get(key) and full.get(key) else None

    gpu = i.get("attn_gpu_s")
    return dict(attn_over_sdpa=ratio("attn_s"), attn_gpu_over_sdpa=ratio("attn_gpu_s"),
                attn_gb_s=i["attn_bytes"] / gpu / 1e9 if gpu else None)


def _f(x, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def table(rows: list[dict], failed: list[str]) -> list[str]:
    out = ["Median one-token decode step over each cache (round-robin, CUDA-synchronised) and over the full "
           "cache's (SDPA); KV bytes held (cache.nbytes()) and the full cache's (16-bit) over them; CUDA memory "
           "allocated at the step's peak (weights included); prefill and compression seconds.", "",
           "| length | method | budget | step ms | x full | KV MiB | KV x less | step peak MiB | prefill s | "
           "compress s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['length']} | `{r['method']}` | {r['budget']:g} | {r['step_ms']:.2f} | {r['over_full']:.2f} | "
                   f"{r['kv_bytes'] / 2 ** 20:.1f} | {r['kv_less']:.2f} | {r['step_peak_mib']:.0f} | "
                   f"{r['prefill_s']:.2f} | {r['compress_s']:.2f} |")
    out += ["", "The attention of one decoding step alone, every layer in turn (SDPA over the full cache; kvsum's "
            "joint attention over each state and a one-token tail): eager median (launches and Python included), "
            "GPU time (a CUDA graph's replays; - where the calls cannot be captured), each over SDPA's, and the "
            "bytes the layers hold over the GPU time.", "",
            "| length | method | budget | eager µs | x SDPA | GPU µs | x SDPA | GB/s |", "|---" * 8 + "|"]
    for r in rows:
        out.append(f"| {r['length']} | `{r['method']}` | {r['budget']:g} | {_f(r.get('attn_s'), '.1f', 1e6)} | "
                   f"{_f(r.get('attn_over_sdpa'), '.2f')} | {_f(r.get('attn_gpu_s'), '.1f', 1e6)} | "
                   f"{_f(r.get('attn_gpu_over_sdpa'), '.2f')} | {_f(r.get('attn_gb_s'), '.0f')} |")
    return out + ([""] + [f"Failed: {f}" for f in failed] if failed else [])


def ready(args, who: str = "benchmarks.gpu"):
    """(model, tokenizer, start time, device name) for a GPU benchmark, or None where this machine cannot run it
    (the reason printed in one line)."""
    why = refusal(args.device, who)
    if why:
        print(why, file=sys.stderr)
        return None
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load(args)
    return model, tok, t0, torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.export:
        export(args.model, args.export)
        return 0
    got = ready(args)
    if got is None:
        return 2
    from .common import write_page

    model, tok, t0, device = got
    rows, failed = [], []
    weights = "random (seeded; the bundled model's config)" if args.random_weights else "the bundled model's"
    title = "The GPU path: decode step, KV memory, prefill + compression"
    measure(model, tok, args, rows, failed, lambda: write_page(rows, args, t0, title, table(rows, failed),
                                                               device=device, dtype=args.dtype, weights=weights,
                                                               failed=failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
