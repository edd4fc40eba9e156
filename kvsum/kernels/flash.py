"""A fused decoding-attention kernel over TurboQuant's packed codes: scores, online softmax and value mix in one
pass over the codes (flash-decoding), never writing a score or a probability to global memory.

Each program takes one KV head and one chunk of its tokens, decodes key codes into logits for the head's M query
rows (as codes.py's score kernel does), keeps a running maximum and sum of exponentials, and mixes the decoded
value codes with the running weights; it writes its partial (max, sum, weighted values in the rotated basis, one
block per value part). Joint attention joins the chunks with the exact entries and the full-precision tail in the
same softmax (online.py's `join`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import chunk, kernel_input, longest_run, next_pow2
from .codes import BM, BT, _channels, _dot_ix, _levels, _on, _side

NEG = tl.constexpr(-1.0e30)  # the running maximum before any token: finite, so an all-masked chunk weighs 0, not NaN
# tl.max / tl.sum are jit functions of triton's standard library, which cannot run interpreted where triton was
# imported before TRITON_INTERPRET was set; tl.reduce with their combine functions is what they compile to (and
# the interpreter computes those with numpy)
_MAX, _SUM = tl.standard._elementwise_max, tl.standard._sum_combine


@triton.jit
def _mix_part(acc, w, data, lv, hc, tok, tm, H_codes, C: tl.constexpr, BITS: tl.constexpr, BCP: tl.constexpr):
    """acc (BM, BCP) += w (BM, BT) . levels of the C value channels of tokens `tok`, head hc."""
    j = tl.arange(0, BCP)
    f = (tok[:, None].to(tl.int64) * H_codes + hc) * C + j[None, :]
    x = _levels(data, f, lv, BITS, tm[:, None] & (j < C)[None, :])
    return acc + tl.dot(w, x, input_precision="ieee")


@triton.jit
def _flash_kernel(m_out, l_out, out, q, kx_a, kd_a, kl_a, kx_b, kd_b, kl_b, vx_a, vd_a, vl_a, vx_b, vd_b, vl_b, k_norm,
                  v_norm, add, shrink, skip, bias, runs, scale, T, M, CHUNK, D: tl.constexpr, HAS_IX: tl.constexpr,
                  CK_A: tl.constexpr, KB_A: tl.constexpr, CK_B: tl.constexpr, KB_B: tl.constexpr,
                  CV_A: tl.constexpr, VB_A: tl.constexpr, CV_B: tl.constexpr, VB_B: tl.constexpr,
                  HAS_ADD: tl.constexpr, HAS_ON: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RUNS: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, BCV_A: tl.constexpr,
                  BCV_B: tl.constexpr):
    """Head h = program_id(0), tokens of chunk s = program_id(1): logits scale * |k_norm| * <q, key levels>
    (+ bias[hc, tok]; + add[h, m], with HAS_ON times 1 where k_norm's sign bit is clear, else shrink[hc]; -inf
    where skip[hc, tok]), running max / sum / weighted value levels per query row, written to out (S, H, M, D) at
    each value part's channels. tok = t, hc = h; with RUNS (one store holding every head's entries one run after
    another) tok = runs[h] + t, hc = 0, up to the run's end. HAS_IX: two parts a side (an outlier split), their
    channels kx_* / vx_* (H_codes, C) read here."""
    h, s = tl.program_id(0), tl.program_id(1)
    H = tl.num_programs(0)
    if RUNS:
        base = tl.load(runs + h)
        n = tl.load(runs + h + 1) - base
        hc = 0
        H_codes = 1
    else:
        base = 0
        n = T
        hc = h
        H_codes = H
    m = tl.arange(0, BM)
    mm = m < M
    run_max = tl.full((BM,), NEG, tl.float32)
    run_sum = tl.full((BM,), 0.0, tl.float32)
    va = tl.full((BM, BCV_A), 0.0, tl.float32)
    vb = tl.full((BM, BCV_B), 0.0, tl.float32)
    if HAS_ADD:
        shift = tl.load(add + h * M + m, mask=mm, other=0.0)
    t0 = s * CHUNK
    for tt in range(t0, t0 + CHUNK, BT):
        t = tt + tl.arange(0, BT)
        tm = t < n
        tok = base + t
        logit = tl.full((BT, BM), 0.0, tl.float32)
        logit = _dot_ix(logit, q, kx_a, kd_a, kl_a, h, hc, tok, tm, M, H_codes, D, CK_A, KB_A, HAS_IX, BT, BM, BC)
        if CK_B > 0:
            logit = _dot_ix(logit, q, kx_b, kd_b, kl_b, h, hc, tok, tm, M, H_codes, D, CK_B, KB_B, HAS_IX, BT, BM, BC)
        kn_raw = tl.load(k_norm + hc * T + tok, mask=tm, other=0.0)
        kn = tl.abs(kn_raw.to(tl.float32))
        sc = tl.trans(logit * scale * kn[:, None])  # (BM, BT)
        if HAS_BIAS:
            sc += tl.load(bias + hc * T + tok, mask=tm, other=0.0).to(tl.float32)[None, :]
        if HAS_ADD:
            if HAS_ON:
                neg = kn_raw.to(tl.int16, bitcast=True) < 0  # fp16's sign bit (-0.0 too)
                on = tl.where(neg, tl.load(shrink + hc).to(tl.float32), 1.0)
                sc += shift[:, None] * on[None, :]
            else:
                sc += shift[:, None]
        keep = tm
        if HAS_SKIP:
            keep = keep & (tl.load(skip + hc * T + tok, mask=tm, other=1) == 0)
        sc = tl.where(keep[None, :], sc, float("-inf"))
        new_max = tl.maximum(run_max, tl.reduce(sc, 1, _MAX))
        alpha = tl.exp(run_max - new_max)
        p = tl.exp(sc - new_max[:, None])
        run_sum = run_sum * alpha + tl.reduce(p, 1, _SUM)
        run_max = new_max
        vn = tl.load(v_norm + hc * T + tok, mask=tm, other=0.0).to(tl.float32)
        w = p * vn[None, :]
        va = _mix_part(va * alpha[:, None], w, vd_a, vl_a, hc, tok, tm, H_codes, CV_A, VB_A, BCV_A)
        if CV_B > 0:
            vb = _mix_part(vb * alpha[:, None], w, vd_b, vl_b, hc, tok, tm, H_codes, CV_B, VB_B, BCV_B)
    row = (s * H + h) * M + m
    tl.store(m_out + row, run_max, mask=mm)
    tl.store(l_out + row, run_sum, mask=mm)
    ja = tl.arange(0, BCV_A)
    ca = _channels(vx_a, hc, ja, ja < CV_A, CV_A, HAS_IX)
    tl.store(out + row[:, None] * D + ca[None, :], va, mask=mm[:, None] & (ja < CV_A)[None, :])
    if CV_B > 0:
        jb = tl.arange(0, BCV_B)
        cb = _channels(vx_b, hc, jb, jb < CV_B, CV_B, HAS_IX)
        tl.store(out + row[:, None] * D + cb[None, :], vb, mask=mm[:, None] & (jb < CV_B)[None, :])


def coded(kparts: list, vparts: list, qr: Tensor, k_norm: Tensor, v_norm: Tensor, scale: float,
          add: Tensor | None = None, skip: Tensor | None = None, shrink: Tensor | None = None,
          bias: Tensor | None = None, runs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Attention of rotated queries qr (H, M, d) over T coded tokens (parts as native.py takes them, at most two a
    side), logits scale * |k_norm[h, t]| * <qr, key> + add[h, m], the add times, where `shrink` (H,) is given, 1
    for a key whose fp16 norm has its sign bit clear and shrink[h] for one whose is set (centered codes' flags, read
    here rather than expanded at every step), + bias[h, t] (a composition's per-entry log-mass); none where
    skip[h, t] (uint8) is set. With `runs` (H + 1 offsets, CPU metadata) the codes are one store (T, 1, c) holding
    head h's entries at runs[h]:runs[h + 1], as codes.py reads a composition's ragged heads; shrink, bias and skip
    index that store. Returns the partial per chunk of tokens, stacked (online.py): max (S, H, M), sum of
    exponentials (S, H, M), weighted rotated values (S, H, M, d)."""
    if shrink is not None and k_norm.dtype != torch.float16:
        raise ValueError(f"flags in the norms' sign bits need fp16 norms, got {k_norm.dtype}")
    H, M, d = qr.shape
    T = kparts[0][0].shape[0]
    qr = qr.float().contiguous()
    ck = [p[0].shape[2] for p in kparts] + [0]
    cv = [p[0].shape[2] for p in vparts] + [0]
    kb = [p[0].bits for p in kparts] + [kparts[0][0].bits]
    vb = [p[0].bits for p in vparts] + [vparts[0][0].bits]
    longest = T if runs is None else longest_run(runs)
    per, S = chunk(longest, H, BT)
    m_out, l_out = qr.new_empty(S, H, M), qr.new_empty(S, H, M)
    out = qr.new_empty(S, H, M, d)  # every channel written: one part of all d, or a split's two complementary ones
    split = kparts[0][1] is not None
    if split != (vparts[0][1] is not None) or sum(cv) != d or (split and (len(kparts) != 2 or len(vparts) != 2)):
        raise ValueError("flash.coded reads one part of all channels a side, or an outlier split's two")
    k_norm, v_norm = kernel_input(k_norm), kernel_input(v_norm)
    add = add.float().contiguous() if add is not None else None
    bias = kernel_input(bias) if bias is not None else None
    runs = _on(runs, qr.device) if runs is not None else None
    _flash_kernel[(H, S)](
        m_out, l_out, out, qr, *_side(kparts), *_side(vparts), k_norm, v_norm,
        *[x if x is not None else k_norm for x in (add, shrink, skip, bias, runs)], float(scale), T, M, per,
        D=d, HAS_IX=split, CK_A=ck[0], KB_A=kb[0], CK_B=ck[1], KB_B=kb[1], CV_A=cv[0], VB_A=vb[0], CV_B=cv[1],
        VB_B=vb[1], HAS_ADD=add is not None, HAS_ON=shrink is not None, HAS_SKIP=skip is not None,
        HAS_BIAS=bias is not None, RUNS=runs is not None, BT=BT, BM=BM, BC=min(64, next_pow2(max(ck))),
        BCV_A=next_pow2(cv[0]), BCV_B=next_pow2(max(cv[1], 1)))
    return m_out, l_out, out


def skip_mask(flat: Tensor, H: int, T: int) -> Tensor:
    """(H, T) uint8 with 1 at flat indices h * T + t (tokens another state holds exactly, e.g. summary's anchors)."""
    return torch.zeros(H * T, dtype=torch.uint8, device=flat.device).index_fill_(0, flat, 1).view(H, T)
