"""Every kernel compiles for the GPU (sm_90, Hopper: PTX and cubin through the ptxas the triton wheel ships), on a
machine without one: the interpreter runs kernels as Python and misses what only the compiler checks (globals
that are not constexpr, types, layouts). Run in a fresh process: the kernel modules here are interpreted ones."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

P32, P16, PBF, U8, I64 = "*fp32", "*fp16", "*bf16", "*u8", "*i64"
# kernel: (argument types, constexprs), a variant that takes every optional branch; VARIANTS: the plain ones too
KERNELS = {
    "codes._score_kernel": (dict(out=P32, q=P32, kx_a=U8, data_a=U8, lv_a=P32, kx_b=U8, data_b=U8, lv_b=P32,
                                 norm=P16, add=P16, runs=I64, scale="fp32", T="i32", H_codes="i32", M="i32",
                                 T_out="i32"),
                            dict(D=64, HAS_IX=True, C_A=32, BITS_A=4, C_B=32, BITS_B=3, HAS_ADD=True, RUNS=True, BT=32,
                                 BM=16, BC=32)),
    "codes._mix_kernel": (dict(part=P32, p=P32, data=U8, lv=P32, norm=P16, runs=I64, T="i32", H_codes="i32",
                               M="i32", T_p="i32", CHUNK="i32"), dict(C=128, BITS=3, RUNS=True, BT=32, BM=16, BC=64)),
    "kivi._group_kernel": (dict(out=P32, qg=P32, data=U8, lv=P32, H="i32", g="i32", M="i32", T_out="i32"),
                           dict(D=256, BITS=4, BG=32, BM=16, BC=64)),
    "kivi._runs_kernel": (dict(part=P32, p=P32, sp_h="i32", sp_m="i32", data=U8, lv=P32, norms=P16, sn_r="i32",
                               sn_h="i32", sn_t="i32", mins=P16, sm_r="i32", sm_h="i32", sm_t="i32", T="i32", H="i32",
                               M="i32", ch="i32", CHUNK="i32"), dict(D=64, BITS=2, BT=32, BM=16, BC=64)),
    "kivi._flash_kernel": (dict(m_out=P32, l_out=P32, acc_out=P32, q=P32, kdata=U8, vdata=U8, lv=P32, k_scale=P16,
                                k_min=P16, v_scale=P16, v_min=P16, scale="fp32", G="i32", H="i32", g="i32", M="i32",
                                R="i32", ch="i32", CHUNK="i32"), dict(D=256, BITS=2, BG=32, BM=16, BC=64, BD=256)),
    "ragged._score_kernel": (dict(out=P32, q=P32, keys=PBF, bias=PBF, starts=I64, scale="fp32", M="i32", n_out="i32"),
                             dict(D=256, HAS_BIAS=True, BT=32, BM=16, BC=64)),
    "ragged._mix_kernel": (dict(part=P32, p=P32, values=P16, starts=I64, M="i32", n_p="i32", CHUNK="i32"),
                           dict(D=64, BT=32, BM=16, BC=64)),
    "flash._flash_kernel": (dict(m_out=P32, l_out=P32, out=P32, q=P32, kx_a=U8, kd_a=U8, kl_a=P32, kx_b=U8, kd_b=U8,
                                 kl_b=P32, vx_a=U8, vd_a=U8, vl_a=P32, vx_b=U8, vd_b=U8, vl_b=P32, k_norm=P16,
                                 v_norm=P16, add=P32, shrink=P16, skip=U8, bias=P16, runs=I64, scale="fp32", T="i32",
                                 M="i32", CHUNK="i32"),
                            dict(D=64, HAS_IX=True, CK_A=32, KB_A=4, CK_B=32, KB_B=3, CV_A=32, VB_A=4, CV_B=32, VB_B=3,
                                 HAS_ADD=True, HAS_ON=True, HAS_SKIP=True, HAS_BIAS=True, RUNS=True, BT=32, BM=16,
                                 BC=32, BCV_A=32, BCV_B=32)),
}

VARIANTS = [(name, dict(KERNELS[name][1], **change)) for name, change in [
    ("codes._score_kernel", dict(HAS_IX=False, C_A=64, BITS_A=3, C_B=0, HAS_ADD=False, RUNS=False, BC=64)),  # d 64
    # one part a side, d 256, widest and narrowest codes
    ("flash._flash_kernel", dict(D=256, HAS_IX=False, CK_A=256, KB_A=8, CK_B=0, CV_A=256, VB_A=1, CV_B=0,
                                 HAS_ADD=False, HAS_ON=False, HAS_SKIP=False, HAS_BIAS=False, RUNS=False, BC=64,
                                 BCV_A=256, BCV_B=16)),
]]


def compile_all() -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, consts in [(n, c) for n, (_, c) in KERNELS.items()] + VARIANTS:
        types = KERNELS[name][0]
        module, _, kernel = name.partition(".")
        fn = getattr(importlib.import_module(f"kvsum.kernels.{module}"), kernel)
        sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        print("compiled", name, flush=True)


def test_every_kernel_compiles_for_sm90():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "tests.kernels.test_compile"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled ") == len(KERNELS) + len(VARIANTS)


if __name__ == "__main__":
    compile_all()
