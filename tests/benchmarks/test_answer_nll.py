"""The teacher-forced answer diagnosis (benchmarks/answer_nll.py): the value tokens it scores, the forced NLL on a
kvsum cache against the model's own forward, and the rows it pools."""

import torch

import kvsum
from benchmarks import answer_nll
from kvsum.methods import make_method
from tests.helpers import CharTokenizer, tiny_llama


def test_value_mask_marks_the_tokens_that_spell_a_given_value():
    tok = CharTokenizer()
    text = "The numbers: 417, then 88."
    ids = tok(text, return_tensors="pt").input_ids
    mask = answer_nll.value_mask(tok, ids, text, ("417", "88", "999"))
    assert "".join(c for c, m in zip(text, mask.tolist()) if m) == "41788"


def test_forced_nll_on_the_full_cache_is_the_models_own_forward():
    torch.manual_seed(0)
    model = tiny_llama()
    ctx, prefix, target = (torch.randint(1, 128, (1, n)) for n in (40, 5, 6))
    cache = kvsum.compress_prefill(kvsum.prefill(model, ctx), make_method("full"), 1.0)
    nll, hit = answer_nll.forced_nll(model, prefix, target, cache)
    with torch.no_grad():
        logits = model(torch.cat([ctx, prefix, target], -1)).logits[0, 44:-1].float()
    assert torch.allclose(nll, -logits.log_softmax(-1).gather(1, target[0][:, None])[:, 0], atol=1e-5)
    assert torch.equal(hit, logits.argmax(-1) == target[0])


def test_rows_pool_value_tokens_and_pair_against_the_first_configuration():
    recs = [dict(task="t", index=i, config=c, budget=b, full_score=1.0, value_tokens=n, value_nll=v, value_misses=m,
                 reference_nll=r, bytes=by)
            for i, n, vs in ((0, 4, (0.4, 0.8, 0.6)), (1, 0, (0.0, 0.0, 0.0)), (2, 6, (0.6, 0.6, 1.2)))
            for (c, b, by, m, r), v in zip((("full", 1.0, 1.0, 0, 1.0), ("cover", 0.25, 0.25, 1, 1.2),
                                            ("other", 0.25, 0.2, 2, 1.1)), vs)]
    full, cover, other = answer_nll.rows_of(recs)
    assert full["value_nll"] == 0.1 and full["excess"] == 0  # (0.4 + 0.6) / 10 value tokens
    assert cover["value_nll"] == 0.14 and cover["excess"] == 0.04 and cover["value_misses"] == 3
    assert other["value_nll"] == 0.18 and other["below_first"] == 1 and other["answered_examples"] == 2
    assert cover["reference_nll"] == 1.2 and other["bytes"] == 0.2
