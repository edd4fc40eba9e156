"""Reconstruction methods (echokv, lowrank) and their calibration: artifacts, fingerprints, exactness, budgets."""

import pytest
import torch

import kvsum
from kvsum.calibrate import (
    Artifact,
    calibrate,
    calibration_text,
    fingerprint,
    greedy_channels,
    layer_rope,
    rope_of,
    rope_tables,
)
from kvsum.calibrate import rotate as rope_rotate
from kvsum.calibrate import unrotate as rope_unrotate
from kvsum.methods.base import make_method
from kvsum.methods.reconstruct.lowrank import split

from .conftest import tiny_llama


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def art(model):
    return calibrate(model, ids=_ids(1600, 7), tokens=1600, seq_len=400, progress=False)


@pytest.fixture(scope="module")
def ctx():
    return _ids(300, 1)


def _logits(model, cache, q):
    with torch.no_grad():
        return model(q, past_key_values=cache).logits


def _compress(model, ctx, method, budget, storage=torch.float16, layer_budget=None, **knobs):
    m = make_method(method, **knobs)
    if layer_budget is not None:  # e.g. fp32 storage at full rank holds twice the 16-bit bytes
        m.layer_budgets = lambda inputs, b: [layer_budget] * len(inputs)
    return kvsum.compress_prefill(kvsum.prefill(model, ctx), m, budget, storage)


def test_calibration_round_trip(model, art, tmp_path):
    path = art.save(tmp_path / "tiny.kvsum")
    back = Artifact.load(path, model)
    assert back.meta == art.meta and set(back.stats) == set(art.stats) == {"k_pre", "k_post", "v"}
    for kind in art.stats:
        for name, t in art.stats[kind].items():
            assert torch.equal(back.stats[kind][name], t), (kind, name)
    assert torch.equal(back.rope["inv_freq"], art.rope["inv_freq"])
    meta = art.meta
    assert meta["nbytes"] == art.nbytes() > 0 and meta["seconds"] > 0 and meta["n_knobs"] == len(meta["knobs"])
    assert meta["knobs"]["tokens"] == 1600 and 0 < path.stat().st_size - art.nbytes() < 20_000
    # the loaded artifact drives a method just like the fresh one.
    a = _compress(model, _ids(300, 1), "lowrank", 0.5, artifact=art)
    b = _compress(model, _ids(300, 1), "lowrank", 0.5, artifact=str(path))
    assert torch.equal(a.layers[1].state.coef.k, b.layers[1].state.coef.k)


@pytest.mark.parametrize("other", [dict(seed=1), dict(kv_heads=1), dict(layers=3)])
def test_artifact_refuses_another_model(art, tmp_path, other):
    path = art.save(tmp_path / "tiny.kvsum")
    stranger = tiny_llama(**other)
    theirs = fingerprint(stranger)
    with pytest.raises(kvsum.KVSumError) as e:
        Artifact.load(path, stranger)
    msg = str(e.value)
    assert art.fingerprint["weights_sha256"] in msg and theirs["weights_sha256"] in msg
    assert f"{theirs['kv_heads']} KV heads" in msg and f"{theirs['layers']} layers" in msg
    if "seed" not in other:  # a path alone is checked against the cache's shape when compressing
        with pytest.raises(kvsum.KVSumError, match="calibration artifact is for"):
            kvsum.compress(stranger, _ids(50, 2), method="echokv", budget=0.5, artifact=str(path))


def _shared_paragraphs(text: str) -> set[str]:
    from kvsum.eval.text import paragraphs

    flat = " ".join(text.split())
    own = {" ".join(p.split()) for p in text.split("\n\n")}
    return {p for p in paragraphs() if p in flat or p in own}


def test_calibration_text_is_disjoint_from_haystack():
    from kvsum.eval.text import paragraphs

    text = calibration_text()
    assert text == calibration_text() and len(text) >= 60_000 and "def " in text and "import " in text
    assert _shared_paragraphs(text) == set()
    leak = paragraphs()[3]
    assert _shared_paragraphs(text[:5000] + "\n\n" + leak) == {leak}  # the check does see a shared paragraph


