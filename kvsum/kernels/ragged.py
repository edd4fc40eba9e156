"""Triton kernels for ragged per-head entries with additive biases (EntryState's packed layout), on the GPU.

Heads hold different numbers of entries, packed one after another into one (N, d) tensor. PyTorch reads them
with one matmul per head (a dozen launches per head) or one masked matmul over all N entries (H times the
reads); these kernels read each head's own slice, one launch per layer for the scores and one for the mix,
in the storage dtype (fp16 / bf16 / fp32) with fp32 products. Scores come out as (H, M, longest head), -inf
past each head's end, and the mix takes weights in that layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import block, kernel_input, mix_grid
from .codes import _mix_tile, _store_part

BT = 32  # entries per block
BM = 16  # query rows per block


@triton.jit
def _score_kernel(out, q, keys, bias, starts, scale, M, n_out, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """out[h, m, t] = scale * <q[h, m], keys[starts[h] + t]> (+ bias[starts[h] + t]), -inf past head h's end;
    query rows in blocks of BM (program_id(2))."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    start = tl.load(starts + h)
    n = tl.load(starts + h + 1) - start
    tm = t < n
    row = (start + t).to(tl.int64)
    acc = tl.full((BT, BM), 0.0, tl.float32)
    for c0 in tl.static_range(0, D, BC):
        j = c0 + tl.arange(0, BC)
        jm = j < D
        k = tl.load(keys + row[:, None] * D + j[None, :], mask=tm[:, None] & jm[None, :], other=0.0).to(tl.float32)
        qv = tl.load(q + (h * M + m[:, None]) * D + j[None, :], mask=(m[:, None] < M) & jm[None, :], other=0.0)
        acc += tl.dot(k, tl.trans(qv), input_precision="ieee")
    s = acc * scale
    if HAS_BIAS:
        s += tl.load(bias + row, mask=tm, other=0.0).to(tl.float32)[:, None]
    s = tl.where(tm[:, None], s, float("-inf"))
    tl.store(out + (h * M + m[None, :]) * n_out + t[:, None], s, mask=(t < n_out)[:, None] & (m < M)[None, :])


@triton.jit
def _mix_kernel(part, p, values, starts, M, n_p, CHUNK, D: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
                BC: tl.constexpr):
    """part[s, h, m, j] = sum over entries t of chunk s of head h: p[h, m, t] values[starts[h] + t, j]."""
    h, t0, j, jm, m, mm, acc = _mix_tile(D, M, CHUNK, BM, BC)
    start = tl.load(starts + h)
    n = tl.load(starts + h + 1) - start
    for tt in range(t0, t0 + CHUNK, BT):
        t = tt + tl.arange(0, BT)
        tm = t < n
        row = (start + t).to(tl.int64)
        v = tl.load(values + row[:, None] * D + j[None, :], mask=tm[:, None] & jm[None, :], other=0.0).to(tl.float32)
        w = tl.load(p + (h * M + m[:, None]) * n_p + t[None, :], mask=mm[:, None] & tm[None, :], other=0.0)
        acc += tl.dot(w, v, input_precision="ieee")
    _store_part(part, acc, M, m, mm, j, jm, D)


def scores(q: Tensor, keys: Tensor, bias: Tensor | None, starts: Tensor, longest: int, scale: float) -> Tensor:
    """Queries q (H, M, d) against head h's entries keys[starts[h]:starts[h + 1]] (N, d) -> (H, M, longest),
    times `scale`, plus `bias` (N,), -inf past each head's end."""
    H, M, d = q.shape
    q = q.float().contiguous()
    out = q.new_empty(H, M, longest)
    if longest:
        _score_kernel[(H, triton.cdiv(longest, BT), triton.cdiv(M, BM))](
            out, q, kernel_input(keys), kernel_input(bias) if bias is not None else q, starts, float(scale), M,
            longest, D=d, HAS_BIAS=bias is not None, BT=BT, BM=BM, BC=block(d))
    return out


def mix(p: Tensor, values: Tensor, starts: Tensor) -> Tensor:
    """Weights p (H, M, longest) over head h's entries values[starts[h]:starts[h + 1]] (N, d) -> (H, M, d) fp32."""
    H, M, n_p = p.shape
    d = values.shape[-1]
    p = p.float().contiguous()
    if not n_p:
        return p.new_zeros(H, M, d)
    bc, nb, per, S = mix_grid(n_p, H, d, BT)
    values, outs = kernel_input(values), []
    for m0 in range(0, M, BM):  # more rows than a block (a prefill chunk): one launch per block of rows
        rows = p[:, m0:m0 + BM].contiguous()
        part = p.new_empty(S, H, rows.shape[1], d)
        _mix_kernel[(H, S, nb)](part, rows, values, starts, rows.shape[1], n_p, per, D=d, BT=BT, BM=BM, BC=bc)
        outs.append(part.sum(0))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
