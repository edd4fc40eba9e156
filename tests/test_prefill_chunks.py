"""Long prompts in bounded memory: kvsum.prefill runs a prompt longer than `whole` tokens in chunks, gathering the
reference queries and the surprisal per chunk, so no attention call is larger than chunk x T per head."""

import pytest
import torch

import kvsum
from kvsum import attention
from kvsum.methods import make_method
from kvsum.prefill import CHUNK, WHOLE
from tests.helpers import tiny_gemma, tiny_llama, tiny_qwen2


def _ids(n, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def calls(monkeypatch):
    """(query length, key length) of every sdpa call kvsum's attention makes."""
    seen, real = [], attention.sdpa_attention_forward

    def spy(module, query, key, *a, **kw):
        seen.append((query.shape[2], key.shape[2]))
        return real(module, query, key, *a, **kw)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    return seen


def test_prompts_up_to_8k_are_not_chunked(calls):
    assert WHOLE >= 8192 and CHUNK <= WHOLE  # every committed figure was measured on one-pass prefills
    kvsum.prefill(tiny_llama(), _ids(600))
    assert calls == [(600, 600)] * 2


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_gemma])
def test_chunked_prefill_matches_one_pass(make, calls):
    model, ids = make(), _ids(600)
    one = kvsum.prefill(model, ids, surprisal=True)
    calls.clear()
    chunked = kvsum.prefill(model, ids, surprisal=True, whole=0, chunk=128)
    assert max(q for q, _ in calls) == 128 and max(k for _, k in calls) <= 600  # never T x T
    assert len(calls) == 5 * len(model.model.layers)
    torch.testing.assert_close(chunked.query_pos, one.query_pos, rtol=0, atol=0)
    for i, q in one.queries.items():
        torch.testing.assert_close(chunked.queries[i], q, rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked.cache.layers, one.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.surprisal, one.surprisal, rtol=1e-4, atol=1e-4)
    assert chunked.cache.get_seq_length() == 600 and chunked.cache.reference_nbytes == one.cache.reference_nbytes
    q = _ids(4, 3)
    for name in ("snapkv", "turboquant", "summary"):
        with torch.no_grad():
            outs = [model(q, past_key_values=kvsum.compress_prefill(p, make_method(name), 0.5)).logits
                    for p in (kvsum.prefill(model, ids, surprisal=True), kvsum.prefill(model, ids, surprisal=True,
                                                                                      whole=0, chunk=128))]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3, msg=name)


def test_repeat_scoring_is_refused_beyond_one_chunk():
    model, ids = tiny_llama(), _ids(600)
    assert kvsum.prefill(model, ids, repeat=True, whole=0, chunk=600).repeat_scores is not None  # one chunk: fine
    with pytest.raises(kvsum.KVSumError, match="repeat scoring re-reads the prompt in one pass"):
        kvsum.prefill(model, ids, repeat=True, whole=0, chunk=128)


@pytest.mark.parametrize("kw", [dict(chunk=0), dict(chunk=2.5), dict(whole=-1)])
def test_bad_chunk_is_a_clear_error(kw):
    with pytest.raises(kvsum.KVSumError, match="chunk must be an integer > 0"):
        kvsum.prefill(tiny_llama(), _ids(50), **kw)
