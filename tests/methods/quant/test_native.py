"""The packed-code kernel (codes.c via native.py): same numbers as the lookup path, and a clean fallback."""

import pytest
import torch

from kvsum.methods.quant import native
from kvsum.methods.quant.packing import Packed
from kvsum.methods.quant.turboquant import TurboQuant
from tests.helpers import SERVED


@pytest.fixture
def lookup_path(monkeypatch):
    """A function that runs its argument with the kernel switched off."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(native, "usable", lambda *a: False)
            return fn()
    return run


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.skipif(not SERVED, reason="needs a CPU with AVX2 and a C compiler")
def test_kernel_compiles_and_serves_turboquant_decoding_steps():
    state = TurboQuant(bits=2.5).build(torch.randn(3, 64, 64), torch.randn(3, 64, 64), 2.5, layer_idx=0)
    assert native.library() is not None
    assert state.k._native(3) is not None  # a decoding step: 3 query rows per KV head
    assert state.k._native(native.MAX_ROWS + 1) is None  # a long prefill chunk: the matmul path


@pytest.mark.skipif(not SERVED, reason="needs a CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("bits", [1, 1.5, 2, 2.5, 3, 3.5, 4])
@pytest.mark.parametrize("H,T,d,M,threads", [(3, 1001, 64, 3, 2), (1, 37, 256, 4, 1), (2, 50, 32, 16, 1),
                                             (3, 5, 64, 1, 2), (2, 700, 64, 7, 2)])
def test_kernel_matches_the_lookup_path(lookup_path, bits, H, T, d, M, threads):
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        state = TurboQuant(bits=bits).build(torch.randn(H, T, d) * 3, torch.randn(H, T, d), bits, layer_idx=1)
        q, p = torch.randn(1, H, M, d), torch.rand(1, H, M, T).softmax(-1)
        s, o = state.scores(q, 0.125), state.mix(p)
        s0, o0 = lookup_path(lambda: (state.scores(q, 0.125), state.mix(p)))
    finally:
        torch.set_num_threads(before)
    assert s.shape == s0.shape and o.shape == o0.shape
    assert _rel(s, s0) < 1e-5 and _rel(o, o0) < 1e-5


@pytest.mark.skipif(not SERVED, reason="needs a CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_kernel_reads_wide_codes(bits):
    """Widths above 4 (a key shift can widen 4-bit keys to 5) go through the gather branch."""
    torch.manual_seed(bits)
    T, H, c, M = 203, 2, 16, 3
    levels = torch.randn(2 ** bits)
    codes = Packed(torch.randint(0, 2 ** bits, (T, H, c)), bits, tuple(levels.tolist()))
    q, p, norm = torch.randn(H, M, c), torch.rand(H, M, T), torch.rand(H, T) + 0.5
    table = codes.lookup().transpose(0, 1)  # (H, T, c)
    s = native.score([(codes, None, levels)], q, norm, 0.5)
    o = native.mix([(codes, None, levels)], p, norm, c)
    assert _rel(s, 0.5 * norm[:, None, :] * (q @ table.transpose(1, 2))) < 1e-5
    assert _rel(o, (p * norm[:, None, :]) @ table) < 1e-5


@pytest.mark.skipif(not SERVED, reason="needs a CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("bits", [3, 3.5, 5])
@pytest.mark.parametrize("lengths,threads", [([40, 0, 25, 9], 2), ([1, 300], 1), ([0, 17], 2)])
def test_kernel_reads_runs_of_one_head(bits, lengths, threads):
    """A one-head store of several heads' entries (composition's ragged heads): query head h against its own run
    only, plus `add`, -inf past the run's end, and the mix reads each run with its own head's weights."""
    torch.manual_seed(len(lengths))
    T, H, d, M = sum(lengths), len(lengths), 32, 3
    state = TurboQuant(bits=bits).build(torch.randn(1, T, d), torch.randn(1, T, d), bits, layer_idx=0)
    parts = state.k._native(M)
    runs = torch.tensor([0, *lengths]).cumsum(0)
    q, add = torch.randn(H, M, d), torch.randn(T)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s = native.score(parts, q, state.k_norm, 0.5, add, runs)
        p = torch.rand(H, M, max(lengths))
        o = native.mix(state.v._native(M), p, state.v_norm, d, runs)
    finally:
        torch.set_num_threads(before)
    assert s.shape == (H, M, max(lengths)) and o.shape == (H, M, d)
    keys, values = state.k.lookup()[0], state.v.lookup()[0]  # (T, d) rotated unit directions
    kn, vn = state.k_norm[0].float(), state.v_norm[0].float()
    for h, (a, n) in enumerate(zip(runs[:-1].tolist(), lengths)):
        ref = 0.5 * kn[a:a + n] * (q[h] @ keys[a:a + n].t()) + add[a:a + n]
        assert (s[h, :, n:] == float("-inf")).all()
        if n:
            assert _rel(s[h, :, :n], ref) < 1e-5
            assert _rel(o[h], (p[h, :, :n] * vn[a:a + n]) @ values[a:a + n]) < 1e-5
    with pytest.raises(ValueError, match="do not split"):
        native.score(parts, q, state.k_norm, 0.5, None, runs[:-1])


@pytest.mark.skipif(not SERVED, reason="needs a CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("M", [1, 3, 7])
def test_mix_reads_weights_sliced_from_a_joint_softmax(M):
    """A part's weights in a joint softmax are a slice of a wider tensor's last dim: read at their row pitch,
    not copied, with the numbers of a contiguous copy (7 rows: the path that decodes a code once for all rows)."""
    torch.manual_seed(M)
    H, T, d = 2, 203, 64
    state = TurboQuant(bits=3.5).build(torch.randn(H, T, d), torch.randn(H, T, d), 3.5, layer_idx=0)
    p = torch.rand(H, M, T + 37)[:, :, 11:11 + T]
    assert not p.is_contiguous()
    parts = state.v._native(M)
    assert torch.equal(native.mix(parts, p, state.v_norm, d), native.mix(parts, p.contiguous(), state.v_norm, d))


def test_without_a_compiler_it_warns_and_falls_back(monkeypatch, tmp_path, lookup_path):
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_cpu_has_avx2", lambda: True)
    native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="kernel is unavailable"):
            assert native.library() is None
        state = TurboQuant(bits=3).build(torch.randn(2, 40, 32), torch.randn(2, 40, 32), 3, layer_idx=0)
        q = torch.randn(1, 2, 3, 32)
        assert torch.equal(state.scores(q, 0.2), lookup_path(lambda: state.scores(q, 0.2)))
        monkeypatch.setenv("KVSUM_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None  # switched off: no compile attempted, no warning
    finally:
        native.library.cache_clear()


def test_an_unwritable_cache_warns_and_falls_back(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("KVSUM_CACHE", str(blocker))  # the kernel's folder would have to be inside a file
    monkeypatch.setattr(native, "_cpu_has_avx2", lambda: True)
    native.library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="kernel is unavailable"):
            assert native.library() is None
    finally:
        native.library.cache_clear()


@pytest.mark.skipif(not SERVED, reason="needs a CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("H,T,d,M,n_q", [(3, 1000, 64, 3, 864), (1, 300, 256, 4, 160), (2, 200, 64, 16, 192),
                                         (3, 100, 64, 1, 96)])
@pytest.mark.parametrize("sinks", [0, 4])
def test_kernel_matches_the_lookup_path_for_kivi(bits, H, T, d, M, n_q, sinks):
    """KIVI's per-group key scales and minima, and its per-token value scales and minima, folded around the
    kernel: the same scores and outputs as dequantizing every code (exact sinks and full-precision residual
    included)."""
    from kvsum.methods.quant.kivi import KIVI

    torch.manual_seed(bits)
    state = KIVI(bits=bits, sinks=sinks).build(torch.randn(H, T, d) * 2, torch.randn(H, T, d), bits,
                                               storage=torch.float16, n_q=n_q)
    assert state._native(M) and state.pending() == T - sinks - n_q
    q, p = torch.randn(1, H, M, d), torch.rand(1, H, M, T).softmax(-1)
    s, o = state.scores(q, 0.125), state.mix(p)
    ref_s, ref_o = q @ state.keys().transpose(-1, -2) * 0.125, p @ state.values()
    assert _rel(s, ref_s) < 1e-5 and (o - ref_o).abs().max() < 1e-4 * ref_o.abs().max() + 1e-6
