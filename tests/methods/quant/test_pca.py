"""kvsum/methods/quant/pca.py: query-weighted key transform codes (key_basis='pca'), pre-RoPE coding, outlier tokens."""

import sys

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from tests.helpers import random_layer


def test_pca_allocation_and_gaussian_levels():
    from kvsum.methods.quant.pca import MAX_BITS, allocate, gaussian_levels, gaussian_lloyd_max
    assert gaussian_levels(2) == pytest.approx((-1.510, -0.4528, 0.4528, 1.510), abs=2e-3)  # Max (1960)
    mse = [gaussian_lloyd_max(b)[1] for b in (1, 2, 3, 4)]
    assert mse == pytest.approx([0.3634, 0.1175, 0.03454, 0.009497], rel=1e-3)  # Max's table
    b = allocate(torch.tensor([100.0, 10.0, 1.0, 0.0]), 8)
    assert b.sum() == 8 and b[0] >= b[1] >= b[2] and b[3] == 0
    # each bit cuts a variance by ~4x: an axis 16x wider earns about two more bits
    assert allocate(torch.tensor([16.0, 1.0]), 6).tolist() == [4, 2]
    assert allocate(torch.ones(3), 100).tolist() == [MAX_BITS] * 3  # capped


def test_turboquant_pca_keys_cut_the_queries_logit_error_at_no_more_bytes():
    H, T, d = 2, 400, 16
    g = torch.Generator().manual_seed(4)
    x = random_layer(H, T, d)
    x.keys = torch.randn(H, T, d, generator=g) * torch.logspace(0.7, -0.7, d) + 3  # anisotropic, offset
    x.queries = torch.randn(2 * H, 30, d, generator=g) * torch.linspace(0, 2, d)  # 2 query heads per KV head
    q = x.queries.reshape(H, -1, d)[None]
    states = {kb: make_method("turboquant", bits=2.5, sinks=0, key_shift=0, key_basis=kb).compress(x)
              for kb in ("random", "pca")}
    exact = q @ x.keys.transpose(-1, -2)
    err = {kb: (st.scores(q, 1.0) - exact).pow(2).mean() for kb, st in states.items()}
    assert err["pca"] < 0.3 * err["random"]
    assert states["pca"].nbytes() <= states["random"].nbytes()
    refs = sys.getrefcount(x.queries)
    kept = make_method("turboquant", bits=2.5, sinks=0, key_basis="pca").compress(x)
    held = sys.getrefcount(x.queries) - refs  # outside the assert: pytest's rewrite would hold one more
    assert held == 0 and kept.T == T  # the state holds no reference query (their bytes are not counted)
    assert torch.equal(states["pca"].values(), states["random"].values())  # values: the same rotated codes
    # both attention paths, and decoded keys coded on the same axes
    st = states["pca"]
    rotated = st.scores(q, 0.5)
    st.path = "dequant"
    assert torch.allclose(st.scores(q, 0.5), rotated, atol=1e-3)
    st.extend(x.keys[:, :40], x.values[:, :40])
    assert st.T == T + 40 and torch.equal(st.keys()[:, T:], st.keys()[:, :40])
    with pytest.raises(kvsum.KVSumError, match="key_basis='eigen'; accepted: random, pca"):
        make_method("turboquant", key_basis="eigen")
    with pytest.raises(kvsum.KVSumError, match="without QJL"):
        make_method("turboquant", key_basis="pca", qjl=True)


def test_pre_rope_pca_codes_keys_before_rope_at_their_positions():
    """Keys that share two directions before RoPE, smeared over every pair's plane by it: coded before RoPE,
    the same bytes hold them far better, and keys decoded later are un-rotated at their own positions."""
    from kvsum.rope import rope_tables, rotate
    H, T, d, n = 2, 400, 16, 40
    g = torch.Generator().manual_seed(6)
    rope = {"inv_freq": 1.0 / 100 ** (torch.arange(0, d, 2) / d), "scaling": 1.0}
    pre = torch.randn(H, T + n, 2, generator=g) @ (3 * torch.randn(H, 2, d, generator=g))
    keys = rotate(pre + 0.1 * torch.randn(H, T + n, d, generator=g), *rope_tables(rope["inv_freq"], 1.0, T + n))
    x = random_layer(H, T, d)
    x.keys, x.rope = keys[:, :T].contiguous(), rope
    x.queries, x.query_pos = torch.randn(2 * H, 30, d, generator=g), torch.arange(T - 30, T)
    coded = slice(4, T - 8)
    states = {p: make_method("turboquant", bits=2.5, key_basis="pca", pre_rope=p, window=8).compress(x).parts[1]
              for p in (False, True)}

    def rel(st, k):
        return float((st.keys()[:, -k.shape[1]:] - k).norm() / k.norm())
    err = {p: rel(st, x.keys[:, coded]) for p, st in states.items()}
    assert err[True] < 0.3 * err[False]
    st = states[True]
    assert st.nbytes() <= make_method("turboquant", bits=2.5, key_shift=0).build(
        x.keys[:, coded], x.values[:, coded], 2.5, layer_idx=0).nbytes()
    q = torch.randn(1, H, 5, d, generator=g)
    rotated = st.scores(q, 0.5)
    st.path = "dequant"
    assert torch.allclose(st.scores(q, 0.5), rotated, atol=1e-4)
    # decoded keys come after the 8-token window: positions T.., where the prompt's last code is at T - 9
    st.extend(keys[:, T:], torch.randn(H, n, d, generator=g))
    assert st.T == T - 12 + n and rel(st, keys[:, T:]) < 2 * err[True]
    with pytest.raises(kvsum.KVSumError, match="needs key_basis='pca'"):
        make_method("turboquant", pre_rope=True)
    x.rope = None
    with pytest.raises(kvsum.KVSumError, match="Llama form"):
        make_method("turboquant", key_basis="pca", pre_rope=True).compress(x)
    with pytest.raises(kvsum.KVSumError, match="drop pre_rope in a composition"):
        make_method("snapkv+turboquant", key_basis="pca", pre_rope=True)


