"""kvsum/report/rules.py: recommendations from the report's own numbers."""

from kvsum.report import rules


def _row(task, method, budget, ratio, score=None, full=None, kl=None):
    r = dict(task=task, method=method, budget=budget, ratio=ratio)
    if kl is not None:
        r["kl"] = kl
    else:
        r.update(score=score, full_score=full)
    return r


def test_rules_pick_the_smallest_holding_config_and_cite_numbers():
    rows = [_row("passkey", "snapkv", 0.25, 0.25, 100, 100), _row("lm", "snapkv", 0.25, 0.25, kl=0.05),
            _row("passkey", "snapkv", 0.125, 0.125, 33, 100), _row("lm", "snapkv", 0.125, 0.125, kl=0.03),
            _row("passkey", "kivi", 0.25, 0.2, 100, 100), _row("lm", "kivi", 0.25, 0.2, kl=0.5),
            _row("passkey", "summary", 0.125, 0.124, 100, 100), _row("lm", "summary", 0.125, 0.124, kl=0.08)]
    tp = [dict(length=128, method="kivi", ratio_to_full=0.5, tok_s=5.0, full_tok_s=10.0, bytes_ratio=0.2)]
    sc = [dict(length=4096, method="kivi", decode_ratio=3.0, step_ms=300.0, full_step_ms=100.0)]
    recs = {r["case"]: r for r in rules.recommend(rows, [], tp, sc, None)}
    long = recs["long context, memory-bound"]
    assert long["advice"] == "summary (summarization) at budget 0.125"  # snapkv@0.125 drops 67 points; kivi KL 0.5
    assert "0.124" in long["evidence"] and "KL 0.0800" in long["evidence"]
    assert recs["quality first at budget 0.25"]["advice"] == "snapkv (eviction)"
    assert recs["short context (128 tokens), memory headroom"]["advice"] == "full cache"
    assert "0.50x" in recs["short context (128 tokens), memory headroom"]["evidence"]
    assert recs["latency-bound decoding"]["advice"] == "avoid kivi" and "3.00x" in recs["latency-bound decoding"][
        "evidence"]