def test_rope_inverse_and_model_match(model):
    rope = rope_of(model, 16, 2)
    assert rope is not None and rope["inv_freq"].shape == (2, 8)
    cos, sin = rope_tables(rope["inv_freq"][1], float(rope["scaling"][1]), 50)
    x = torch.randn(2, 50, 16)
    assert torch.allclose(rope_unrotate(rope_rotate(x, cos, sin), cos, sin), x, atol=1e-5)
    assert not torch.allclose(rope_rotate(x, cos, sin)[:, 1:], x[:, 1:], atol=1e-2)


def test_rope_per_layer_type_gemma3():
    """Gemma 3's sliding and global layers rotate with different bases: each layer is un-rotated with its own."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvsum.attention import use_kvsum_attention

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                           layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa")
    gemma = Gemma3ForCausalLM(cfg).eval()
    use_kvsum_attention(gemma)
    rope = rope_of(gemma, 16, 2)
    assert not torch.equal(rope["inv_freq"][0], rope["inv_freq"][1])
    captured = []  # keys before RoPE: Gemma 3 rotates the output of k_norm
    hooks = [layer.self_attn.k_norm.register_forward_hook(lambda m, i, out: captured.append(out[0].float()))
             for layer in gemma.model.layers]
    pre = kvsum.prefill(gemma, _ids(200, 1))
    for h in hooks:
        h.remove()
    for i, (layer, want) in enumerate(zip(pre.cache.layers, captured)):
        r = layer_rope(rope, i)
        got = rope_unrotate(layer.keys[0].float(), *rope_tables(r["inv_freq"], r["scaling"], 200))
        assert torch.allclose(got, want, atol=1e-4), i


def test_greedy_selection_takes_one_of_each_correlated_pair():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5000, generator=g) * torch.tensor([[3.0], [2.0]])
    x = torch.stack([a, 2 * a + 0.01 * torch.randn(5000, generator=g), b, b + 0.01 * torch.randn(5000, generator=g)], 1)
    C = torch.cov(x.T).double()
    sel = greedy_channels(C, 2, torch.arange(4)[:, None]).tolist()
    assert sel[0] in (0, 1) and sel[1] in (2, 3)
    assert greedy_channels(C, 4, torch.arange(4)[:, None]).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("knobs", [dict(), dict(space="post"), dict(share_layers=2, rank=128), dict(sinks=0)])
def test_lowrank_full_rank_reproduces_full_cache(model, art, ctx, knobs):
    q = _ids(7, 3)
    full = _logits(model, kvsum.compress(model, ctx, method="full"), q)
    knobs = {"rank": 64, "key_share": 0.5, **knobs}  # keys and values: 2 heads x 16 channels each
    cache = _compress(model, ctx, "lowrank", 1.0, torch.float32, layer_budget=2.0, artifact=art, **knobs)
    assert (_logits(model, cache, q) - full).abs().max() < 1e-4


def test_echokv_keep_all_is_exact(model, art, ctx):
    q = _ids(7, 3)
    ref = _logits(model, kvsum.compress(model, ctx, method="streaming_llm", budget=1.0), q)  # every entry, fp16
    for knobs in (dict(keep=1.0), dict(mode="full"), dict()):
        cache = kvsum.compress(model, ctx, method="echokv", budget=1.0, artifact=art, **knobs)
        assert cache.nbytes() == cache.reference_nbytes
        assert torch.equal(_logits(model, cache, q), ref)
    full = _logits(model, kvsum.compress(model, ctx, method="full"), q)
    cache = _compress(model, ctx, "echokv", 1.0, torch.float32, layer_budget=2.0, artifact=art, mode="full")
    assert (_logits(model, cache, q) - full).abs().max() < 1e-4


@pytest.mark.parametrize("budget", [0.5, 0.25])
@pytest.mark.parametrize("method,knobs", [("echokv", {}), ("lowrank", {}), ("lowrank", dict(space="post")),
                                          ("lowrank", dict(share_layers=2))])
def test_budget_respected(model, art, ctx, method, knobs, budget):
    cache = kvsum.compress(model, ctx, method=method, budget=budget, artifact=art, **knobs)
    assert (budget - 0.05) * cache.reference_nbytes <= cache.nbytes() <= (budget + 0.02) * cache.reference_nbytes
    out = _logits(model, cache, _ids(5, 3))
    assert torch.isfinite(out).all()


def test_explicit_knobs_beyond_the_budget_are_refused(model, art, ctx):
    with pytest.raises(kvsum.KVSumError, match="rank=40 needs"):
        kvsum.compress(model, ctx, method="lowrank", budget=0.5, artifact=art, rank=40)
    with pytest.raises(kvsum.KVSumError, match="keep=0.75 needs"):
        kvsum.compress(model, ctx, method="echokv", budget=0.5, artifact=art, keep=0.75)
    with pytest.raises(kvsum.KVSumError, match="mode='fast'"):
        kvsum.compress(model, ctx, method="echokv", budget=0.5, artifact=art, mode="fast")
    with pytest.raises(kvsum.KVSumError, match="share_layers=3"):
        kvsum.compress(model, ctx, method="lowrank", budget=0.5, artifact=art, share_layers=3)
    with pytest.raises(kvsum.KVSumError, match="needs artifact="):
        kvsum.compress(model, ctx, method="lowrank", budget=0.5)


def _errors(model, ctx, method, **knobs):
    """Relative Frobenius error of the rebuilt keys and values, over all layers."""
    pre = kvsum.prefill(model, ctx)
    cache = kvsum.compress_prefill(pre, make_method(method, **knobs), 1.0)
    err = {}
    for w, attr in (("k", "keys"), ("v", "values")):
        ref = torch.stack([getattr(layer, attr)[0] for layer in pre.cache.layers]).float()
        got = torch.stack([layer.state.rebuilt(w) for layer in cache.layers])
        err[w] = ((got - ref).norm() / ref.norm()).item()
    return err


def test_lowrank_error_decreases_with_rank(model, art, ctx):
    errs = [_errors(model, ctx, "lowrank", artifact=art, rank=r, key_share=0.5) for r in (4, 8, 16, 32, 48, 64)]
    for w in "kv":
        e = [x[w] for x in errs]
        assert all(a > b for a, b in zip(e, e[1:])), (w, e)
        assert e[-1] < 2e-3 < e[0]  # full rank: only the fp16 rounding of the coefficients


def test_echokv_error_decreases_with_keep(model, art, ctx):
    errs = [_errors(model, ctx, "echokv", artifact=art, keep=k) for k in (0.25, 0.5, 0.75, 1.0)]
    for w in "kv":
        e = [x[w] for x in errs]
        assert all(a > b for a, b in zip(e, e[1:])) and e[0] < 1 and e[-1] < 1e-3, (w, e)


@pytest.mark.parametrize("method", ["echokv", "lowrank"])
def test_sinks_stored_whole_and_keys_get_their_share(model, art, ctx, method):
    pre = kvsum.prefill(model, ctx)
    cache = kvsum.compress_prefill(pre, make_method(method, artifact=art, sinks=3, key_share=0.25), 0.5)
    for src, layer in zip(pre.cache.layers, cache.layers):
        for w, ref in (("k", src.keys[0]), ("v", src.values[0])):
            assert torch.equal(layer.state.rebuilt(w)[:, :3], ref[:, :3].half().float())
            assert not torch.equal(layer.state.rebuilt(w)[:, 3:], ref[:, 3:].half().float())
    st = cache.layers[1].state
    kk, kv = (st.stored["k"].shape[1], st.stored["v"].shape[1]) if method == "echokv" else \
        (st.coef.k.shape[1], st.coef.v.shape[1])
    assert kk + kv == 31 and abs(kk - 0.25 * (kk + kv)) <= 2  # 0.5 of 2 x 32 numbers per token, less the sinks


def test_split_keys_and_values():
    assert split(64, 0.25, 32) == (32, 32) and split(40, 0.25, 32) == (10, 30) and split(40, 0.0, 32) == (8, 32)
    assert split(10, 0.5, 32) == (5, 5) and split(0, 0.25, 32) == (0, 0)


def test_echokv_previous_layer_helps(model, art, ctx):
    """Zeroing the cross-layer moments leaves only this layer's channels as predictors: the error goes up."""
    alone = Artifact(art.meta, {k: dict(v, cross=torch.zeros_like(v["cross"])) for k, v in art.stats.items()}, art.rope)
    for keep in (0.25, 0.5):
        both, own = (_errors(model, ctx, "echokv", artifact=a, keep=keep) for a in (art, alone))
        assert both["k"] < own["k"] - 0.02 and both["v"] < own["v"] - 0.02, (keep, both, own)


