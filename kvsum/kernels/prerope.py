"""A Triton kernel that scores queries against pca keys coded before RoPE (pca.KeyTransform), on the GPU.

Such keys cannot be scored on their principal axes as a rotation's codes are: each position turns its key
differently, so the key must exist in the head's own basis before the query meets it. PyTorch's path rebuilds every
key of the layer in global memory, (H, T, d) floats at each decoding step. This kernel (the counterpart of the CPU
kernel's `kv_score_prerope`, native.score_prerope, with the same arguments and numbers up to float summation order)
rebuilds them in registers instead, a block of BT tokens at a time: it decodes each width group's packed codes of
the block (the layout of kvsum/methods/quant/packing.py, code u of token t at t * c + u), looks their levels up and
sets each level at its axis, multiplies these coordinates (BT, r) by the head's axes times their deviations
(tl.dot, IEEE fp32), adds the mean, turns the block's keys by its cos / sin rows (their first halves: RoPE's two
halves are equal) and dots them with the head's query rows. Only the (H, M, T) scores are written.

Every width group of a head is read in the same launch: the kernel has one slot per width (1 to MAX_BITS, widths
known at compile time), an absent width's slot holds no code and reads nothing. An axis's place in its group's codes
(its rank among the axes of its width: KeyTransform orders each group's columns by axis) comes from the held
`widths`, so no column index is needed on the device. One launch per KV head, grid (token blocks, query-row blocks);
each head dimension compiles once, whatever a head's widths and group sizes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from . import kernel_input, levels_on, next_pow2
from .codes import _levels

BT = 32  # tokens per block
BM = 16  # query rows per block (a decoding step's rows per KV head; more take more blocks)
BK = 32  # axes per block of the rebuilding product
MAX_BITS = 8  # widths 1..MAX_BITS, one slot each (pca.MAX_BITS)
_SUM = tl.standard._sum_combine  # tl.sum is a jit function of the standard library (see flash.py)


@triton.jit
def _slot(z, data, lv, C, tok, tm, w, u, BITS: tl.constexpr):
    """z (BT, BK) + the levels of the group of width BITS (C codes per token) at the axes of that width, at their
    places u in the group's codes; 0.0 at the other axes."""
    f = tok[:, None].to(tl.int64) * C + u[None, :]
    return z + _levels(data, f, lv, BITS, tm[:, None] & (w == BITS)[None, :])


