"""The kernels inside a model's decoding steps (a tiny random Llama, head dim 64): greedy generation over caches of
every kind the kernels serve gives the PyTorch path's logits."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

import kvsum  # noqa: E402
from kvsum.kernels import codes, flash, kivi, ragged  # noqa: E402
from tests.helpers import greedy_logits, tiny_llama  # noqa: E402

# method, knobs, budget, the kernel entry points its decoding steps must go through
METHODS = [
    ("turboquant", dict(bits=3.5, center=True), 0.3, ["flash.coded"]),  # codes + exact sinks: fused
    ("kivi", dict(bits=4, residual=32), 0.5, ["kivi.attend"]),  # fused, sinks and window beside
    ("summary", dict(cover="turboquant(bits=3.5,center=True)", score="surprisal"), 0.3,
     ["flash.coded"]),  # the flagship: anchors (equal per head here: a matmul) + the code cover, fused
    ("snapkv", dict(allocation="adaptive"), 0.3, ["ragged.scores", "ragged.mix"]),  # ragged heads, one launch
    ("snapkv+turboquant", dict(bits=3, allocation="adaptive"), 0.3, ["flash.coded"]),  # ragged heads: runs, fused
]
MODULES = {"codes": codes, "flash": flash, "kivi": kivi, "ragged": ragged}


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of every kernel entry point."""
    seen = {}
    for mod_name, fn_name in [n.split(".") for n in ("flash.coded", "kivi.attend", "ragged.scores", "ragged.mix",
                                                       "codes.score", "codes.mix")]:
        mod = MODULES[mod_name]
        fn = getattr(mod, fn_name)

        def spy(*a, _fn=fn, _key=f"{mod_name}.{fn_name}", **k):
            seen[_key] = seen.get(_key, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(mod, fn_name, spy)
    return seen


@pytest.mark.parametrize("name,knobs,budget,used", METHODS, ids=[m[0] for m in METHODS])
def test_generation_matches_the_pytorch_path(kernel, reference, device, calls, name, knobs, budget, used):
    model = tiny_llama(head_dim=64).to(device)
    ctx = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3)).to(device)
    question = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(4)).to(device)
    cache = kvsum.compress(model, ctx, method=name, budget=budget, **knobs)
    full_ids = torch.cat([ctx, question], -1)
    with reference():
        ref = greedy_logits(model, full_ids, cache.fork(), steps=3)
    with kernel():
        out = greedy_logits(model, full_ids, cache.fork(), steps=3)
    assert all(calls.get(k) for k in used), calls
    for a, b in zip(out, ref):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4
