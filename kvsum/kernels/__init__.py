"""GPU kernels (Triton): attention read straight from packed codes and ragged per-head entries.

On a CUDA tensor PyTorch has no operation that reads 3-bit codes, so its path expands every code to a float32
level in global memory at each decoding step. These kernels decode the codes in registers instead:
`codes.py` (TurboQuant) and `kivi.py` score queries against packed codes and mix values from them, `ragged.py`
scores and mixes ragged per-head entries with additive biases (summary and eviction states) in one launch per
layer, `prerope.py` scores pca keys coded before RoPE, each rebuilt and turned in registers. They are the GPU
counterpart of the CPU kernel (kvsum/methods/quant/native.py, which dispatches to them) and serve the same calls
with the same numbers (up to float summation order); kvsum/attention.py joins their scores with the
full-precision tail in one softmax. `flash.py` goes further for TurboQuant's codes at a decoding
step: scores, online softmax and value mix in one pass, no logit written to memory; `online.py` joins its partial
result with the exact sinks, windows and the tail (TurboQuantState.online, ConcatState.online).

They serve CUDA tensors where triton is installed (`pip install 'kvsum[gpu]'`); `KVSUM_NATIVE=0` turns them off,
as it does the CPU kernel. `forced()` routes CPU tensors through them too: only meaningful under Triton's
interpreter (TRITON_INTERPRET=1 set before the kernel modules are imported), which is how they are tested
without a GPU. This module does not import triton; the kernel modules do, when first used. The kernels use
triton.language's builtins only (tl.full, not tl.zeros, itself a jit function of triton's standard library; see
flash.py for reductions), so they also run interpreted where triton was imported before TRITON_INTERPRET was set.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch
from torch import Tensor

_forced = False


@functools.lru_cache(maxsize=1)
def installed() -> bool:
    """Whether triton can be imported here."""
    return importlib.util.find_spec("triton") is not None


def enabled() -> bool:
    """Whether the kernels may run at all: triton installed and KVSUM_NATIVE not 0."""
    return os.environ.get("KVSUM_NATIVE", "1") != "0" and installed()


def serves(*tensors: Tensor | None) -> bool:
    """Whether the kernels read these tensors: all on a CUDA device (any device while `forced`), kernels enabled."""
    if not enabled():
        return False
    return _forced or all(t.is_cuda for t in tensors if t is not None)


@contextlib.contextmanager
def forced():
    """Within it, every tensor (CPU ones too) is read by the Triton kernels: for tests under the interpreter."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


@functools.lru_cache(maxsize=512)
def _offsets(lengths: tuple[int, ...], device: str) -> Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device)


def offsets(lengths, device) -> Tensor:
    """(H + 1,) int64 offsets of runs of `lengths` entries packed one after another, on `device` (cached per
    lengths and device: metadata, never held by a state)."""
    return _offsets(tuple(int(n) for n in lengths), str(device))


@functools.lru_cache(maxsize=64)
def _table(levels: tuple[float, ...], device: str) -> Tensor:
    return torch.tensor(levels, dtype=torch.float32, device=device)


def levels_on(levels: Tensor, device) -> Tensor:
    """A codebook's levels as float32 on `device` (KIVI's integer levels are a CPU constant: copied once per
    device and cached, not at every decoding step)."""
    if levels.device.type == torch.device(device).type:
        return levels.to(device=device, dtype=torch.float32).contiguous()
    return _table(tuple(levels.tolist()), str(device))


def longest_run(runs: Tensor) -> int:
    """The most entries of any run of (H + 1,) offsets `runs` (a CPU tensor, metadata); 0 for no run."""
    return int((runs[1:] - runs[:-1]).max()) if runs.numel() > 1 else 0


def next_pow2(n: int, least: int = 16) -> int:
    """The least power of 2 >= n and >= `least` (Triton's blocks are powers of 2, tl.dot's at least 16)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def block(d: int) -> int:
    """Channels a kernel program reads at a time: up to 64."""
    return min(64, next_pow2(d))


def chunk(T: int, programs: int, bt: int, target: int = 256) -> tuple[int, int]:
    """(tokens per program, programs along the tokens) when T tokens are split across programs for a mix: enough
    programs in all (about `target`, `programs` already from heads and channel blocks) to fill a GPU, at least 4
    blocks of bt tokens each."""
    per = -(-T // max(1, target // max(1, programs)))
    per = max(4 * bt, -(-per // bt) * bt)
    return per, max(1, -(-T // per))


def mix_grid(T: int, heads: int, d: int, bt: int) -> tuple[int, int, int, int]:
    """A mix's launch over T tokens of `heads` heads and d channels: (channels a block, channel blocks, tokens per
    program, programs along the tokens)."""
    bc = block(d)
    nb = -(-d // bc)
    return (bc, nb, *chunk(T, heads * nb, bt))


def kernel_input(t: Tensor) -> Tensor:
    """`t` as a kernel may load it: contiguous; float32 where a CPU tensor is bfloat16 (the interpreter runs on
    numpy, which has no bfloat16)."""
    if t.dtype == torch.bfloat16 and not t.is_cuda:
        t = t.float()
    return t.contiguous()
