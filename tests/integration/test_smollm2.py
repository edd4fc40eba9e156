"""Integration tests on the bundled SmolLM2 (marked `model`), one per module they exercise."""

import pytest

import kvsum
from kvsum.calibrate import Artifact, calibrate, calibration_text
from kvsum.cli import main
from kvsum.eval import run
from kvsum.methods import make_method
from tests.helpers import assert_full_is_dynamic_cache, kl_div, teacher_forced


@pytest.mark.model
def test_quantized_smollm2_tracks_the_full_cache(smollm2):
    from pydoc_data.topics import topics

    model, tok = smollm2
    ids = tok(topics["assignment"], return_tensors="pt").input_ids[:, :448]
    ctx, cont = ids[:, :384], ids[:, 384:]
    pre = kvsum.prefill(model, ctx)
    full = teacher_forced(model, kvsum.compress_prefill(pre, make_method("full"), 1.0), cont)
    kl = {}
    for name, bits in [("turboquant", 4), ("turboquant", 2), ("kivi", 4)]:
        cache = kvsum.compress_prefill(pre, make_method(name, bits=bits), 1.0)
        kl[name, bits] = kl_div(full, teacher_forced(model, cache, cont))
    assert kl["turboquant", 4] < 0.05 and kl["kivi", 4] < 0.05
    assert kl["turboquant", 4] < kl["turboquant", 2]


@pytest.mark.model
def test_whole_sentences_keep_facts_on_smollm2(smollm2):
    """On the bundled model, at budget 0.125: with whole-sentence anchors summary+turboquant answers multi-key
    questions that single-token surprisal anchors lose (the fact survives without its digits)."""
    from kvsum.eval import run

    model, tok = smollm2
    specs = [("summary+turboquant", dict(score=s), [0.125]) for s in ("sentence", "surprisal")]
    rows = run(model, tok, "multikey", specs, [], [1024], n=4, progress=False)
    sentence, surprisal = (r["score"] for r in rows)
    assert all(r["ratio"] <= 0.125 + 0.02 for r in rows)
    assert sentence >= 50 and sentence > surprisal, (sentence, surprisal)


@pytest.mark.model
def test_the_rules_retrieval_threshold_takes_a_tenth_of_smollm2s_heads_clear_of_any(smollm2):
    """The threshold sits between heads, not on one: on SmolLM2 it takes the 9 of 90 KV heads chosen on dev (a
    tenth), none within 0.01 of it (the rule takes the same heads where the probe's sums round otherwise)."""
    import torch

    from kvsum.methods.summary.default import RETRIEVAL
    from kvsum.retrieval import retrieval_scores

    model, tok = smollm2
    flat = torch.cat(list(retrieval_scores(model, tok).values()))
    cut = RETRIEVAL["summary_retrieval_score"]
    assert int((flat >= cut).sum()) == 9 and float((flat - cut).abs().min()) > 0.01


@pytest.mark.model
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_is_bit_identical_to_dynamic_cache_smollm2(attn, smollm2):
    model, tok = smollm2
    ctx = tok("Bit for bit: the uncompressed path is transformers' own cache. " * 30, return_tensors="pt").input_ids
    q = tok(" In short,", return_tensors="pt").input_ids
    model.set_attn_implementation("kvsum_" + attn)
    try:
        assert_full_is_dynamic_cache(model, ctx, q)
    finally:
        model.set_attn_implementation("kvsum_sdpa")


@pytest.mark.model
def test_calibrate_bundled_model_quickly(smollm2, tmp_path):
    model, tok = smollm2
    art = calibrate(model, tok, tokens=512, method="lowrank", progress=False)
    assert art.rope is not None and art.fingerprint["kv_heads"] == 3 and art.meta["knobs"]["text"].endswith("source")
    Artifact.load(art.save(tmp_path / "s.kvsum"), model)
    ctx = tok(calibration_text(start=100)[:3000], return_tensors="pt").input_ids[:, :400]
    cache = kvsum.compress(model, ctx, method="lowrank", budget=0.5, artifact=art)
    assert cache.nbytes() <= 0.52 * cache.reference_nbytes


