"""The packed-code attention kernel (codes.c): scores and mixes straight from packed codes.

Eager PyTorch has no operation that reads 3-bit codes, so its path expands every code to a float32 level
in memory at each decoding step (a float32 for every code of a few bits) and then multiplies. The kernel
decodes eight codes at a time in registers and multiplies them there, which is what makes a coded cache
faster to attend than the full one it replaces. It is compiled on first use with the machine's C compiler
(AVX2 and FMA required) and cached beside the converted models; without a compiler, on a CPU without
AVX2, on other devices or with KVSUM_NATIVE=0, the PyTorch path runs instead (same numbers up to float
summation order). TurboQuant's rotated path (summary's code cover included) and KIVI read their codes
through it (`score` / `mix` and `score_groups` / `mix_runs`), and pca keys coded before RoPE on the CPU
(`score_prerope`: each key rebuilt from its axes and turned to its position in registers; where the CPU has AMX
and the OS grants it, 16 tokens at a time as two tile products, their keys and then their scores, to about 16 bits
of each product; KVSUM_AMX=0 keeps it on AVX). On CUDA tensors the Triton kernels of kvsum/kernels/ run instead
(pre-RoPE keys: kernels/prerope.py, called from pca.py; where triton is installed; KVSUM_NATIVE=0 turns them off
too).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ... import kernels
from ...models import cache_dir

SOURCE = Path(__file__).with_name("codes.c")
MAX_ROWS = 16  # query rows per KV head beyond which a matmul over looked-up levels is faster
MAX_HEADS = 64  # KV heads a layer score_prerope serves in one call (codes.c MAX_HEADS)
MAX_PARTS = 8  # codes.c's limit on channel parts per side


def _cpu_flags() -> str:
    """The first `flags` line of /proc/cpuinfo ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _cpu_has_avx2() -> bool:
    flags = _cpu_flags().split()
    return "avx2" in flags and "fma" in flags


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run (see the module); compiled once per source and machine."""
    if os.environ.get("KVSUM_NATIVE", "1") == "0" or not _cpu_has_avx2():
        return None
    src = SOURCE.read_bytes()
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    flags = ["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
    # -march=native: a build is only valid on the CPU it was made for (a cache directory may be shared)
    tag = hashlib.sha256(src + " ".join([cc, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"codes-{tag}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, moved in whole
                out = Path(tmp) / target.name
                subprocess.run([cc, *flags, str(SOURCE), "-o", str(out)], check=True, capture_output=True, timeout=120)
                os.replace(out, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:  # no compiler, a failed build, an unwritable cache
        detail = (getattr(e, "stderr", b"") or b"").decode()[:300]
        warnings.warn(f"kvsum: the packed-code kernel is unavailable ({e}{'; ' + detail if detail else ''}); "
                      "quantized caches use the slower PyTorch path", stacklevel=2)
        return None
    ptrs, i64 = ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64
    head = [ctypes.c_int, ptrs, ptrs, ptrs, ctypes.POINTER(i64), ctypes.POINTER(ctypes.c_int), i64, i64, i64,
            ctypes.c_void_p, i64, ctypes.c_void_p]
    vp = ctypes.c_void_p
    lib.kv_score_coded.argtypes = [*head, ctypes.c_float, vp, vp, vp, ctypes.c_int]
    lib.kv_mix_coded.argtypes = [*head[:10], i64, *head[10:], vp, vp, ctypes.c_int]  # the weights' row pitch after p
    lib.kv_score_groups.argtypes = [vp, i64, i64, i64, i64, ctypes.c_int, vp, vp, i64, vp, ctypes.c_int]
    lib.kv_mix_runs.argtypes = [vp, i64, i64, i64, i64, ctypes.c_int, vp, vp, i64, i64, vp, vp, vp, ctypes.c_int]
    lib.kv_score_prerope.argtypes = [ctypes.c_int, vp, ptrs, vp, vp, ptrs, ptrs, ptrs, ptrs, ptrs, vp, vp, vp, i64,
                                     i64, vp, i64, vp, ctypes.c_int]
    lib.kv_amx_allow.argtypes = [ctypes.c_int]
    for fn in (lib.kv_score_coded, lib.kv_mix_coded, lib.kv_score_groups, lib.kv_mix_runs, lib.kv_score_prerope,
               lib.kv_amx_allow):
        fn.restype = ctypes.c_int
    lib.kv_amx_allow(_amx_env())
    return lib


def _amx_env() -> bool:
    return os.environ.get("KVSUM_AMX", "1") != "0"


def serves(rows: int, *codes) -> bool:
    """Whether a kernel runs here for `rows` query rows per KV head over these Packed codes: the Triton kernels on
    CUDA tensors (kvsum.kernels), this one on the CPU."""
    if not 0 < rows <= MAX_ROWS:
        return False
    return kernels.serves(*(c.data for c in codes)) or (all(c.data.device.type == "cpu" for c in codes)
                                                         and library() is not None)


def usable(parts: list, rows: int) -> bool:
    """Whether the kernel serves a coded side: `parts` as (Packed codes (T, H, c), channel index (H, c) uint8 or
    None, levels (2**bits,) float32), for `rows` query rows per KV head."""
    return (len(parts) <= MAX_PARTS and serves(rows, *(p for p, _, _ in parts))
            and all(len(p.shape) == 3 and p.shape[2] % 8 == 0 and lv.dtype == torch.float32
                    and lv.numel() == 2 ** p.bits and (ix is None or ix.dtype == torch.uint8) for p, ix, lv in parts))


def _side(parts: list, d: int, runs: Tensor | None, H: int) -> tuple:
    """The ctypes arguments that describe the parts (with runs: their T is the longest run, their H the query heads),
    and the tensors they point into (kept alive by the caller)."""
    n = len(parts)
    levels = [lv.contiguous() for _, _, lv in parts]
    idx = [None if ix is None else ix.contiguous() for _, ix, _ in parts]
    arrays = ((ctypes.c_void_p * n)(*[p.data.data_ptr() for p, _, _ in parts]),
              (ctypes.c_void_p * n)(*[0 if ix is None else ix.data_ptr() for ix in idx]),
              (ctypes.c_void_p * n)(*[lv.data_ptr() for lv in levels]),
              (ctypes.c_int64 * n)(*[p.shape[2] for p, _, _ in parts]),
              (ctypes.c_int * n)(*[p.bits for p, _, _ in parts]))
    T = parts[0][0].shape[0] if runs is None else kernels.longest_run(runs)
    return (n, *arrays, T, H, d), (levels, idx)


def _runs(runs: Tensor | None, H: int, parts: list) -> Tensor | None:
    if runs is None:
        return None
    if parts[0][0].shape[1] != 1 or runs.shape != (H + 1,) or int(runs[-1]) != parts[0][0].shape[0]:
        raise ValueError(f"runs {tuple(runs.shape)} ending at {int(runs[-1])} do not split {parts[0][0].shape[0]} "
                         f"tokens of one head among {H} query heads")
    return runs.to(torch.int64).contiguous()


def _rows(p: Tensor) -> tuple[Tensor, int]:
    """Weights p (H, M, n) as the kernel reads them: fp32 rows h * M + m of n unit-stride entries, `pitch` apart.
    A slice of a wider tensor's last dim (a part of a joint softmax) is read where it lies, not copied."""
    p = p.float()
    H, M, _ = p.shape
    pitch = p.stride(0) if M == 1 else p.stride(1)
    if p.stride(-1) != 1 or p.stride(0) != M * pitch:
        p = p.contiguous()
        pitch = p.shape[-1]
    return p, pitch


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int) -> None:
    if status:
        raise MemoryError("kvsum: the packed-code kernel refused its input shapes or could not allocate scratch memory")