def test_pca_outliers_keep_the_worst_coded_tokens_exact_in_the_same_bytes():
    H, T, d = 2, 400, 16
    g = torch.Generator().manual_seed(5)
    x = random_layer(H, T, d)
    x.keys = torch.randn(H, T, d, generator=g) * torch.logspace(0.7, -0.7, d)
    odd = torch.tensor([7, 100, 222, 391])
    x.keys[:, odd, -1] = 40.0  # far outside the narrow last axis: its codes cannot hold these tokens
    x.queries = torch.randn(2 * H, 30, d, generator=g)
    q = x.queries.reshape(H, -1, d)[None]
    exact = q @ x.keys.transpose(-1, -2)
    states = {o: make_method("turboquant", bits=2.5, sinks=0, key_basis="pca", outliers=o).compress(x)
              for o in (0.0, 0.01)}
    worst = {o: (st.scores(q, 1.0) - exact).abs().amax((0, 1, 2)) for o, st in states.items()}  # per token
    st = states[0.01]
    assert torch.equal(st.k.exact[0].long(), odd.expand(H, -1))  # the 4 = 1% of 400 worst tokens are these
    assert torch.equal(st.keys()[:, odd], x.keys[:, odd].half().float())
    assert worst[0.01][odd].max() < 0.05 * worst[0.0][odd].min()
    assert st.nbytes() <= make_method("turboquant", bits=2.5, sinks=0, key_shift=0).compress(x).nbytes()
    rotated = st.scores(q, 0.5)
    st.path = "dequant"
    assert torch.allclose(st.scores(q, 0.5), rotated, atol=1e-3)
    st.extend(x.keys[:, :8], x.values[:, :8])  # decoded tokens are coded only: a copy of outlier 7 is clipped
    assert st.T == T + 8 and torch.equal(st.keys()[:, 7], x.keys[:, 7].half().float())
    assert (st.keys()[:, T + 7] - x.keys[:, 7]).abs().max() > 10
    for bad in (dict(outliers=0.01), dict(outliers=1.0, key_basis="pca")):
        with pytest.raises(kvsum.KVSumError, match="outliers"):
            make_method("turboquant", **bad)


@pytest.mark.parametrize("d,rate,amx", [(64, 2.5, False), (64, 2.5, True), (64, 7.0, True), (16, 7.0, False)])
def test_pre_rope_scores_read_the_packed_codes_as_the_dequantized_keys(d, rate, amx, request):
    """The packed-code kernel's pre-RoPE scores (each key rebuilt and turned in registers; d = 64 in registers or on
    AMX tiles, other head dims by the generic loop; widths up to 8 bits; token counts that are no multiple of its
    blocks), the exact outliers' logits among them, equal the dequantized keys' turned to their positions, before and
    after decoding: to float32's precision, or about 16 bits of each product on AMX (its bf16 parts), far below any
    code's own error and far above what dropping a part would give (2^-9 of each product)."""
    from kvsum.methods.quant import native
    from kvsum.methods.quant.pca import KeyTransform
    from kvsum.rope import RopeFrame, rope_tables, rotate
    if native.library() is None:
        pytest.skip("no packed-code kernel on this machine")
    request.addfinalizer(native.amx)  # AMX allowed again after
    if native.amx(amx) != amx:
        pytest.skip("no AMX on this machine")
    H, T, n = 2, 1001, 5
    g = torch.Generator().manual_seed(d)
    rope = {"inv_freq": 1.0 / 1000 ** (torch.arange(0, d, 2) / d), "scaling": 1.0}
    # a frame's tables: slices of the shared ones where the decoded run follows the prompt's (here after 4 sinks),
    # the rows of its positions either way
    for resume in (104, 200):
        frame = RopeFrame(rope, 4, 100, resume)
        at = frame._at(frame.positions(10, 120), "cpu")
        assert all(torch.equal(a, b) for a, b in zip(frame.tables(10, 120, "cpu"), at))
    pre = torch.randn(H, T + n, d, generator=g) * torch.logspace(0.5, -0.5, d) + 1
    keys = rotate(pre, *rope_tables(rope["inv_freq"], 1.0, T + n))
    kt = KeyTransform(keys[:, :T], torch.randn(H, 40, d, generator=g), head_bytes=int(T * rate * d / 8),
                      outliers=0.02, frame=RopeFrame(rope, 0, T, T))
    widths = {k for hd in kt.heads for _, k, _, _ in hd["groups"]}
    assert len(widths) >= 3 and (max(widths) >= 6 or rate < 4)  # widths past 5: the tile path decodes them as floats
    for _ in range(2):  # 3 rows: the kernel; 20 rows (a teacher-forced run): PyTorch's path with rotate-half moved
        for rows in (3, native.MAX_ROWS + 4):  # onto the queries
            q = torch.randn(1, H, rows, d, generator=g)
            ref = q @ kt.keys()[None].transpose(-1, -2)
            assert (kt.scores(q) - ref).abs().max() <= (2e-5 if amx else 2e-6) * ref.abs().max()
        kt.extend(keys[:, T:])
