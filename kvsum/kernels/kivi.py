"""Triton kernels for KIVI's packed codes (native.score_groups / native.mix_runs on the GPU).

Keys: codes (G, H, g, d), group gi of g tokens with its own per-channel scales, which the caller folds into one
query per group and head. Values: codes (T, H, d) with a scale and a minimum per token, head and run of ch
channels, applied here while the codes are decoded (codes.py's `_levels`): no code is expanded in global memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import block, levels_on, mix_grid, next_pow2
from .codes import BM, BT, _levels, _mix_tile, _store_part
from .flash import _MAX, _SUM, NEG


@triton.jit
def _group_kernel(out, qg, data, lv, H, g, M, T_out, D: tl.constexpr, BITS: tl.constexpr, BG: tl.constexpr,
                  BM: tl.constexpr, BC: tl.constexpr):
    """out[h, m, gi * g + u] = sum_j qg[gi, h, m, j] levels[code(gi, h, u, j)], one program per (head, group)."""
    h, gi = tl.program_id(0), tl.program_id(1)
    u = tl.arange(0, BG)
    um = u < g
    m = tl.arange(0, BM)
    mm = m < M
    row = ((gi * H + h) * g + u).to(tl.int64)
    acc = tl.full((BG, BM), 0.0, tl.float32)
    for c0 in tl.static_range(0, D, BC):
        j = c0 + tl.arange(0, BC)
        jm = j < D
        x = _levels(data, row[:, None] * D + j[None, :], lv, BITS, um[:, None] & jm[None, :])
        qv = tl.load(qg + ((gi * H + h) * M + m[:, None]) * D + j[None, :], mask=mm[:, None] & jm[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(qv), input_precision="ieee")
    t = gi * g + u
    tl.store(out + (h * M + m[None, :]) * T_out + t[:, None], acc, mask=um[:, None] & mm[None, :])


@triton.jit
def _runs_kernel(part, p, sp_h, sp_m, data, lv, norms, sn_r, sn_h, sn_t, mins, sm_r, sm_h, sm_t, T, H, M, ch, CHUNK,
                 D: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """part[s, h, m, j] = sum over tokens t of chunk s: p[h, m, t] (norms[j / ch, h, t] level(t, h, j) +
    mins[j / ch, h, t]); norms and mins read through their strides (no copy), p with token stride 1."""
    h, t0, j, jm, m, mm, acc = _mix_tile(D, M, CHUNK, BM, BC)
    r = j // ch
    for tt in range(t0, t0 + CHUNK, BT):
        t = tt + tl.arange(0, BT)
        tm = t < T
        both = tm[:, None] & jm[None, :]
        x = _levels(data, (t[:, None].to(tl.int64) * H + h) * D + j[None, :], lv, BITS, both)
        sc = tl.load(norms + r[None, :] * sn_r + h * sn_h + t[:, None] * sn_t, mask=both, other=0.0).to(tl.float32)
        mn = tl.load(mins + r[None, :] * sm_r + h * sm_h + t[:, None] * sm_t, mask=both, other=0.0).to(tl.float32)
        w = tl.load(p + h * sp_h + m[:, None] * sp_m + t[None, :], mask=mm[:, None] & tm[None, :], other=0.0)
        acc += tl.dot(w, x * sc + mn, input_precision="ieee")
    _store_part(part, acc, M, m, mm, j, jm, D)


def score_groups(codes, levels: Tensor, qg: Tensor) -> Tensor:
    """native.score_groups on the GPU: packed codes (G, H, g, d) against qg (G, H, M, d) -> (H, M, G * g)."""
    G, H, g, d = codes.shape
    M = qg.shape[2]
    qg = qg.float().contiguous()
    out = qg.new_empty(H, M, G * g)
    if G:
        _group_kernel[(H, G)](out, qg, codes.data, levels_on(levels, qg.device), H, g, M, G * g, D=d,
                              BITS=codes.bits, BG=next_pow2(g), BM=BM, BC=block(d))
    return out


def _tokens_last(t: Tensor) -> Tensor:
    """t with a unit stride on its last dim (a copy only where it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def mix_runs(codes, levels: Tensor, p: Tensor, norms: Tensor, mins: Tensor) -> Tensor:
    """native.mix_runs on the GPU: weights p (H, M, T) over packed codes (T, H, d / ch, ch) with a scale and a
    minimum per token, head and run of ch channels, norms and mins (d / ch, H, T) -> (H, M, d)."""
    T, H, runs, ch = codes.shape
    d, M = runs * ch, p.shape[1]
    p = _tokens_last(p.float())
    norms, mins = (x.float() if x.dtype == torch.bfloat16 and not x.is_cuda else x for x in (norms, mins))
    if not T:
        return p.new_zeros(H, M, d)
    bc, nb, per, S = mix_grid(T, H, d, BT)
    part = p.new_empty(S, H, M, d)
    lv = levels_on(levels, p.device)
    _runs_kernel[(H, S, nb)](part, p, p.stride(0), p.stride(1), codes.data, lv, norms, *norms.stride(), mins,
                             *mins.stride(), T, H, M, ch, per,
                             D=d, BITS=codes.bits, BT=BT, BM=BM, BC=bc)
    return part.sum(0)


@triton.jit
def _flash_kernel(m_out, l_out, acc_out, q, kdata, vdata, lv, k_scale, k_min, v_scale, v_min, scale, G, H, g, M, R,
                  ch, CHUNK, D: tl.constexpr, BITS: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr,
                  BC: tl.constexpr, BD: tl.constexpr):
    """A decoding step over KIVI's codes in one pass, head h = program_id(0), groups of chunk program_id(1): keys
    level * k_scale + k_min per (group, head, channel), values level * v_scale + v_min per (token, head, run of ch
    channels); running max, sum and weighted values per query row, as flash.py's kernel keeps them."""
    h, s = tl.program_id(0), tl.program_id(1)
    m = tl.arange(0, BM)
    mm = m < M
    u = tl.arange(0, BG)
    um = u < g
    jd = tl.arange(0, BD)
    jdm = jd < D
    run_max = tl.full((BM,), NEG, tl.float32)
    run_sum = tl.full((BM,), 0.0, tl.float32)
    acc = tl.full((BM, BD), 0.0, tl.float32)
    g0 = s * CHUNK
    for gi in range(g0, tl.minimum(g0 + CHUNK, G)):
        row = ((gi * H + h) * g + u).to(tl.int64)
        logit = tl.full((BG, BM), 0.0, tl.float32)
        for c0 in tl.static_range(0, D, BC):
            j = c0 + tl.arange(0, BC)
            jm = j < D
            both = um[:, None] & jm[None, :]
            x = _levels(kdata, row[:, None] * D + j[None, :], lv, BITS, both)
            sc = tl.load(k_scale + (gi * H + h) * D + j, mask=jm, other=0.0).to(tl.float32)
            mn = tl.load(k_min + (gi * H + h) * D + j, mask=jm, other=0.0).to(tl.float32)
            k = tl.where(both, x * sc[None, :] + mn[None, :], 0.0)
            qv = tl.load(q + (h * M + m[:, None]) * D + j[None, :], mask=mm[:, None] & jm[None, :], other=0.0)
            logit += tl.dot(k, tl.trans(qv), input_precision="ieee")
        p_s = tl.where(um[None, :], tl.trans(logit) * scale, float("-inf"))  # (BM, BG)
        new_max = tl.maximum(run_max, tl.reduce(p_s, 1, _MAX))
        alpha = tl.exp(run_max - new_max)
        p = tl.exp(p_s - new_max[:, None])
        run_sum = run_sum * alpha + tl.reduce(p, 1, _SUM)
        run_max = new_max
        t = (gi * g + u).to(tl.int64)
        both = um[:, None] & jdm[None, :]
        x = _levels(vdata, (t[:, None] * H + h) * D + jd[None, :], lv, BITS, both)
        at = (t[:, None] * H + h) * R + jd[None, :] // ch
        sc = tl.load(v_scale + at, mask=both, other=0.0).to(tl.float32)
        mn = tl.load(v_min + at, mask=both, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, x * sc + mn, input_precision="ieee")
    r = (s * tl.num_programs(0) + h) * M + m
    tl.store(m_out + r, run_max, mask=mm)
    tl.store(l_out + r, run_sum, mask=mm)
    tl.store(acc_out + r[:, None] * D + jd[None, :], acc, mask=mm[:, None] & jdm[None, :])


def attend(k_codes, v_codes, levels: Tensor, q: Tensor, k_scale: Tensor, k_min: Tensor, v_scale: Tensor,
           v_min: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Queries q (H, M, d) over KIVI's coded tokens in one pass: keys (G, H, g, d) with k_scale / k_min (G, H, 1, d),
    values (n_q, H, d / ch, ch) with v_scale / v_min (n_q, H, d / ch, 1). Returns the partial (max, sum, values)
    of kvsum/kernels/online.py per chunk of groups, stacked."""
    G, H, g, d = k_codes.shape
    R, ch = v_codes.shape[2], v_codes.shape[3]
    M = q.shape[1]
    q = q.float().contiguous()
    per = max(1, -(-G // max(1, 256 // H)))  # groups per program: about 256 programs in all
    S = triton.cdiv(G, per)
    m_out, l_out, acc = q.new_empty(S, H, M), q.new_empty(S, H, M), q.new_empty(S, H, M, d)
    k_scale, k_min, v_scale, v_min = (t.contiguous() for t in (k_scale, k_min, v_scale, v_min))
    _flash_kernel[(H, S)](m_out, l_out, acc, q, k_codes.data, v_codes.data, levels_on(levels, q.device), k_scale,
                          k_min, v_scale, v_min, float(scale), G, H, g, M, R, ch, per, D=d, BITS=k_codes.bits,
                          BG=next_pow2(g), BM=BM, BC=block(d), BD=next_pow2(d))
    return m_out, l_out, acc
