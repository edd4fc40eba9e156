"""The benchmarks' diagnosis variants (benchmarks/diagnose.py) on one layer's keys."""

import pytest
import torch

import kvsum
from benchmarks.diagnose import build
from kvsum.rope import rope_tables, rotate
from tests.helpers import random_layer


def test_rope_centered_codes_hold_biased_keys_better_than_centering_after_rope():
    """A key bias before RoPE (Qwen's k_proj bias) turns with the position: the post-RoPE mean cannot take it out,
    the turned pre-RoPE mean can, so the same codes rebuild the logits closer; the exact sinks are left alone."""
    H, T, d = 2, 400, 16
    g = torch.Generator().manual_seed(5)
    rope = {"inv_freq": 1.0 / 100 ** (torch.arange(0, d, 2) / d), "scaling": 1.0}
    x = random_layer(H, T, d)
    pre = torch.randn(H, T, d, generator=g) + 4 * torch.randn(H, 1, d, generator=g)
    x.keys, x.rope = rotate(pre, *rope_tables(rope["inv_freq"], 1.0, T)), rope
    q = torch.randn(1, H, 6, d, generator=g)
    exact = q @ x.keys.transpose(-1, -2)
    knobs = dict(bits=3.5, key_shift=0)
    after = build("turboquant", center=True, **knobs).compress(x)
    before = build("turboquant_rope_centered", **knobs).compress(x)
    err = {k: float((st.scores(q, 1.0) - exact).norm() / exact.norm()) for k, st in (("after", after),
                                                                                     ("before", before))}
    assert err["before"] < 0.5 * err["after"]
    assert torch.equal(before.scores(q, 1.0)[..., :4], after.scores(q, 1.0)[..., :4])  # the 4 sinks: exact
    x.rope = None
    with pytest.raises(kvsum.KVSumError, match="RoPE"):
        build("turboquant_rope_centered", **knobs).compress(x)
