"""The benchmarks' diagnosis variants on a tiny random Qwen2 (its key bias large, as in the trained model)."""

import pytest
import torch

import kvsum
from benchmarks.diagnose import build
from tests.helpers import tiny_qwen2


def _logit_error(model, pre, method) -> float:
    """Relative error of the compressed prompt's attention logits for the prefill's reference queries, all layers."""
    cache = kvsum.compress_prefill(pre, method, 1.0)
    num = den = 0.0
    for i, layer in enumerate(pre.cache.layers):
        keys = layer.keys[0].float()  # (H, T, d)
        H, d = keys.shape[0], keys.shape[-1]
        q = pre.queries[i].float()  # (Hq, n, d): query head h reads KV head h // (Hq / H)
        q = q.reshape(H, -1, d)[None]
        got = cache.layers[i].state.scores(q, 1.0)[0]
        want = q[0] @ keys.transpose(-1, -2)
        num += float((got - want).square().sum())
        den += float(want.square().sum())
    return (num / den) ** 0.5


def test_rope_centered_codes_hold_biased_keys_better_than_centering_after_rope():
    """A key bias before RoPE turns with the position: the post-RoPE mean cannot take it out, the turned pre-RoPE
    mean can, so the same codes rebuild the logits closer."""
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(3))
    pre = kvsum.prefill(model, ids)
    after = _logit_error(model, pre, build("turboquant", bits=3.5, center=True))
    before = _logit_error(model, pre, build("turboquant_rope_centered", bits=3.5))
    assert before < 0.7 * after


def test_rope_centered_refuses_a_model_without_llama_rope():
    from benchmarks.diagnose import TurboQuantRopeCentered

    class X:
        rope, T = None, 10

    with pytest.raises(kvsum.KVSumError, match="RoPE"):
        TurboQuantRopeCentered(bits=3.5).compress(X())
