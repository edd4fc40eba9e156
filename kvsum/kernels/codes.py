"""Triton kernels that score and mix straight from packed codes (TurboQuant's and KIVI's), on the GPU.

Layout (kvsum/methods/quant/packing.py): codes held flat in row-major order, every 8 codes one little-endian
word of 8 * bits bits in `bits` bytes, so code f starts at bit f * bits; a code spans at most two bytes. Each
program loads the bytes of a (tokens, channels) tile, shifts and masks the codes out and looks their levels up
in registers (the levels table is a few floats, cached): no code is ever expanded into global memory.

The functions mirror native.py's (same arguments, same results up to float summation order):
`score` / `mix` for TurboQuant's channel parts (with `runs`: one store holding several heads' entries one run
after another), `score_groups` / `mix_runs` for KIVI's per-group keys and per-token values. Products are fp32
(tl.dot with IEEE precision, never TF32). A mix splits the tokens among programs, each writing its partial
sums, added afterwards in PyTorch (deterministic, no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from . import block, kernel_input, levels_on, longest_run, mix_grid, offsets

BT = 32  # tokens per block
BM = 16  # query rows per block: a decoding step's rows per KV head (at most native.MAX_ROWS = 16)


@triton.jit
def _levels(data, f, lv, BITS: tl.constexpr, mask):
    """The levels of codes at flat indices f (int64) of a packed store, 0.0 where masked."""
    bit = f * BITS
    byte = bit >> 3
    shift = (bit & 7).to(tl.int32)
    word = tl.load(data + byte, mask=mask, other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may run into the next byte
        nxt = tl.load(data + byte + 1, mask=mask & (shift + BITS > 8), other=0).to(tl.int32)
        word = word | (nxt << 8)
    code = (word >> shift) & ((1 << BITS) - 1)
    return tl.load(lv + code, mask=mask, other=0.0)


@triton.jit
def _channels(ix, hc, j, jm, C, HAS_IX: tl.constexpr):
    """The head-dim channels of a part's channels j: ix[hc, j] (an outlier split's), or j itself (one part)."""
    if HAS_IX:
        return tl.load(ix + hc * C + j, mask=jm, other=0).to(tl.int32)
    return j


@triton.jit
def _span(runs, h, T, RUNS: tl.constexpr):
    """(first token, token count, code head) of program h's entries: with runs, run h of one store (head 0), else
    head h's T tokens."""
    if RUNS:  # one return: Triton requires every return of a function to have the same types
        base = tl.load(runs + h)
        n = tl.load(runs + h + 1) - base
        hc = 0
    else:
        base = 0
        n = T
        hc = h
    return base, n, hc


@triton.jit
def _mix_tile(C: tl.constexpr, M, CHUNK, BM: tl.constexpr, BC: tl.constexpr):
    """A mix program's tile: program (h, s, b) sums chunk s of head h's tokens (first token t0) into the (BM, BC)
    accumulator acc, for query rows m and channels j of block b (mm, jm: which are real)."""
    j = tl.program_id(2) * BC + tl.arange(0, BC)
    m = tl.arange(0, BM)
    return tl.program_id(0), tl.program_id(1) * CHUNK, j, j < C, m, m < M, tl.full((BM, BC), 0.0, tl.float32)


@triton.jit
def _store_part(part, acc, M, m, mm, j, jm, C: tl.constexpr):
    """part[s, h, m, j] = acc for the program (h, s, b) of `_mix_tile`: one chunk's partial sums, added afterwards in
    PyTorch (no atomics)."""
    h, s = tl.program_id(0), tl.program_id(1)
    tl.store(part + ((s * tl.num_programs(0) + h) * M + m[:, None]) * C + j[None, :], acc,
             mask=mm[:, None] & jm[None, :])


