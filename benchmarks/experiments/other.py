"""Performance, reconstruction, Gemma, stability, robustness and report experiments."""

from __future__ import annotations

from .base import Experiment, spec, tq

# the flagship's sentence composition before its recent window (the rule's knobs at 0.125-0.1, 32-token window)
COMPOSED = "summary+turboquant"
PRE_ROPE_COVER = tq(bits=3.5, key_basis="pca", pre_rope=True, unbiased="values", skew=0)
SENTENCES = dict(score="sentence", key_shift=1, center=True, entropy_allocation=False)

# SnapKV's selection as codes in the Hadamard rotation (as the flagship's codes since it paid on dev), measured at the
# budgets where the dense rotation's bytes count
SNAPKV_HADAMARD = dict(key_shift=1, rotation="hadamard")
SNAPKV_CODES = spec("snapkv+turboquant", **SNAPKV_HADAMARD)
PLAIN = "summary:by_budget=False"  # summary with its own defaults (before "summary" meant the flagship by budget)
PERF = ("turboquant", "kivi", PLAIN, "summary+turboquant", "streaming_llm", "snapkv")
GEMMA = ("full", "streaming_llm", "snapkv", "restkv", PLAIN, "turboquant", "kivi", "echokv", "lowrank")
GEMMA_MORE = (("echokv", "lowrank"), ("turboquant:rotation=hadamard",), ("turboquant",),
              ("summary:cover=turboquant(bits=3),score=surprisal",
               "summary:cover=turboquant(bits=3,rotation=hadamard),score=surprisal"),
              ("summary",))  # the flagship with no knobs, by budget


def gemma_runs() -> tuple[tuple[str, ...], ...]:
    """The invocations merged into gemma.json, in the order they ran: per task the default methods, then the
    calibrated methods, the Hadamard rotation, TurboQuant again, the code covers, and the flagship by budget."""
    out = []
    for task, n in (("passkey", 6), ("multikey", 6), ("lm", 4)):
        out.append(("--task", task, "--n", str(n), "--methods", *GEMMA))
        out += [("--task", task, "--n", str(n), "--methods", *more) for more in GEMMA_MORE]
    return tuple(out)


LONG = ("full", "snapkv@0.25,0.1", "streaming_llm@0.25",  # each family's best at 0.25 / 0.10 (headline.md)
        spec("turboquant", (0.25,), bits=2.5, key_basis="pca", pre_rope=True, unbiased="values", skew=0),
        "echokv@0.25",
        spec("summary", (0.25,), cover=tq(bits=3.5, center=True), score="surprisal"),
        spec("summary", (0.125,), cover=tq(bits=1.5, key_basis="pca"), score="surprisal"),  # refuses 0.10
        spec("snapkv+turboquant", (0.25,), key_shift=1),
        spec("summary+turboquant", (0.1,), score="sentence", key_shift=1))

LONG_BF16 = ("full", "snapkv@0.25,0.1", "streaming_llm@0.25", LONG[3], "echokv@0.25", "summary@0.25,0.1,0.05",
             spec("snapkv+turboquant", (0.25, 0.1), key_shift=1))  # the flagship with no knobs, by budget
COVER_CODES = spec("turboquant", (0.25,), bits=3.5, center=True)  # the flagship's 3.5-bit cover without its anchors
# rotated codes up to 4 bits, KIVI's per-channel keys, and pca keys coded before RoPE, beside the flagship's cover
CODE_PROBE = ("full", "summary@0.25", COVER_CODES, spec("turboquant", (0.5,), bits=4, center=True), "kivi:bits=4@0.5",
              LONG[3])
LONG_TASKS = ("niah_multikey", "niah_multikey_code", "niah_multivalue", "niah_multiquery", "vt", "vt_code", "cwe",
              "fwe")  # the suite beyond NIAH single
ANSWERED = tuple(t for t in LONG_TASKS if t != "cwe")  # cwe the full cache misses at 16k: one example of it only


def bf16(methods: tuple[str, ...], *options: str) -> tuple[str, ...]:
    """A long_suite invocation on Qwen in bf16 with the chat format (as served; the format chosen on dev seeds)."""
    return ("--methods", *methods, *options, "--dtype", "bf16", "--chat")


