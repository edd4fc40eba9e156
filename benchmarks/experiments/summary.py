"""Summary experiments (benchmarks/summary.py, summary_cover.py): the flagship against eviction on equal bytes."""

from __future__ import annotations

from .base import Experiment, spec, tq

EVICTION = ("streaming_llm", "random", "snapkv", "h2o", "tova", "knorm", "expected_attention", "restkv")
MAIN, EVICT, ABLATION = (0.5, 0.25, 0.125, 0.0625), (0.5, 0.25, 0.125), (0.25, 0.125)
ABLATIONS = (  # each switches one stage of the default summary on or off
    dict(entropy_allocation=True, by_budget=False), dict(refit=False), dict(lowrank_share=0.2, anchor_share=0.6),
    dict(anchor_share=1.0), dict(score="surprisal"), dict(score="sharp_mass"),
)
SUMMARY = ("full", spec("summary", MAIN, by_budget=False), spec("hae", MAIN), *(spec(m, EVICT) for m in EVICTION),
           *(spec("summary", ABLATION, **a) for a in ABLATIONS))

QUARTER_COVER = spec("summary", (0.25,), score="surprisal", cover=tq(bits=3.5, center=True))  # the demo's
COVER_GROUPS = {
    "main": ("full", spec("summary", (0.25, 0.125), by_budget=False),
             spec("summary", (0.25, 0.125), cover_share=0.75),
             spec("summary", (0.25,), cover=tq(bits=3)), spec("summary", (0.25,), score="surprisal", cover=tq(bits=3)),
             spec("summary", (0.125,), cover=tq(bits=1)), spec("summary+turboquant", (0.25, 0.125)),
             spec("restkv", (0.25, 0.125)), spec("snapkv+turboquant", (0.125,)), spec("turboquant", (0.25, 0.125))),
    # the cover's keys on the queries' principal axes, beside eviction at 0.125
    "pca": ("full", spec("summary", (0.125,), score="surprisal", cover=tq(bits=1.5, key_basis="pca")),
            spec("summary", (0.125,), score="surprisal", cover=tq(bits=1.5)),
            spec("summary", (0.25,), score="surprisal", cover=tq(bits=3, key_basis="pca")),
            *(spec(m, (0.125,)) for m in ("streaming_llm", "snapkv", "restkv"))),
    # the budget-0.125 target: whole-sentence anchors coded by TurboQuant against every eviction method
    "sentence": ("full", spec("summary+turboquant", (0.125,), score="sentence"), *(spec(m, (0.125,))
                                                                                   for m in EVICTION)),
    # the budget-0.25 target: the demo's cover against every eviction method
    "quarter": ("full", QUARTER_COVER, *(spec(m, (0.25,)) for m in EVICTION)),
    "cover": ("full", QUARTER_COVER),  # against the full cache alone, for a larger n
    "unbiased": ("full", QUARTER_COVER,
                 spec("summary", (0.25,), score="surprisal", cover=tq(bits=3.5, center=True, unbiased="values"))),
}


def cover(name: str, group: str, doc: str, lengths=(2048,), n: int = 10, n_lm: int = 3, threads: int = 2,
          lm_only: bool = False) -> Experiment:
    args = ("--n-lm", str(n_lm), *(("--lm-only",) if lm_only else ()))
    return Experiment(name, "summary", "summary_cover", doc, methods=COVER_GROUPS[group],
                      lengths=() if lm_only else lengths, n=None if lm_only else n, threads=threads, args=args)


EXPERIMENTS = [
    Experiment("summary", "summary", "summary", "summary and hae against every eviction method, and ablations",
               methods=SUMMARY, lengths=(2048, 4096), n=(6, 3), threads=1, args=("--n-lm", "3")),
    cover("summary_cover", "main", "covers of every non-anchor token against restkv / turboquant, 2k"),
    cover("summary_cover_lm", "main", "the same rows, lm only, n = 8", n_lm=8, lm_only=True),
    cover("summary_cover_pca", "pca", "pca-keyed covers beside eviction", lengths=(2048, 4096), threads=1),
    cover("summary_cover_sentence", "sentence", "summary+turboquant by sentence at 0.125 against eviction",
          lengths=(2048, 4096), n=20),
    cover("summary_cover_quarter", "quarter", "the demo's cover at 0.25 against eviction", lengths=(2048, 4096),
          n=20),
    cover("summary_cover_quarter_lm", "quarter", "the same rows, lm only, n = 8", n_lm=8, lm_only=True),
    cover("summary_cover_cover", "cover", "the demo's cover against full alone, n = 50", lengths=(2048, 4096), n=50),
    cover("summary_cover_unbiased", "unbiased", "the demo's cover with unbiased values, n = 50", n=50, n_lm=8),
    cover("summary_cover_unbiased_lm", "unbiased", "the same rows, lm only, n = 8", n_lm=8, lm_only=True),
]