@triton.jit
def _dot_ix(acc, q, ix, data, lv, h, hc, tok, tm, M, H_codes, D: tl.constexpr, C: tl.constexpr,
            BITS: tl.constexpr, HAS_IX: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """acc (BT, BM) += codes of tokens `tok`, head hc, C channels (levels) . queries q[h] (H, M, D) at those channels
    (`_channels`: a split part's gathered here, no gathered copy of the queries in memory; D = C for queries given
    per part)."""
    m = tl.arange(0, BM)
    for c0 in tl.static_range(0, C, BC):
        j = c0 + tl.arange(0, BC)
        jm = j < C
        f = (tok[:, None].to(tl.int64) * H_codes + hc) * C + j[None, :]
        x = _levels(data, f, lv, BITS, tm[:, None] & jm[None, :])
        ch = _channels(ix, hc, j, jm, C, HAS_IX)
        qv = tl.load(q + (h * M + m[:, None]) * D + ch[None, :], mask=(m[:, None] < M) & jm[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(qv), input_precision="ieee")
    return acc


@triton.jit
def _score_kernel(out, q, kx_a, data_a, lv_a, kx_b, data_b, lv_b, norm, add, runs, scale, T, H_codes, M, T_out,
                  D: tl.constexpr, HAS_IX: tl.constexpr, C_A: tl.constexpr, BITS_A: tl.constexpr, C_B: tl.constexpr,
                  BITS_B: tl.constexpr, HAS_ADD: tl.constexpr, RUNS: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
                  BC: tl.constexpr):
    """out[h, m, t] = scale * norm[hc, tok] * <q[h, m], levels(tok, hc)> (+ add[hc, tok]); tok = t, hc = h, or with
    runs tok = runs[h] + t, hc = 0 and -inf past the run's end. Parts a and b (C_B = 0: none) summed; HAS_IX: their
    channels kx_* of the queries (H, M, D) are read here (`_side`)."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    base, n, hc = _span(runs, h, T, RUNS)
    tm = t < n
    tok = base + t
    acc = tl.full((BT, BM), 0.0, tl.float32)
    acc = _dot_ix(acc, q, kx_a, data_a, lv_a, h, hc, tok, tm, M, H_codes, D, C_A, BITS_A, HAS_IX, BT, BM, BC)
    if C_B > 0:
        acc = _dot_ix(acc, q, kx_b, data_b, lv_b, h, hc, tok, tm, M, H_codes, D, C_B, BITS_B, HAS_IX, BT, BM, BC)
    nrm = tl.load(norm + hc * T + tok, mask=tm, other=0.0).to(tl.float32)
    s = acc * scale * nrm[:, None]
    if HAS_ADD:
        s += tl.load(add + hc * T + tok, mask=tm, other=0.0).to(tl.float32)[:, None]
    s = tl.where(tm[:, None], s, float("-inf"))
    m = tl.arange(0, BM)
    tl.store(out + (h * M + m[None, :]) * T_out + t[:, None], s, mask=(t < T_out)[:, None] & (m < M)[None, :])


@triton.jit
def _mix_kernel(part, p, data, lv, norm, runs, T, H_codes, M, T_p, CHUNK, C: tl.constexpr, BITS: tl.constexpr,
                RUNS: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """part[s, h, m, j] = sum over tokens t of chunk s: p[h, m, t] norm[hc, tok] level(tok, hc, j) (tok, hc as in
    _score_kernel), for channels j of block program_id(2)."""
    h, t0, j, jm, m, mm, acc = _mix_tile(C, M, CHUNK, BM, BC)
    base, n, hc = _span(runs, h, T, RUNS)
    for tt in range(t0, t0 + CHUNK, BT):
        t = tt + tl.arange(0, BT)
        tm = t < n
        tok = base + t
        f = (tok[:, None].to(tl.int64) * H_codes + hc) * C + j[None, :]
        x = _levels(data, f, lv, BITS, tm[:, None] & jm[None, :])
        nrm = tl.load(norm + hc * T + tok, mask=tm, other=0.0).to(tl.float32)
        w = tl.load(p + (h * M + m[:, None]) * T_p + t[None, :], mask=mm[:, None] & tm[None, :], other=0.0)
        acc += tl.dot(w * nrm[None, :], x, input_precision="ieee")
    _store_part(part, acc, M, m, mm, j, jm, C)


def _on(runs: Tensor, device) -> Tensor:
    """Run offsets (a CPU tensor, a composed state's metadata) on the kernel's device, copied once per layout."""
    return runs if runs.device == device else offsets((runs[1:] - runs[:-1]).tolist(), device)


def _side(parts: list) -> list:
    """Kernel arguments for up to two channel parts: (channels, data, levels) each; a missing second part repeats
    the first (its channel count is then 0), and a part of all channels in order passes its data for channels (the
    kernels gather a split's channels themselves: no gathered copy of the queries)."""
    if len({ix is None for _, ix, _ in parts}) > 1:
        raise ValueError("the kernels read one part of all channels, or parts that each name their channels")
    args = []
    for codes, ix, levels in (parts + parts[:1])[:2]:
        args += [codes.data if ix is None else ix, codes.data, levels_on(levels, codes.data.device)]
    return args


def score(parts: list, q: Tensor, norm: Tensor, scale: float, add: Tensor | None = None,
          runs: Tensor | None = None) -> Tensor:
    """native.score on the GPU: queries q (H, M, d) against the coded side -> (H, M, T) (with runs: (H, M, longest
    run), -inf past each run's end). Parts are read two at a time (an outlier split's two in one pass)."""
    H, M, d = q.shape
    q = q.float().contiguous()
    T, H_codes = parts[0][0].shape[0], parts[0][0].shape[1]
    if runs is not None:
        T_out = longest_run(runs)
        runs = _on(runs, q.device)
    else:
        T_out = T
    norm = kernel_input(norm)
    add = kernel_input(add) if add is not None else None
    out = None
    for i in range(0, len(parts), 2):
        pair = parts[i:i + 2]
        C_A, C_B = pair[0][0].shape[2], pair[1][0].shape[2] if len(pair) == 2 else 0
        o = q.new_empty(H, M, T_out)
        if T_out:
            _score_kernel[(H, triton.cdiv(T_out, BT))](
                o, q, *_side(pair), norm, add if i == 0 and add is not None else norm,
                runs if runs is not None else norm, float(scale), T, H_codes, M, T_out, D=d,
                HAS_IX=pair[0][1] is not None, C_A=C_A, BITS_A=pair[0][0].bits, C_B=C_B,
                BITS_B=pair[1][0].bits if C_B else 1, HAS_ADD=i == 0 and add is not None, RUNS=runs is not None,
                BT=BT, BM=BM, BC=block(max(C_A, C_B)))
        out = o if out is None else out + o
    return out


def mix(parts: list, p: Tensor, norm: Tensor, d: int, runs: Tensor | None = None) -> Tensor:
    """native.mix on the GPU: weights p (H, M, T) (with runs: (H, M, longest run)) over the coded side ->
    (H, M, d); each part's channels mixed by one launch, then placed by its channel index."""
    H, M, T_p = p.shape
    p = p.float().contiguous()
    T, H_codes = parts[0][0].shape[0], parts[0][0].shape[1]
    if runs is not None:
        runs = _on(runs, p.device)
    norm = kernel_input(norm)
    out = p.new_zeros(H, M, d)
    longest = T_p if runs is not None else T
    for codes, ix, levels in parts:
        c = codes.shape[2]
        bc, nb, per, S = mix_grid(longest, H, c, BT)
        part = p.new_empty(S, H, M, c)
        if longest:
            _mix_kernel[(H, S, nb)](part, p, codes.data, levels_on(levels, p.device), norm,
                                    runs if runs is not None else norm, T, H_codes, M, T_p, per, C=c, BITS=codes.bits,
                                    RUNS=runs is not None, BT=BT, BM=BM, BC=bc)
            o = part.sum(0)
        else:
            o = p.new_zeros(H, M, c)
        if ix is None:
            out += o
        else:
            out.scatter_(2, ix.long()[:, None, :].expand(H, M, -1), o)
    return out
