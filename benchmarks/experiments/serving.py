"""Experiments of the serving path: saved caches, forks and the prefix store (issue 33)."""

from __future__ import annotations

from .base import Experiment

EXPERIMENTS = [
    Experiment("serving", "perf", "serving", "saved caches at 4k on SmolLM2 (file / nbytes, save + load / prefill, "
               "fork, greedy after load) and 4 processes x 50 Store calls on 10 prompts, plus a killed writer",
               threads=2, args=("--length", "4096")),
]
