"""The kernel tests run the Triton kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), tiny
shapes, no GPU; with KVSUM_KERNEL_TESTS=cuda on a CUDA machine, the same tests run the compiled kernels on the GPU.

triton decides when a kernel is defined whether it is interpreted, so the kernel modules are reloaded with
TRITON_INTERPRET=1 before the first test of this folder and reloaded as compiled kernels after its last one; the
variable itself is set only around each test here (the interpreter reads it while launching too). No other test
module sees either. Skipped where triton is absent.
"""

import contextlib
import importlib
import os
import sys

import pytest
import torch

import kvsum.kernels

ON_CUDA = os.environ.get("KVSUM_KERNEL_TESTS") == "cuda" and torch.cuda.is_available()
MODULES = ("kvsum.kernels.codes", "kvsum.kernels.flash", "kvsum.kernels.kivi", "kvsum.kernels.ragged",  # imports first
           "kvsum.kernels.prerope")


def _reload(interpret: bool) -> None:
    before = os.environ.pop("TRITON_INTERPRET", None)
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in MODULES:
            mod = sys.modules.get(name)
            importlib.reload(mod) if mod is not None else importlib.import_module(name)
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="package", autouse=True)
def _interpreted_kernels():
    if ON_CUDA or not kvsum.kernels.installed():
        yield
        return
    _reload(interpret=True)
    yield
    _reload(interpret=False)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("KVSUM_NATIVE", raising=False)


@pytest.fixture
def device() -> str:
    return "cuda" if ON_CUDA else "cpu"


@pytest.fixture
def kernel():
    """A context in which the states' calls run the Triton kernels (forced onto CPU tensors under the
    interpreter; on CUDA they serve by themselves)."""
    return contextlib.nullcontext if ON_CUDA else kvsum.kernels.forced


@pytest.fixture
def reference(monkeypatch):
    """A context in which the states' calls run the PyTorch path (no kernel of either kind)."""
    from kvsum.methods.quant import native

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as m:
            m.setenv("KVSUM_NATIVE", "0")  # Triton kernels off (read at each call)
            m.setattr(native, "library", lambda: None)  # the CPU kernel off
            yield
    return ctx
