"""kvsum/kernels/__init__.py: when the kernels serve, the switch that turns them off, and their small helpers."""

import pytest
import torch

import kvsum.kernels as kernels


def test_cpu_tensors_are_served_only_when_forced(monkeypatch):
    monkeypatch.setattr(kernels, "installed", lambda: True)
    monkeypatch.delenv("KVSUM_NATIVE", raising=False)
    x = torch.zeros(3)
    assert not kernels.serves(x)
    with kernels.forced():
        assert kernels.serves(x)
        monkeypatch.setenv("KVSUM_NATIVE", "0")  # off, as for the CPU kernel
        assert not kernels.serves(x)
    assert not kernels._forced


def test_without_triton_nothing_is_served(monkeypatch):
    monkeypatch.setattr(kernels, "installed", lambda: False)
    with kernels.forced():
        assert not kernels.serves(torch.zeros(1))


def test_helpers():
    assert kernels.offsets([3, 0, 5], "cpu").tolist() == [0, 3, 3, 8]
    assert [kernels.next_pow2(n) for n in (1, 16, 17, 200)] == [16, 16, 32, 256]
    assert kernels.chunk(100, 4, 32) == (128, 1) and kernels.chunk(32768, 8, 32)[0] % 32 == 0
    assert kernels.mix_grid(100, 2, 96, 32) == (64, 2, 128, 1)  # 96 channels: two blocks of up to 64
    lv = torch.arange(4.0)
    assert kernels.levels_on(lv, "cpu").dtype == torch.float32
    assert kernels.kernel_input(torch.ones(2, 3, dtype=torch.bfloat16).t()).dtype == torch.float32


@pytest.mark.skipif(not kernels.installed(), reason="triton is not installed")
def test_kernel_modules_import_without_a_gpu():
    from kvsum.kernels import codes, kivi, prerope, ragged  # noqa: F401
