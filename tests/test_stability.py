"""kvsum/stability.py: the numerical-stability audit."""

import pytest
import torch

from kvsum.prefill import prefill
from kvsum.report.specs import Store
from kvsum.report.stability import markdown
from kvsum.stability import DTYPES, Settings, divergence, kl_top1, method_vs_full, run
from kvsum.stability import _full_ref as full_ref
from tests.helpers import tiny_llama

PROMPTS = [torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _load(dt):
    return tiny_llama().to(DTYPES[dt]), None


def test_divergence_and_kl():
    assert divergence([1, 2, 3, 4], [1, 2, 3, 4]) == dict(first=None, rate=0.0)
    assert divergence([1, 2, 3, 4], [1, 5, 3, 6]) == dict(first=1, rate=0.5)
    x = torch.randn(5, 11)
    same = kl_top1(x, x.clone())
    assert same["kl"] == 0.0 and same["top1"] == 1.0
    y = x.clone()
    y[0] = -y[0]
    other = kl_top1(x, y)
    assert other["kl"] > 0 and other["top1"] == pytest.approx(0.8)


def test_full_against_full_is_exact():
    model, ids = tiny_llama(), PROMPTS[0]
    pre = prefill(model, ids[:, :-1])
    ref = full_ref(model, pre, ids, 6)
    r = method_vs_full(model, pre, ids, 6, "full", {}, 1.0, ref)
    assert r["div_first"] is None and r["div_rate"] == 0.0 and r["kl"] == 0.0 and r["top1"] == 1.0
    assert r["tokens"] == ref["tokens"]


def test_run_floor_methods_and_resume(tmp_path):
    st = Settings(model="tiny", dtypes=["fp32", "bf16"], prompts=2, prompt_tokens=48, new_tokens=6)
    specs = [("streaming_llm", {}), ("snapkv", {"window": 16})]  # window < the 47-token context
    store = Store(tmp_path)
    r = run(st, specs, store, load=_load, prompts=PROMPTS, progress=False)
    assert r["complete"] and not r["errors"] and store.misses == 2 * 2 * 3
    fp32 = r["summary"]["fp32"]["floor"]
    assert fp32["n"] == 2 and len(fp32["hidden_rel"]) == 2  # one entry per decoder layer
    assert max(fp32["hidden_rel"]) < 1e-5 and fp32["top1"] == 100.0  # fp32 rounding only
    assert 0.0 <= r["summary"]["bf16"]["floor"]["vs_fp32_rate"] <= 1.0
    for dt in ("fp32", "bf16"):
        for name in ("streaming_llm", "snapkv"):
            m = r["summary"][dt]["methods"][name]
            assert m["n"] == 2 and 0 <= m["rate"] <= 1 and m["kl"] >= 0 and m["ratio"] <= 0.25 + 0.02
    again = Store(tmp_path)
    r2 = run(st, specs, again, load=lambda dt: pytest.fail("a cached run must not load the model"), prompts=PROMPTS,
             progress=False)
    assert again.misses == 0 and r2["summary"] == r["summary"]
    text = markdown(r)
    assert "| fp32 | 0/2 |" in text or "| fp32 | 1/2 |" in text or "| fp32 | 2/2 |" in text
    assert "| bf16 | snapkv |" in text


def test_deadline_leaves_units_for_later(tmp_path):
    st = Settings(model="tiny", dtypes=["fp32"], prompts=1, prompt_tokens=48, new_tokens=4)
    r = run(st, [("snapkv", {})], Store(tmp_path), load=_load, prompts=PROMPTS, progress=False, deadline=0.0)
    assert not r["complete"] and r["floor"] == {} and r["methods"] == {}


def test_onepass_cache_off_matches_stepwise_in_fp32():
    from kvsum.stability import cache_off, cache_off_onepass, precision_floor

    model, ids = tiny_llama(), PROMPTS[1]
    toks, logits, hidden = cache_off(model, ids, 5)
    one_toks, one_logits, one_hidden = cache_off_onepass(model, ids, toks)
    assert one_toks == toks and one_logits.shape == logits.shape and one_hidden.shape == hidden.shape
    assert torch.allclose(one_logits, logits, atol=1e-4) and torch.allclose(one_hidden, hidden, atol=1e-4)
    r = precision_floor(model, ids, 5, onepass=True)
    assert r["div_first"] is None and r["top1"] == 1.0 and max(r["hidden_rel"]) < 1e-5


def test_variants_of_one_method_are_kept_apart(tmp_path):
    st = Settings(model="tiny", dtypes=["fp32"], prompts=1, prompt_tokens=48, new_tokens=4)
    specs = [("snapkv", {"window": 16}), ("snapkv", {"window": 8})]
    r = run(st, specs, Store(tmp_path), load=_load, prompts=PROMPTS, progress=False)
    assert set(r["summary"]["fp32"]["methods"]) == {"snapkv:window=16", "snapkv:window=8"}
