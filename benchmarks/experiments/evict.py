"""Eviction experiments (benchmarks/evict.py, evict_stream.py, eval_foundation.py)."""

from __future__ import annotations

from .base import Experiment, spec

ADAPTIVE = spec("snapkv", allocation="adaptive")

EXPERIMENTS = [
    Experiment("foundation", "evict", "eval_foundation", "full, streaming_llm and random at 0.5 / 0.25 / 0.125",
               methods=("full", *(spec(m, (0.5, 0.25, 0.125)) for m in ("streaming_llm", "random"))),
               lengths=(2048,), n=20, threads=1, args=("--n-lm", "8")),
    Experiment("evict_perhead", "evict", "evict", "adaptive vs uniform per-head budgets: lm KL over a budget sweep",
               part="perhead", methods=("snapkv", "tova", "expected_attention"), lengths=(2048,), n=3, threads=2),
    Experiment("evict_decode", "evict", "evict", "decode-step time at 4k and 8k over the full cache's",
               part="decode", methods=("streaming_llm", "snapkv", "h2o", "restkv", ADAPTIVE), lengths=(4096, 8192),
               threads=2, args=("--budget", "0.25", "--steps", "10")),
    Experiment("evict_stream", "evict", "evict_stream", "decoding-time eviction, teacher-forced: KL against full",
               part="stream", methods=("streaming_llm", "snapkv", "h2o", "tova", "restkv", ADAPTIVE), threads=2,
               args=("--context", "512", "--tokens", "2048", "--chunk", "16", "--max-tokens", "512",
                     "--every", "64")),
    Experiment("evict_generate", "evict", "evict_stream", "1k context + 4096 generated tokens in bounded memory",
               part="generate", methods=("snapkv",), threads=2,
               args=("--context", "1024", "--tokens", "4096", "--max-tokens", "1024", "--every", "64",
                     "--record", "64")),
]