def _threads(T: int) -> int:
    return max(1, min(torch.get_num_threads(), T // 256 or 1))


def score(parts: list, q: Tensor, norm: Tensor, scale: float, add: Tensor | None = None,
          runs: Tensor | None = None) -> Tensor:
    """Queries q (H, M, d) against the coded side -> (H, M, T): scale * norm[h, t] * <q[h, m], levels(t, h)>
    (+ add[h, t]). With `runs` (H + 1 token offsets into a side of one head) query
    head h reads only tokens runs[h] to runs[h + 1]: (H, M, longest run), -inf past the end of each run."""
    runs = _runs(runs, q.shape[0], parts)
    if kernels.serves(parts[0][0].data):
        from ...kernels import codes as gpu
        return gpu.score(parts, q, norm, scale, add, runs)
    args, keep = _side(parts, q.shape[-1], runs, q.shape[0])
    q, norm = q.float().contiguous(), norm.float().contiguous()
    add = add.float().contiguous() if add is not None else None
    out = q.new_zeros(q.shape[0], q.shape[1], args[6])
    _check(library().kv_score_coded(*args, q.data_ptr(), q.shape[1], norm.data_ptr(), scale, _ptr(add),
                                    _ptr(runs), out.data_ptr(), _threads(parts[0][0].shape[0])))
    return out


def mix(parts: list, p: Tensor, norm: Tensor, d: int, runs: Tensor | None = None) -> Tensor:
    """Weights p (H, M, T) over the coded side -> (H, M, d): sum_t p[h, m, t] norm[h, t] levels(t, h); with `runs`
    as in `score`, p (H, M, longest run)."""
    runs = _runs(runs, p.shape[0], parts)
    if kernels.serves(parts[0][0].data):
        from ...kernels import codes as gpu
        return gpu.mix(parts, p, norm, d, runs)
    args, keep = _side(parts, d, runs, p.shape[0])
    (p, pitch), norm = _rows(p), norm.float().contiguous()
    out = p.new_zeros(p.shape[0], p.shape[1], d)
    _check(library().kv_mix_coded(*args, p.data_ptr(), pitch, p.shape[1], norm.data_ptr(), _ptr(runs),
                                  out.data_ptr(), _threads(parts[0][0].shape[0])))
    return out


def score_groups(codes, levels: Tensor, qg: Tensor) -> Tensor:
    """KIVI's keys: packed codes (G, H, g, d) against one query per group and head, qg (G, H, M, d) -> (H, M, G * g):
    sum_j qg[gi, h, m, j] levels[code(gi, h, u, j)] at token gi * g + u."""
    if kernels.serves(codes.data):
        from ...kernels import kivi as gpu
        return gpu.score_groups(codes, levels, qg)
    G, H, g, d = codes.shape
    qg, levels = qg.float().contiguous(), levels.float().contiguous()
    out = qg.new_zeros(H, qg.shape[2], G * g)
    _check(library().kv_score_groups(codes.data.data_ptr(), G, H, g, d, codes.bits, levels.data_ptr(), qg.data_ptr(),
                                     qg.shape[2], out.data_ptr(), _threads(G * g)))
    return out


def mix_runs(codes, levels: Tensor, p: Tensor, norms: Tensor, mins: Tensor) -> Tensor:
    """KIVI's values: weights p (H, M, T) over packed codes (T, H, d / ch, ch) with a scale and a minimum per token,
    head and run of ch channels, norms and mins (d / ch, H, T) -> (H, M, d):
    sum_t p[h, m, t] (norms[j / ch, h, t] levels[code(t, h, j)] + mins[j / ch, h, t])."""
    if kernels.serves(codes.data):
        from ...kernels import kivi as gpu
        return gpu.mix_runs(codes, levels, p, norms, mins)
    T, H, runs, ch = codes.shape
    (p, pitch), levels = _rows(p), levels.float().contiguous()
    norms, mins = norms.float().contiguous(), mins.float().contiguous()
    out = p.new_zeros(H, p.shape[1], runs * ch)
    _check(library().kv_mix_runs(codes.data.data_ptr(), T, H, runs * ch, ch, codes.bits, levels.data_ptr(),
                                 p.data_ptr(), pitch, p.shape[1], norms.data_ptr(), mins.data_ptr(), out.data_ptr(),
                                 _threads(T)))
    return out


def amx(allow: bool | None = None) -> bool:
    """Whether score_prerope rebuilds keys on AMX tiles (where the CPU has AMX-BF16 and the OS grants it), after
    allowing it or not (None: as KVSUM_AMX says; the tests run both paths)."""
    return bool(library().kv_amx_allow(int(_amx_env() if allow is None else allow)))


def score_prerope(heads: list, cos: Tensor, sin: Tensor, q: Tensor) -> Tensor:
    """One layer's pca keys coded before RoPE (pca.KeyTransform), each rebuilt and turned in registers: `heads` as
    pca.KeyTransform's heads (fp16 axes (d, r), deviations (r,), widths (r,) uint8, mean (d,); its width groups in
    increasing width as (columns, bits, levels (2**bits,), Packed codes (T, c))), cos / sin (T, d) at the keys'
    positions, queries q (H, M, d) -> (H, M, T)."""
    groups = [(codes, levels) for hd in heads for _, _, levels, codes in hd["groups"]]
    gs = torch.tensor([0, *itertools.accumulate(len(hd["groups"]) for hd in heads)], dtype=torch.int32)
    levels = [lv.float().contiguous() for _, lv in groups]
    held = [[hd[k].to(dt).contiguous() for hd in heads]
            for k, dt in (("axes", torch.float16), ("std", torch.float16), ("widths", torch.uint8),
                          ("mean", torch.float16))]
    arr = ctypes.c_void_p * len(heads)
    c = torch.tensor([p.shape[1] for p, _ in groups], dtype=torch.int64)
    bits = torch.tensor([p.bits for p, _ in groups], dtype=torch.int32)
    r = torch.tensor([hd["axes"].shape[1] for hd in heads], dtype=torch.int64)
    cos, sin, q = (t.float().contiguous() for t in (cos, sin, q))
    T, d = cos.shape
    out = q.new_empty(q.shape[0], q.shape[1], T)
    _check(library().kv_score_prerope(
        len(heads), gs.data_ptr(), (ctypes.c_void_p * len(groups))(*[p.data.data_ptr() for p, _ in groups]),
        c.data_ptr(), bits.data_ptr(), (ctypes.c_void_p * len(groups))(*[lv.data_ptr() for lv in levels]),
        *[arr(*[t.data_ptr() for t in ts]) for ts in held], r.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, d,
        q.data_ptr(), q.shape[1], out.data_ptr(), _threads(T)))
    return out
