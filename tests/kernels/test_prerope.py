"""kvsum/kernels/prerope.py: pca keys coded before RoPE, rebuilt, turned and scored from their packed codes."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvsum.methods.quant import native  # noqa: E402
from kvsum.methods.quant.packing import Packed  # noqa: E402
from kvsum.methods.quant.pca import KeyTransform  # noqa: E402
from kvsum.rope import RopeFrame, rope_tables, rotate  # noqa: E402

TOL = 2e-6  # of the largest logit: float32's precision (the rebuilt keys' sums in another order)


def _transform(d, rate, T, n, device, outliers=0.02):
    """A KeyTransform of H = 2 heads coded before RoPE from T keys, and n more keys to extend it with."""
    g = torch.Generator().manual_seed(d)
    rope = {"inv_freq": 1.0 / 1000 ** (torch.arange(0, d, 2) / d), "scaling": 1.0}
    pre = torch.randn(2, T + n, d, generator=g) * torch.logspace(1.5, -1.5, d) + 1  # widths 1 to 8 bits
    keys = rotate(pre, *rope_tables(rope["inv_freq"], 1.0, T + n))
    kt = KeyTransform(keys[:, :T], torch.randn(2, 40, d, generator=g), head_bytes=int(T * rate * d / 8),
                      outliers=outliers, frame=RopeFrame(rope, 0, T, T))
    return _moved(kt, device), keys[:, T:].to(device), g


def _moved(kt, device):
    """The transform's held tensors moved to `device` (fitted on the CPU)."""
    for hd in kt.heads:
        for k in ("mean", "axes", "std", "widths"):
            hd[k] = hd[k].to(device)
        for gr in hd["groups"]:
            gr[2], gr[3].data = gr[2].to(device), gr[3].data.to(device)
            gr[3].restore()
    kt.exact = tuple(t.to(device) for t in kt.exact) if kt.exact is not None else None
    return kt


def _no_other_path(monkeypatch):
    """Neither the CPU kernel nor PyTorch's dequantizing path may serve: the codes are read packed."""
    def refuse(*args, **kwargs):
        raise AssertionError("not the Triton kernel")
    monkeypatch.setattr(native, "score_prerope", refuse)
    monkeypatch.setattr(Packed, "lookup", refuse)
    monkeypatch.setattr(Packed, "codes", refuse)


@pytest.mark.parametrize("d,rate,T", [(64, 8.0, 301), (16, 10.0, 201)])
def test_scores_are_the_dequantized_keys_turned(kernel, device, monkeypatch, d, rate, T):
    """The Triton scores (head dims 64 and 16, widths up to 8 bits, token counts no multiple of the block, the exact
    outliers among them) equal the dequantized keys' turned to their positions, before and after decoding, to
    float32's precision; many query rows still take PyTorch's path."""
    kt, more, g = _transform(d, rate, T, 5, device)
    widths = [{k for _, k, _, _ in hd["groups"]} for hd in kt.heads]
    assert set.union(*widths) == set(range(1, 9)) and min(map(len, widths)) >= 5  # some heads without some widths
    assert kt.exact is not None and kt.heads[0]["axes"].shape[1] > 32 * (d == 64)  # d = 64: two blocks of axes
    for _ in range(2):
        q = torch.randn(1, 2, 3, d, generator=g).to(device)
        ref = q @ kt.keys()[None].transpose(-1, -2)
        with monkeypatch.context() as m, kernel():
            _no_other_path(m)
            s = kt.scores(q)
        assert s.shape == ref.shape and (s - ref).abs().max() <= TOL * ref.abs().max()
        with kernel():  # 20 rows: the dequantized keys (a matmul), not the kernel
            q = torch.randn(1, 2, native.MAX_ROWS + 4, d, generator=g).to(device)
            ref = q @ kt.keys()[None].transpose(-1, -2)
            assert (kt.scores(q) - ref).abs().max() <= TOL * ref.abs().max()
        kt.extend(more)


def test_every_group_is_read_with_its_own_axes(kernel, device):
    """Each width group counts: with one group's levels set to 0 the kernel gives the keys without that group's part
    (mean plus the others'), which is far from the full scores: a group read at the wrong axes, tokens or width
    would fail here (and in the test above). Also a head with no axis: its mean alone."""
    from kvsum.kernels.prerope import score_prerope

    kt, _, g = _transform(16, 10.0, 201, 0, device, outliers=0.0)
    head = kt.heads[0]
    assert len(head["groups"]) >= 5
    cos, sin = kt.frame.tables(0, kt.T, device)
    q = torch.randn(1, 3, 16, generator=g).to(device)
    parts = list(kt._parts(head))
    mean = head["mean"].float()

    def ref(skip):
        k = mean + sum(z @ w for i, (z, w) in enumerate(parts) if i != skip)
        return q[0] @ rotate(k, cos, sin).t()

    with kernel():
        full = score_prerope([head], cos, sin, q)
    assert (full[0] - ref(None)).abs().max() <= TOL * ref(None).abs().max()
    for i, (_, bits, levels, _) in enumerate(head["groups"]):
        groups = [list(gr) for gr in head["groups"]]
        groups[i][2] = torch.zeros_like(levels)
        with kernel():
            s = score_prerope([dict(head, groups=groups)], cos, sin, q)[0]
        r = ref(i)
        assert (s - r).abs().max() <= TOL * r.abs().max()
        assert (s - full[0]).abs().max() > 100 * TOL * r.abs().max(), f"the {bits}-bit group adds nothing"
    empty = dict(head, axes=head["axes"][:, :0], std=head["std"][:0], widths=head["widths"][:0], groups=[])
    with kernel():
        s = score_prerope([empty], cos, sin, q)[0]
    r = q[0] @ rotate(mean.expand(kt.T, -1), cos, sin).t()
    assert (s - r).abs().max() <= TOL * r.abs().max()