def test_layers_come_in_order_or_rebuild_from_their_own_channels(art, ctx, model):
    pre = kvsum.prefill(model, ctx)
    layer = pre.cache.layers[1]
    x = kvsum.LayerInput(layer.keys[0].float(), layer.values[0].float(), None, None, 0.25, 1, 2, 1e9, torch.float16)
    with pytest.raises(kvsum.KVSumError, match="in order"):
        make_method("lowrank", artifact=art, share_layers=2).compress(x)
    # echokv without the previous layer's state (out of order, or after an uncompressed sliding-window layer)
    # rebuilds from this layer's own stored channels: a plan with no previous-layer inputs
    state = make_method("echokv", artifact=art, keep=0.5).compress(x)
    assert state.prev is None and all(len(p.prev) == 0 for p in state.plans.values())
    assert torch.isfinite(state.rebuilt("k")).all() and torch.isfinite(state.rebuilt("v")).all()


@pytest.mark.model
def test_calibrate_bundled_model_quickly(smollm2, tmp_path):
    model, tok = smollm2
    art = calibrate(model, tok, tokens=512, method="lowrank", progress=False)
    assert art.rope is not None and art.fingerprint["kv_heads"] == 3 and art.meta["knobs"]["text"].endswith("source")
    Artifact.load(art.save(tmp_path / "s.kvsum"), model)
    ctx = tok(calibration_text(start=100)[:3000], return_tensors="pt").input_ids[:, :400]
    cache = kvsum.compress(model, ctx, method="lowrank", budget=0.5, artifact=art)
    assert cache.nbytes() <= 0.52 * cache.reference_nbytes


def test_echokv_cache_switches_between_full_and_compressed_mode(model, art, ctx):
    """One cache, two modes: "full" holds the rebuilt channels (more bytes, no rebuild per step) and gives the
    same logits up to fp16 storage; "compressed" drops them again, bit for bit what it was."""
    q = _ids(7, 3)
    cache = kvsum.compress(model, ctx, method="echokv", budget=0.25, artifact=art)
    small = cache.nbytes()
    ref = _logits(model, cache, q)
    cache.crop(-7)
    assert cache.set_mode("full") is cache and cache.nbytes() >= small + 0.7 * cache.reference_nbytes
    torch.testing.assert_close(_logits(model, cache, q), ref, atol=2e-2, rtol=0)
    cache.crop(-7)
    cache.set_mode("compressed")
    assert cache.nbytes() == small
    assert torch.equal(_logits(model, cache, q), ref)
    with pytest.raises(kvsum.KVSumError, match="accepted: compressed, full"):
        cache.set_mode("fast")
    with pytest.raises(kvsum.KVSumError, match="no full/compressed modes"):
        kvsum.compress(model, ctx, method="streaming_llm", budget=0.5).set_mode("full")
