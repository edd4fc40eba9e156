"""kvsum/prefill.py: input checks, surprisal, repeat scores, sentence ends, prefill extras."""

import math

import pytest
import torch

import kvsum
from kvsum.methods import make_method
from kvsum.prefill import prefill
from tests.helpers import (
    SentenceTokenizer,
    tiny_gemma,
)


def test_surprisal_matches_model_logits(tiny, ids):
    pre = prefill(tiny, ids, surprisal=True)
    with torch.no_grad():
        logp = torch.log_softmax(tiny(ids).logits[0].float(), -1)
    expected = -logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(pre.surprisal[1:], expected, rtol=1e-4, atol=1e-4)
    assert math.isinf(pre.surprisal[0])


def test_repeat_prefill_scores_keys_and_leaves_the_cache_as_it_was(tiny, ids):
    plain = prefill(tiny, ids)
    rich = prefill(tiny, ids, repeat=True)
    for a, b in zip(plain.cache.layers, rich.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # the re-read is cropped off
    assert set(rich.repeat_scores) == {0, 1}
    s = rich.repeat_scores[0]
    assert s.shape == (2, ids.shape[1]) and float(s.min()) >= 0 and float(s.max()) <= 1


def test_prefill_extras_run_only_when_a_method_asks(tiny, ids):
    assert prefill(tiny, ids).surprisal is None  # eviction, quantization, calibration: no output-layer pass
    assert make_method("summary").prefill_options()["surprisal"]
    assert not any(make_method("summary", score="sharp_mass").prefill_options().values())
    assert make_method("streaming_llm").prefill_options() == {}


def test_sentence_ends_marks_tokens_holding_an_end_character():
    from kvsum.prefill import sentence_ends

    ids = torch.tensor([0, 1, 9, 2, 10, 12, 3, 11, 4, 8])  # a b . c ! \n d ? e space
    assert sentence_ends(SentenceTokenizer(), ids).tolist() == [False, False, True, False, True, True, False, True,
                                                             False, False]
    with pytest.raises(kvsum.KVSumError, match="tokenizer"):
        sentence_ends(object(), ids)


@pytest.mark.parametrize("mask, match", [
    (torch.ones(2, 9), "integer or bool"),
    (torch.ones(2, 8, dtype=torch.long), "shape of input_ids"),
    (torch.tensor([[1] * 9, [1, 1, 1, 0, 0, 0, 0, 0, 0]]), "left padded"),
    (torch.tensor([[1] * 9, [0] * 9]), "padding only"),
    (torch.full((2, 9), 2), "only 0"),
])
def test_bad_attention_mask(tiny, mask, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        kvsum.compress(tiny, torch.ones(2, 9, dtype=torch.long), attention_mask=mask)


def test_gemma_repeat_scoring_crops_the_windows():
    model = tiny_gemma()
    ctx = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    pre = kvsum.prefill(model, ctx, repeat=True)
    assert set(pre.repeat_scores) == {2, 5}
    ref = kvsum.prefill(model, ctx)
    for a, b in zip(pre.cache.layers, ref.cache.layers):
        assert a.get_seq_length() == 100
        torch.testing.assert_close(a.keys, b.keys)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    (torch.full((2, 5), 128), r"token ids in \[0, 128\)"),
    (torch.zeros(1, 5), "integer torch.Tensor"),
    (torch.zeros(1, 5000, dtype=torch.long), "longer than the model's window"),
    (torch.zeros(1, 1, 5, dtype=torch.long), r"shape \(B, T\)"),
    ([1, 2, 3], "integer torch.Tensor"),
])
def test_bad_input_ids(tiny, bad, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        kvsum.compress(tiny, bad, method="streaming_llm")