@pytest.mark.model
def test_full_cache_passkey_1k_is_perfect(smollm2):
    model, tokenizer = smollm2
    (row,) = run(model, tokenizer, "passkey", ["full"], [], [1024], n=3, progress=False)
    assert row["score"] == 100.0, row["examples"]


@pytest.mark.model
def test_generate_with_the_full_cache_is_plain_generate(smollm2):
    model, tok = smollm2
    ctx = "The special code for the falcon is 48213. " * 4
    text, cache = kvsum.generate(model, tok, ctx, "\n\nThe special code for the falcon is", max_new_tokens=8,
                                 return_cache=True)
    assert cache.decision.method == "full"
    ids = tok(ctx + "\n\nThe special code for the falcon is", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert text == tok.decode(ref[0, ids.shape[-1]:], skip_special_tokens=True)
    assert "48213" in text
    forced = kvsum.Policy(memory=0.5)
    text2, cache2 = kvsum.generate(model, tok, ctx, "\n\nThe special code for the falcon is", policy=forced,
                                   max_new_tokens=8, return_cache=True)
    assert cache2.decision.method != "full" and isinstance(text2, str) and text2
    ctx_ids = tok(ctx, return_tensors="pt").input_ids
    assert kvsum.compress(model, ctx_ids, policy=forced).ratio() <= 0.5 + 0.02  # before decoding grows it


@pytest.mark.model
def test_context_longer_than_window_is_rejected(capsys, smollm2):
    assert main(["eval", "--method", "full", "--lengths", "100000"]) == 2
    assert "longer than the model's window" in capsys.readouterr().err


@pytest.mark.model
def test_demo_runs_on_the_bundled_model(capsys, smollm2):
    assert main(["demo", "--method", "streaming_llm", "--tokens", "600"]) == 0
    out = capsys.readouterr().out
    assert "bytes held" in out and "pass key" in out


LOAD_AND_ANSWER = """
import sys, torch, kvsum
model, tok = kvsum.load_model("smollm2")
cache = kvsum.load_cache(sys.argv[1], model)
ids = torch.load(sys.argv[2])
out = model.generate(ids, cache=cache, max_new_tokens=16, do_sample=False)
print(" ".join(map(str, out[0, ids.shape[1]:].tolist())))
"""


@pytest.mark.model
def test_a_cache_saved_here_answers_the_same_in_a_fresh_process(smollm2, tmp_path):
    """A compressed 1k-token SmolLM2 cache saved here and loaded in a new Python process generates the same
    greedy tokens as the saved one; the file is within 2% of the bytes the cache holds."""
    import os
    import subprocess
    import sys
    from pydoc_data.topics import topics

    import torch

    model, tok = smollm2
    ctx = tok(topics["assignment"], return_tensors="pt").input_ids[:, :1024]
    ids = torch.cat([ctx, tok("\n\nIn short, an assignment", return_tensors="pt", add_special_tokens=False).input_ids],
                    -1)
    torch.save(ids, tmp_path / "ids.pt")
    for spec in ("summary:cover=turboquant(bits=3.5,center=True),score=surprisal", "turboquant", "snapkv"):
        name, _, knobs = spec.partition(":")
        cache = kvsum.compress(model, ctx, method=name, budget=0.25, tokenizer=tok,
                               **({"cover": kvsum.TurboQuant(bits=3.5, center=True), "score": "surprisal"}
                                  if knobs else {}))
        path = cache.save(tmp_path / "c.kvsum")
        assert path.stat().st_size <= 1.02 * cache.nbytes()
        here = model.generate(ids, cache=cache.fork(), max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", LOAD_AND_ANSWER, str(path), str(tmp_path / "ids.pt")],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert list(map(int, out.stdout.split())) == here, spec
