"""The operations of one decoding step on the GPU path, counted without a GPU (issue 34).

At batch 1 a small model's decoding step on a GPU is bound by launches, not by bytes: each small tensor operation
costs its launch and dispatch (some 10 µs), which on the H200 was most of a 20-35 ms step of Qwen2.5-Coder-0.5B
whatever the length (benchmarks/results/gpu). So what kvsum's attention adds to a step is counted here: the aten
operations dispatched and the Triton launches of one step over each method's cache, per layer, beside the full
cache's, on a random 2-layer Llama with Qwen2.5-Coder-0.5B's attention shapes (14 query / 2 KV heads, head dim 64)
whose states take the CUDA path (the kernels forced onto
CPU tensors under Triton's interpreter: the same Python and the same operations as on a GPU; the interpreter's own
work inside a launch is not counted). Counts are exact and machine-independent.

    python -m benchmarks.step_ops      # writes benchmarks/results/gpu/step_ops.{json,md}
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

METHODS = ("full@1", "turboquant:bits=3.5@0.3", "turboquant:bits=3.5,center=True@0.3", "kivi:bits=4@0.5",
           "summary@0.25", "summary@0.1")
KERNEL_MODULES = ("codes", "flash", "kivi", "ragged")


class Counter(TorchDispatchMode):
    """Counts the aten operations dispatched, but not those inside a Triton launch (`paused`), and the launches."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.paused = 0, collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not self.paused
        return func(*args, **(kwargs or {}))


class _Launch:
    """A Triton kernel whose launches the active Counter counts (and whose inside it does not)."""

    def __init__(self, kernel, name: str, counter: Counter):
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter.launches[self.name] += 1
            self.counter.paused = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.counter.paused = False
        return launch


@contextlib.contextmanager
def counting():
    """A Counter over the block, the kvsum kernels' launches included."""
    counter, saved = Counter(), []
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"kvsum.kernels.{name}")
        for attr in [a for a in dir(mod) if a.endswith("_kernel")]:
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, _Launch(getattr(mod, attr), f"{name}.{attr}", counter))
    try:
        with counter:
            yield counter
    finally:
        for mod, attr, kernel in saved:
            setattr(mod, attr, kernel)


@torch.no_grad()
def step_counts(model, ids: torch.Tensor, spec: str) -> dict:
    """One decoding step over `spec`'s cache of `ids`: aten operations and Triton launches, under `forced()`."""
    import kvsum
    import kvsum.kernels

    from .specs import parse_row

    name, knobs, budgets = parse_row(spec)
    cache = kvsum.compress(model, ids, method=name, budget=budgets[0], **knobs)
    token = ids[:, :1]
    with kvsum.kernels.forced():
        model(token, cache=cache)  # warm: a first step may build what later steps reuse
        cache.crop(-1)
        with counting() as c:
            model(token, cache=cache)
    return dict(ops=c.ops, launches=sum(c.launches.values()), kernels=dict(c.launches))


def model_of_shapes(layers: int = 2):
    """A random Llama with Qwen2.5-Coder-0.5B's attention shapes, kvsum's attention on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsum.attention import use_kvsum_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=896, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    use_kvsum_attention(model)
    return model


def main(argv: list[str] | None = None) -> int:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    from .common import arguments, write_page

    ap = arguments(__doc__, "gpu/step_ops", threads=1)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), help="method specs, own budget after @")
    ap.add_argument("--tokens", type=int, default=1200, help="prompt tokens")
    args = ap.parse_args(argv)
    args.model = "random 2-layer Llama, 14 query / 2 KV heads, head dim 64"
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = model_of_shapes()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 128, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rows = [dict(method=s, **step_counts(model, ids, s)) for s in args.methods]
    full = next((r["ops"] for r in rows if r["method"].startswith("full")), None)
    for r in rows:
        r["ops_per_layer"] = r["ops"] / layers
        r["added_per_layer"] = (r["ops"] - full) / layers if full is not None else None
    table = ["aten operations and Triton launches of one decoding step (the CUDA path, counted under Triton's "
             "interpreter), in all and per layer beyond the full cache's.", "",
             "| method | ops | ops / layer | added / layer | launches |", "|---|---|---|---|---|"]
    table += [f"| `{r['method']}` | {r['ops']} | {r['ops_per_layer']:.1f} | "
              f"{r['added_per_layer']:.1f} | {r['launches']} |" for r in rows]
    write_page(rows, args, t0, "Operations of one decoding step on the GPU path", table, layers=layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