def perf(part: str, doc: str, *runs: tuple[str, ...]) -> Experiment:
    return Experiment(f"perf_{part}", "perf", "perf", doc, part=part, threads=2, runs=runs or ((),))


EXPERIMENTS = [
    perf("short", "tokens/s over 64..512-token prompts: full, the default Policy, each method always on",
         ("--methods", *PERF), ("--methods", *PERF, "--lengths", "256")),
    perf("overhead", "(prefill + compression) / plain prefill per method and length; scaling exponents",
         ("--methods", *PERF, "--lengths", "512", "1024", "2048", "4096"), ("--methods", *PERF, "--lengths", "8192")),
    perf("decode", "decode-step time against context length and budget, over the full cache's",
         ("--methods", *PERF, "--lengths", "1024", "2048", "4096", "--budget-lengths", "4096"),
         ("--methods", *PERF, "--lengths", "8192", "--budget-lengths", "8192", "--rounds", "11"),
         ("--methods", *PERF, "--lengths", "1024", "2048", "4096"),
         ("--methods", PLAIN, "streaming_llm", "snapkv", "--lengths", "8192", "--budget-lengths", "8192",
          "--rounds", "11"),
         ("--methods", "turboquant", "kivi", "summary+turboquant", "--lengths", "4096", "8192", "--budget-lengths",
          "4096", "8192", "--rounds", "11"),
         ("--methods", "turboquant", "kivi", "summary+turboquant", "--lengths", "1024", "2048")),
    perf("memory", "cache bytes and peak resident memory during compression at 8k",
         ("--methods", *PERF, "--lengths", "8192")),
    Experiment("cost", "perf", "cost", "compression over prefill and decode over full at 4k, budget 0.25",
               methods=(PLAIN, "hae", "streaming_llm", "snapkv", "restkv"), threads=2,
               args=("--length", "4096", "--budget", "0.25")),
    Experiment("cost_cover", "perf", "cost", "the same for the demo's code cover",
               methods=(PLAIN, spec("summary", score="surprisal", cover=tq(bits=3.5, center=True)),
                        "turboquant"), threads=2, args=("--length", "4096", "--budget", "0.25")),
    Experiment("cost_sentence", "perf", "cost", "the same at 0.125 for summary+turboquant by sentence",
               methods=(spec("summary+turboquant", score="sentence"), PLAIN, "streaming_llm", "snapkv"),
               threads=2, args=("--length", "4096", "--budget", "0.125")),
    Experiment("cost_user", "perf", "cost", "what a user pays at 4k: kvsum.compress over a plain model(ids), "
               "alternated, beside the breakdown; one thread (robust on a shared machine)",
               methods=(PLAIN, spec("summary", score="surprisal", cover=tq(bits=3.5, center=True)), "snapkv",
                        "turboquant"), threads=1, args=("--length", "4096", "--budget", "0.25")),
    *[Experiment(f"cost_flagship_{k}k", "perf", "cost", f"what a user pays for the flagship at 0.1 of the bytes "
                 f"({k}k tokens): summary by budget (the sentence composition) beside snapkv; one thread",
                 methods=("summary", "snapkv"), threads=1, args=("--length", str(1024 * k), "--budget", "0.1"))
      for k in (4, 8)],
    *[Experiment(f"eval_{task}", "policy", "kvsum", f"the policy's summary by budget at 0.1 against plain summary "
                 f"({task}, 2k)", part="eval", out="dir",
                 args=("--method", f"full,{PLAIN},summary+turboquant:score=sentence,key_shift=1", "--budget", "0.1",
                       "--task", task, "--lengths", "2048", "--n", "10")) for task in ("passkey", "multikey")],
    *[Experiment(f"eval_{task}{suffix}", "formats", "kvsum", "a prompt format no choice was made on: RULER's NIAH "
                 f"single on SmolLM2 at 2k, {what}, test seeds: the flagship by budget, "
                 "SnapKV and SnapKV's selection as codes at 0.25 / 0.10 / 0.05 beside the full cache", part="eval",
                 out="dir", args=("--method", ",".join(("full", "summary", "snapkv", SNAPKV_CODES)), "--budget",
                                  "0.25,0.1,0.05", "--task", task, "--lengths", "2048", "--n", "20", "--seed", "0",
                                  *flag))
      for task, suffix, what, flag in (("niah_single", "", "prose, plain text (number / word / uuid values)", ()),
                                       ("niah_single", "_chat", "prose, the chat template", ("--chat",)),
                                       ("niah_single_code", "", "a haystack of Python sources (code facts)", ()))],
    Experiment("breakeven", "perf", "kvsum", "the policy's break-even table (kvsum bench breakeven)",
               part="bench breakeven", threads=2),
    Experiment("reconstruct", "reconstruct", "reconstruct", "calibration cost and per-layer reconstruction error",
               args=("--tokens", "4096", "--heldout", "2048", "--budgets", "0.5", "0.25")),
    Experiment("reconstruct_eval", "reconstruct", "reconstruct_eval", "echokv / lowrank beside summary and restkv",
               methods=("full", *(spec(m, (0.5, 0.25), **k) for m, k in (("echokv", {}), ("lowrank", {}), (
                   "lowrank", {"share_layers": 2}), ("summary", {"by_budget": False}), ("restkv", {})))),
               n=6, threads=1, args=("--n-lm", "3")),
    Experiment("gemma", "gemma", "gemma", "Gemma 3 270M: every family at 0.5 / 0.25 / 0.125 of the global layers",
               threads=2, runs=gemma_runs()),
    Experiment("stability", "stability", "kvsum", "greedy generations across dtypes (kvsum stability)",
               part="stability", threads=2, args=("--onepass", "fp16", "--dtype-prompts", "fp16=1", "--time-limit",
                                                  "400")),
    Experiment("long_generation", "stability", "long_generation", "2,048 greedy tokens on a compressed 1k context",
               threads=2, runs=(("--part", "exact"), ("--part", "compressed", "--only", "1"),
                                ("--part", "compressed", "--only", "0"))),
    Experiment("long_memory", "long", "long_memory", "Qwen at 2k-32k: peak memory during compression against "
               "weights + full cache + a chunk; compression time and its exponent", threads=2,
               runs=(("--lengths", "2048", "4096", "8192", "16384"),
                     ("--lengths", "32768"))),
    Experiment("long_suite", "long", "long_suite", "Qwen at 4k-32k: each family's best at 0.25 / 0.10 beside the "
               "full cache on NIAH single (prose, code): score, compress / prefill, decode / full, bytes, peak memory",
               threads=1, runs=(("--lengths", "32768", "--tasks", "niah_single", "--n", "1", "--methods", *LONG),
                                ("--lengths", "32768", "--tasks", "niah_single_code", "--n", "1", "--methods", *LONG),
                                ("--lengths", "16384", "--n", "1", "--methods", *LONG),
                                ("--lengths", "16384", "--tasks", "niah_single", "--n", "2", "--methods", *LONG),
                                ("--lengths", "16384", "--tasks", "niah_single_code", "--n", "2", "--methods", *LONG),
                                ("--lengths", "4096", "8192", "--n", "2", "--methods", *LONG),
                                ("--lengths", "4096", "--tasks", "niah_multikey", "niah_multivalue", "vt", "--n", "1",
                                 "--methods", *LONG))),
    Experiment("long_suite_bf16", "long", "long_suite", "Qwen in bf16 (as served; ~5x faster prefill on this "
               "CPU), chat format (chosen on dev seeds), at 16k-32k: the flagship by budget (0.25 / 0.10 / 0.05) and "
               "each family's best beside the full cache on NIAH single (prose, code)",
               threads=2, runs=(bf16(LONG_BF16, "--lengths", "32768", "16384", "--n", "3", "3"),
                                # then two more examples a haystack at 16k, the flagship's rows
                                bf16(("full", "summary@0.25,0.1,0.05", LONG_BF16[-1]), "--lengths", "16384", "--n",
                                     "5"),
                                # then three more a haystack at 32k (depths 0.4-0.6), the flagship and the full cache,
                                # then three more (depths 0.7-0.9)
                                *(bf16(("full", "summary@0.25,0.1,0.05"), "--lengths", "32768", "--n", n)
                                  for n in ("6", "9")))),
    Experiment("long_flagship_16k", "long", "long_suite", "the flagship by budget at 0.10 / 0.05 since it keeps the "
               "sentences in the retrieval heads alone: NIAH single (prose, code) at 16k on Qwen in bf16, chat, "
               "long_suite_bf16's ten examples at 16k, the full cache beside", threads=2,
               runs=(bf16(("full", "summary@0.1,0.05"), "--lengths", "16384", "--n", "5"),)),
    Experiment("long_flagship_32k", "long", "long_suite", "the same at 32k: the flagship by budget at 0.10 / 0.05 "
               "with the sentences in the retrieval heads alone, NIAH single (prose, code) on Qwen in bf16, chat, "
               "long_suite_bf16's first three examples a haystack at 32k (depths 0.1-0.3), the full cache beside",
               threads=2, runs=(bf16(("full", "summary@0.1,0.05"), "--lengths", "32768", "--n", "3"),)),
    Experiment("long_suite_tasks_bf16", "long", "long_suite", "the suite's other tasks (NIAH multikey / multivalue / "
               "multiquery, variable tracking, common / frequent words; prose and code) at 16k in bf16, chat: the "
               "flagship by budget and the best quantization and eviction beside the full cache (four examples "
               "of each but cwe, which the full cache misses; three of them at 32k, the flagship and the full cache "
               "only; at 0.10 snapkv and snapkv+turboquant)", threads=1,
               runs=(*(bf16(("full", "summary@0.25,0.1", LONG[3], "snapkv@0.25"), "--tasks", *tasks, "--lengths",
                             "16384", "--n", n) for tasks, n in ((LONG_TASKS, "1"), (ANSWERED, "4"))),
                     bf16(("full", "summary@0.25,0.1"), "--tasks", *LONG_TASKS[:2], "vt", "--lengths", "32768", "--n",
                          "1"),
                     # eviction and SnapKV's selection as codes at 0.10 beside the flagship
                     bf16(("snapkv@0.1", spec("snapkv+turboquant", (0.1,), key_shift=1)), "--tasks", *ANSWERED,
                          "--lengths", "16384", "--n", "4"))),
    Experiment("long_codes_16k", "long", "long_suite", "the two dev examples at 16k where the flagship's cover misses "
               "what the full cache answers (a code uuid, a multiquery value): which key codes copy the value",
               threads=2, runs=tuple(bf16(CODE_PROBE, "--tasks", task, "--lengths", "16384", "--n", n, "--first", first,
                                          "--seed", "1000") for task, n, first in (("niah_multikey_code", "3", "2"),
                                                                                   ("niah_multiquery", "1", "0")))),
    Experiment("long_pre_rope_decode_16k", "long", "long_suite", "the decode step at 16k of pca keys coded before RoPE "
               "(2.5 and 3.5 bits), read by the packed-code kernel that rebuilds and turns each key in registers, "
               "beside the flagship's cover and the full cache (one dev example, 16 steps)", threads=2,
               runs=(bf16(("full", "summary@0.25", LONG[3],
                           spec("turboquant", (0.25,), bits=3.5, key_basis="pca", pre_rope=True, unbiased="values",
                                skew=0)),
                          "--tasks", "niah_multiquery", "--lengths", "16384", "--n", "1", "--seed", "1000",
                          "--decode-steps", "16"),)),
    Experiment("answer_nll_16k", "long", "answer_nll", "the list and multikey tasks at 16k on dev seeds, "
               "teacher-forced on the full cache's answers: how closely the cover, its codes, keys centered before "
               "RoPE and pca keys coded before RoPE copy the values (NLL of the value tokens; recall moves 25 points "
               "an example)",
               methods=("summary@0.25", COVER_CODES, "turboquant_rope_centered:bits=3.5@0.25", LONG[3],
                        spec("turboquant", (0.25,), bits=3.5, key_basis="pca", pre_rope=True, unbiased="values",
                             skew=0)),
               lengths=(16384,), n=4, threads=2, args=("--model", "qwen2.5-coder-0.5b")),
    Experiment("answer_nll_cover_pre_rope_16k", "long", "answer_nll", "answer_nll_16k's examples with the flagship's "
               "cover at 0.25 holding pca keys coded before RoPE (3.5 bits) instead of rotated codes: whether the "
               "cover's exact anchors add to what pre-RoPE keys copy",
               methods=(spec("summary", (0.25,), cover=PRE_ROPE_COVER, score="surprisal"),),
               lengths=(16384,), n=4, threads=2, args=("--model", "qwen2.5-coder-0.5b")),
    Experiment("long_rope_centered_16k", "long", "long_suite", "the three list tasks at 16k on dev seeds: TurboQuant's "
               "rotated codes with keys centered after RoPE (the cover's) against keys less their pre-RoPE mean turned "
               "to each position (the turboquant_rope_centered diagnosis: accuracy only, no decode timing), everywhere "
               "or only where it shortens the key", threads=2,
               runs=tuple(bf16(methods, "--tasks", *ANSWERED[1:4], "--lengths", "16384", "--n", "4", "--seed", "1000",
                               "--decode-steps", "0")
                          for methods in (("full", COVER_CODES, "turboquant_rope_centered:bits=3.5@0.25"),
                                          ("full", "turboquant_rope_centered:bits=3.5,shorter=True@0.25")))),
    *[Experiment(name, "frontier", "frontier", what, lengths=(length,), n=n, threads=1,
                 methods=("summary", "snapkv", "turboquant", "echokv", spec("snapkv+turboquant", key_shift=1),
                          *([spec("snapkv+turboquant", (0.03, 0.05, 0.1, 0.125), **SNAPKV_HADAMARD)]
                            if length == 2048 else [])),
                 args=("--n-lm", str(n_lm), "--budgets", "0.03", "0.05", "0.1", "0.125", "0.25", "0.5", "--seed", "0"))
      for name, length, n, n_lm, what in (
          ("frontier", 2048, 20, 8, "bytes held against passkey / multikey accuracy and lm KL at 2k, budgets 0.03-0.5: "
           "the flagship (summary by budget) and each family's best beside the full cache"),
          ("frontier_4k", 4096, 10, 4, "the same at 4k (fewer examples: 10 retrieval, 4 lm per cell)"))],
    Experiment("frontier_quant_low", "frontier", "frontier", "the quantization family at 0.125 of 2k once TurboQuant "
               "codes 1.5 bits (keys 2, values 1): as published (by budget), and with pca keys coded before RoPE and "
               "unbiased values (chosen over the rotated form on dev seeds); test seeds, the frontier's counts",
               lengths=(2048,), n=20, threads=2,
               methods=("turboquant", spec("turboquant", bits=1.5, key_basis="pca", pre_rope=True, unbiased="values")),
               args=("--n-lm", "8", "--budgets", "0.125", "--seed", "0")),
    Experiment("frontier_flagship", "frontier", "frontier", "the flagship (summary by budget) and each family's best "
               "at 2k on 50 retrieval examples a task and 8 lm windows at 0.25 / 0.10 / 0.05, the full cache beside",
               lengths=(2048,), n=50, threads=2,
               methods=("summary", "snapkv", "turboquant", "echokv", spec("snapkv+turboquant", key_shift=1),
                        spec("snapkv+turboquant", (0.05, 0.1), **SNAPKV_HADAMARD)),
               args=("--n-lm", "8", "--budgets", "0.05", "0.1", "0.25", "--seed", "0")),
    Experiment("frontier_gemma", "frontier", "frontier", "the flagship on Gemma 3 270M at 2k (sliding-window layers "
               "kept as transformers keeps them, the budget on its three global layers of one KV head of dim 256) "
               "at 0.25 / 0.10 / 0.05, SnapKV and SnapKV's selection as codes beside, test seeds",
               lengths=(2048,), n=10, threads=1,
               methods=("summary", "snapkv", spec("snapkv+turboquant", (0.05, 0.1, 0.25), **SNAPKV_HADAMARD)),
               args=("--model", "gemma3-270m", "--n-lm", "4", "--budgets", "0.05", "0.1", "0.25", "--seed", "0")),
    Experiment("frontier_cover_pre_rope_dev", "frontier", "frontier", "the flagship at 0.25 beside the same cover "
               "holding pca keys coded before RoPE (3.5 bits), 2k, dev seeds: whether the keys that copy values at 16k "
               "on Qwen pay on SmolLM2 at 2k", lengths=(2048,), n=50, threads=2,
               methods=("summary", spec("summary", cover=PRE_ROPE_COVER, score="surprisal")),
               args=("--n-lm", "8", "--budgets", "0.25", "--seed", "1000")),
    Experiment("frontier_cover_pre_rope_qwen_dev", "frontier", "frontier", "lm KL at 0.25 on Qwen2.5-Coder at 2k, "
               "dev seeds: the flagship's rotated cover beside the same cover holding pca keys coded before RoPE "
               "(Qwen's k_proj bias turns with the position)", lengths=(2048,), n=0, threads=2,
               methods=("summary", spec("summary", cover=PRE_ROPE_COVER, score="surprisal")),
               args=("--model", "qwen2.5-coder-0.5b", "--n-lm", "8", "--budgets", "0.25", "--seed", "1000")),
    Experiment("frontier_cover_pre_rope_qwen", "frontier", "frontier", "the same on test seeds (the rule takes the "
               "cover coded before RoPE where the key projection has a bias)", lengths=(2048,), n=0, threads=2,
               methods=("summary", spec("summary", cover=PRE_ROPE_COVER, score="surprisal")),
               args=("--model", "qwen2.5-coder-0.5b", "--n-lm", "8", "--budgets", "0.25", "--seed", "0")),
    Experiment("frontier_lm32", "frontier", "frontier", "lm KL alone on 32 test windows (frontier_flagship's 8 "
               "first) at 0.25 / 0.10 / 0.05: the flagship beside SnapKV's selection as codes and TurboQuant, where "
               "8 windows separate them by less than one window's spread", lengths=(2048,), n=0, threads=1,
               methods=("summary", spec("snapkv+turboquant", (0.1, 0.05), key_shift=1), spec("turboquant", (0.25,)),
                        spec("snapkv+turboquant", (0.05, 0.1), **SNAPKV_HADAMARD)),
               args=("--n-lm", "32", "--budgets", "0.05", "0.1", "0.25", "--seed", "0")),
    Experiment("frontier_4k_lm16", "frontier", "frontier", "lm KL alone on 16 test windows at 4k (frontier_4k's 4 "
               "first) at 0.10 / 0.05 / 0.03: the flagship beside SnapKV's selection as codes, where 4 windows "
               "separate them by less than one window's spread", lengths=(4096,), n=0, threads=1,
               methods=("summary", spec("snapkv+turboquant", (0.03, 0.05, 0.1), **SNAPKV_HADAMARD)),
               args=("--n-lm", "16", "--budgets", "0.03", "0.05", "0.1", "--seed", "0")),
    Experiment("kl_positions", "frontier", "kl_positions", "lm KL by the continuation's position on dev seeds "
               "(where the flagship's KL lies at 0.1 / 0.05 beside SnapKV's selection as codes and codes alone; a "
               "longer recent window, the newest tokens exact)", lengths=(2048,), n=16, threads=2,
               methods=("summary@0.125,0.1,0.05", spec(COMPOSED, (0.125, 0.1), **SENTENCES),
                        spec(COMPOSED, (0.1,), **SENTENCES, summary_window=128),
                        spec(COMPOSED, (0.1,), **SENTENCES, summary_recent_exact=8),
                        spec(COMPOSED, (0.05,), **SENTENCES, bits=2, summary_recent_exact=8),
                        spec(COMPOSED, (0.05,), **SENTENCES, bits=2, summary_window=64, summary_recent_exact=8),
                        spec("snapkv+turboquant", (0.1, 0.05), key_shift=1),
                        spec("turboquant", (0.2,), bits=2, center=True),
                        spec("turboquant", (0.3,), bits=3, center=True)),
               args=("--seed", "1000")),
    Experiment("bad_input", "robust", "bad_input", "every bad input and the error kvsum gives"),
    Experiment("properties", "robust", "properties", "hypothesis statistics of the property tests", ext="txt"),
    Experiment("report", "report", "kvsum", "the decision report (kvsum report): report.html, report.md",
               part="report", out="dir", args=("--methods", "all,summary+turboquant", "--scaling-lengths",
                                               "1024,2048", "--time-limit", "480")),
    Experiment("check", "report", "check_report", "the report page in headless Chromium: loads, every plot decodes",
               out="none", args=("benchmarks/results/report/report.html",)),
]
