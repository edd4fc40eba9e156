"""Experiments of the GPU path (issue 34): the Triton kernels on a CUDA machine."""

from __future__ import annotations

from .base import Experiment

EXPERIMENTS = [
    Experiment("gpu", "gpu", "gpu", "decode step against the full cache (SDPA) at 4k-32k, KV memory held, prefill + "
               "compression time, Qwen2.5-Coder-0.5B in bf16 on a CUDA GPU: the flagship at 0.25 and 0.1, "
               "TurboQuant 3.5 / 2.5 bits, KIVI 4 bits",
               methods=("summary@0.25", "summary@0.1",
                        "turboquant:bits=3.5@0.3", "turboquant:bits=2.5@0.25", "kivi:bits=4@0.5"),
               lengths=(4096, 8192, 16384, 32768), threads=4,
               # the lent GPU machine could not install the model: its config and tokenizer, seeded weights (step
               # times, bytes and compression times depend on shapes only); `--export .gpu/qwen` writes them
               args=("--model", "qwen2.5-coder-0.5b", "--dtype", "bf16", "--rounds", "20", "--random-weights",
                     ".gpu/qwen")),
    Experiment("gpu_profile", "gpu", "gpu_profile", "where a decoding step's time goes on a CUDA GPU: kernels "
               "launched, the GPU's busy time and the wall time of one step per cache (PyTorch's profiler), at 8k "
               "and 32k", threads=4,
               args=("--model", "qwen2.5-coder-0.5b", "--dtype", "bf16", "--random-weights", ".gpu/qwen")),
    Experiment("step_ops", "gpu", "step_ops", "aten operations and Triton launches of one decoding step on the GPU "
               "path (counted under Triton's interpreter, no GPU), per layer beyond the full cache's", threads=1),
]
