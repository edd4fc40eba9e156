"""Quantization experiments (benchmarks/quant.py, kernel.py): TurboQuant and KIVI beside the full cache."""

from __future__ import annotations

from .base import Experiment, spec

RETRIEVAL, LM = ("passkey", "multikey"), ("lm",)
TINY = 0.0625


def tq(**knobs) -> tuple[str, ...]:
    """TurboQuant at 3.5 and 2.5 bits with `knobs` (its bit width sets the bytes: budget 1)."""
    return tuple(spec("turboquant", bits=b, **knobs) for b in (3.5, 2.5))


QUANT = (*tq(), spec("kivi", bits=4), spec("kivi", bits=2))
GROUPS = {  # the method rows each named group of the quantization tables holds
    "quant": QUANT,
    "rotation": QUANT[:2],
    "noshift": tq(key_shift=0),  # ablation: the same key bits in every layer
    "plain": tq(skew=0, sinks=0, key_shift=0),  # ablation: no key/value skew, no exact sinks, no key shift
    "pca": tq(key_basis="pca"),  # keys as query-weighted transform codes
    "outliers": tq(key_basis="pca", outliers=0.01),  # pca keys, the 1% worst-served tokens exact
    "center": tq(center=True),  # keys coded less their prompt mean
    "hadamard": tq(rotation="hadamard"),  # seeded-sign Hadamard rotation
    "unbiased": tq(unbiased="values"),
    "unbiased_both": (spec("turboquant", bits=2.5, unbiased="both"),),
    "pca_unbiased": (spec("turboquant", bits=2.5, key_basis="pca", unbiased="values"),),
    "pre_rope": tq(key_basis="pca", pre_rope=True, unbiased="values", skew=0),  # pca keys coded before RoPE
    "qjl": tq(qjl=True),
    # diagnosis: the 2.5-bit defaults with the values, then the keys, exact (benchmarks/diagnose.py)
    "sides": (spec("turboquant", bits=2.5), *(spec("turboquant_one_side", bits=2.5, coded=s) for s in
                                               ("keys", "values"))),
    # KIVI as published beside KIVI with its first 4 tokens exact
    "kivi": tuple(spec("kivi", bits=b, **k) for b in (4, 2) for k in ({}, {"sinks": 4})),
    # compositions at their own budgets with and without TurboQuant's key shift
    "compose_shift": tuple(spec(name, (budget,), **knobs, **shift) for name, knobs, budget in (
        ("snapkv+turboquant", {}, 0.25), ("summary+turboquant", {"score": "sentence"}, 0.125),
        ("summary+turboquant", {}, TINY)) for shift in ({}, {"key_shift": 1})),
}
MAIN = (*GROUPS["quant"], *GROUPS["noshift"], *GROUPS["plain"])
# the lm part's budget-0.0625 comparison, after the quantizer rows
COMPOSE = (spec("summary", (TINY,), by_budget=False), spec("summary+turboquant", (TINY,)),
           spec("turboquant", (0.1,), bits=1))
MARGINS = (*GROUPS["sides"], GROUPS["unbiased"][1], *GROUPS["unbiased_both"], QUANT[0])
DECODE = (*(spec("turboquant", bits=b, path=p) for b in (4, 3.5, 2.5, 2) for p in ("rotated", "dequant")),
          *GROUPS["pca"], spec("kivi", bits=4), spec("kivi", bits=2))
DEFAULT_25 = QUANT[1]  # the 2.5-bit defaults, the reference row of a decode group


def retrieval(name: str, methods, n: int, threads: int, tasks=RETRIEVAL, doc: str = "") -> Experiment:
    return Experiment(name, "quant", "quant", doc or f"retrieval at 2k, n = {n}", part="retrieval",
                      methods=("full", *methods), tasks=tasks, lengths=(2048,), n=n, threads=threads)


def lm(name: str, methods, threads: int, n: int = 6, doc: str = "") -> Experiment:
    return Experiment(name, "quant", "quant", doc or f"lm KL on a 1.5k prefix, n = {n}", part="lm",
                      methods=("full", *methods), tasks=LM, lengths=(1536,), n=n, threads=threads)


THREADS_N100 = dict(center=1, hadamard=1, outliers=1, pca_unbiased=2, pre_rope=2, qjl=1, sides=1, unbiased_both=2,
                    unbiased=2)
THREADS_LM = dict(center=1, hadamard=1, kivi=2, outliers=1, pca=2, pca_unbiased=2, pre_rope=2, qjl=1, unbiased=2,
                  unbiased_both=2, compose_shift=2)

EXPERIMENTS = [
    retrieval("quant_retrieval", MAIN, 50, 2, doc="the main table: defaults, no key shift, plain layout; n = 50"),
    retrieval("quant_retrieval_pca", GROUPS["pca"], 50, 2),
    retrieval("quant_retrieval_kivi", GROUPS["kivi"], 50, 2, doc="KIVI with and without exact sinks, n = 50"),
    retrieval("quant_retrieval_compose_shift", GROUPS["compose_shift"], 20, 2,
              doc="compositions with and without the key shift, n = 20"),
    *(retrieval(f"quant_retrieval_n100_{task}", (*GROUPS["rotation"], *GROUPS["pca"]), 100, 1, (task,),
                doc=f"{task}, the defaults and pca keys, n = 100") for task in RETRIEVAL),
    *(retrieval(f"quant_retrieval_n100_{g}_{task}", GROUPS[g], 100, t, (task,), doc=f"{task}, group {g}, n = 100")
      for g, t in THREADS_N100.items() for task in RETRIEVAL),
    lm("quant_lm", (*MAIN, *COMPOSE), 1, doc="the main table's lm KL, and summary(+turboquant) at 0.0625"),
    lm("quant_compose_bits", (*COMPOSE[:1], *(spec("summary+turboquant", (TINY,), bits=float(b))
                                             for b in (2, 2.5, 3, 4)), COMPOSE[2]), 2, n=3,
       doc="summary+turboquant at 0.0625 by the codes' bit width"),
    *(lm(f"quant_lm_{g}", (*GROUPS[g], *COMPOSE), t) for g, t in THREADS_LM.items()),
    Experiment("quant_decode", "quant", "quant", "decode step over the quantized cache at 4k", part="decode",
               methods=("full", *DECODE), lengths=(4096,), threads=2, args=("--steps", "30", "--repeats", "2")),
    Experiment("quant_decode_pre_rope", "quant", "quant", "decode step of pca and pre-RoPE keys at 4k",
               part="decode", methods=("full", DEFAULT_25, *GROUPS["pca"], *GROUPS["pre_rope"]), lengths=(4096,),
               threads=1, args=("--steps", "30", "--repeats", "2")),
    *(Experiment(f"quant_margins_{task}", "quant", "quant", f"{task} answer margins, n = 100", part="margins",
                 methods=("full", *MARGINS), tasks=(task,), lengths=(2048,), n=100, threads=2)
      for task in ("multikey", "passkey")),
    Experiment("quant_kernel", "quant", "kernel", "the packed-code kernel against the lookup path"),
]