@triton.jit
def _prerope_kernel(out, q, mean, axes, std, widths, cos, sin, d1, l1, c1, d2, l2, c2, d3, l3, c3, d4, l4, c4,
                    d5, l5, c5, d6, l6, c6, d7, l7, c7, d8, l8, c8, h, M, T, R, D: tl.constexpr, BH: tl.constexpr,
                    BT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """out[h, m, t] = q[h, m] . (k_t cos[t] + rotate_half(k_t) sin[t]), k_t = mean + sum over the R axes i of
    level_i(t) std[i] axes[:, i], for tokens t of block program_id(0) and rows m of block program_id(1). The key
    is held as its two halves (BT, BH) each, so that rotate_half is a swap."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    j = tl.arange(0, BH)
    tm, mm, jm = t < T, m < M, j < D // 2
    k1 = tl.full((BT, BH), 0.0, tl.float32) + tl.load(mean + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    k2 = tl.full((BT, BH), 0.0, tl.float32) + tl.load(mean + D // 2 + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    for i0 in range(0, R, BK):
        i = i0 + tl.arange(0, BK)
        im = i < R
        w = tl.load(widths + i, mask=im, other=0).to(tl.int32)  # 0: no axis, no slot reads it
        u = tl.full((BK,), 0, tl.int32)  # each axis's rank among the axes of its width before it
        for a0 in range(0, i0 + BK, BK):
            a = a0 + tl.arange(0, BK)
            wa = tl.load(widths + a, mask=a < R, other=0).to(tl.int32)
            same = (wa[None, :] == w[:, None]) & (a[None, :] < i[:, None]) & (a < R)[None, :]
            u += tl.reduce(same.to(tl.int32), 1, _SUM)
        z = tl.full((BT, BK), 0.0, tl.float32)
        z = _slot(z, d1, l1, c1, t, tm, w, u, 1)
        z = _slot(z, d2, l2, c2, t, tm, w, u, 2)
        z = _slot(z, d3, l3, c3, t, tm, w, u, 3)
        z = _slot(z, d4, l4, c4, t, tm, w, u, 4)
        z = _slot(z, d5, l5, c5, t, tm, w, u, 5)
        z = _slot(z, d6, l6, c6, t, tm, w, u, 6)
        z = _slot(z, d7, l7, c7, t, tm, w, u, 7)
        z = _slot(z, d8, l8, c8, t, tm, w, u, 8)
        s = tl.load(std + i, mask=im, other=0.0).to(tl.float32)[:, None]  # (BK, 1): the rows of w = axes^T std
        wm = im[:, None] & jm[None, :]
        w1 = tl.load(axes + j[None, :] * R + i[:, None], mask=wm, other=0.0).to(tl.float32) * s
        w2 = tl.load(axes + (D // 2 + j[None, :]) * R + i[:, None], mask=wm, other=0.0).to(tl.float32) * s
        k1 += tl.dot(z, w1, input_precision="ieee")
        k2 += tl.dot(z, w2, input_precision="ieee")
    tj = t[:, None] * D + j[None, :]  # the tables' first halves: RoPE's two halves are equal (as the CPU kernel reads)
    tjm = tm[:, None] & jm[None, :]
    c = tl.load(cos + tj, mask=tjm, other=0.0)
    sn = tl.load(sin + tj, mask=tjm, other=0.0)
    r1 = k1 * c - k2 * sn
    r2 = k2 * c + k1 * sn
    qm = mm[:, None] & jm[None, :]
    row = (h * M + m[:, None]) * D + j[None, :]
    q1 = tl.load(q + row, mask=qm, other=0.0)
    q2 = tl.load(q + D // 2 + row, mask=qm, other=0.0)
    acc = tl.dot(r1, tl.trans(q1), input_precision="ieee")
    acc += tl.dot(r2, tl.trans(q2), input_precision="ieee")
    tl.store(out + (h * M + m[None, :]) * T + t[:, None], acc, mask=tm[:, None] & mm[None, :])


def score_prerope(heads: list, cos: Tensor, sin: Tensor, q: Tensor) -> Tensor:
    """native.score_prerope on the GPU: pca keys coded before RoPE, `heads` as pca.KeyTransform's (fp16 axes (d, r),
    deviations (r,), widths (r,) uint8, mean (d,); width groups as (columns, bits, levels (2**bits,), Packed codes
    (T, c))), cos / sin (T, d) at the keys' positions, queries q (H, M, d) -> (H, M, T) float32. The exact
    outliers are not here (KeyTransform._with_exact puts them in)."""
    H, M, d = q.shape
    if d % 2 or len(heads) != H or cos.shape[-1] != d or any(hd["mean"].shape[0] != d for hd in heads):
        raise ValueError(f"score_prerope: {len(heads)} heads, tables {tuple(cos.shape)}, queries {tuple(q.shape)}")
    q = q.float().contiguous()
    cos, sin = kernel_input(cos.float()), kernel_input(sin.float())
    T = cos.shape[0]
    out = q.new_empty(H, M, T)
    if T == 0 or M == 0:
        return out
    grid = (triton.cdiv(T, BT), triton.cdiv(M, BM))
    for h, hd in enumerate(heads):
        widths = hd["widths"].contiguous()
        slots = [(widths, q, 0)] * MAX_BITS  # an absent width: no axis has it, so its slot loads nothing
        for _, bits, levels, codes in hd["groups"]:
            if codes.shape[0] != T:
                raise ValueError(f"score_prerope: codes of {codes.shape[0]} tokens, tables of {T}")
            slots[bits - 1] = (codes.data, levels_on(levels, q.device), codes.shape[1])
        _prerope_kernel[grid](out, q, hd["mean"].contiguous(), hd["axes"].contiguous(), hd["std"].contiguous(),
                              widths, cos, sin, *(x for slot in slots for x in slot), h, M, T, hd["axes"].shape[1],
                              D=d, BH=next_pow2(d // 2), BT=BT, BM=BM, BK=BK, num_warps=4 if d <= 128 else 8)
    return out
