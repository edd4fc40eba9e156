"""Method configs are values: one instance, reused across prompts (interleaved) and threads, gives exactly what a
fresh instance gives each prompt alone."""

import dataclasses
import threading

import pytest
import torch

import kvsum
from kvsum.calibrate import calibrate
from kvsum.methods import REGISTRY, make_method, prefill_needs
from tests.helpers import tiny_llama

COMPOSITIONS = ("snapkv+turboquant", "summary+turboquant")
BUDGET = 0.5


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def art(model):
    return calibrate(model, ids=_ids(1600, 7), tokens=1600, seq_len=400, progress=False)


PROMPTS = {"A": _ids(600, 1), "B": _ids(480, 2)}  # long enough for kivi's full-precision residual at BUDGET
QUERY = _ids(4, 3)


def _method(name, art):
    knobs = {"artifact": art} if "+" not in name and "artifact" in REGISTRY[name].knobs() else {}
    return make_method(name, **knobs)


def _tensors(obj, prefix: str, out: dict, depth: int = 0) -> dict:
    """Every tensor reachable from a layer state (attributes, lists, dicts), by path."""
    if depth > 5 or obj is None or isinstance(obj, (str, int, float, bool, type)):
        return out
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, f"{prefix}[{i}]", out, depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{prefix}[{k!r}]", out, depth + 1)
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            _tensors(v, f"{prefix}.{k}", out, depth + 1)
    return out


def _run(model, method, prompt: str) -> dict:
    """What `method` makes of one prompt: every tensor its layer states hold, and the logits of a few query tokens
    read through the compressed cache."""
    pre = kvsum.prefill(model, PROMPTS[prompt], **prefill_needs([method]))
    cache = kvsum.compress_prefill(pre, method, BUDGET)
    out = {}
    for i, layer in enumerate(cache.layers):
        _tensors(getattr(layer, "state", None), f"layer{i}", out)
    with torch.no_grad():
        out["logits"] = model(QUERY, past_key_values=cache).logits
    return {k: v.detach().clone() for k, v in out.items()}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("name", sorted(REGISTRY) + list(COMPOSITIONS))
def test_one_instance_interleaved_and_threaded_gives_what_each_prompt_gets_alone(model, art, name):
    alone = {p: _run(model, _method(name, art), p) for p in PROMPTS}
    shared = _method(name, art)
    for step, p in enumerate("ABA"):
        _assert_same(_run(model, shared, p), alone[p], f"{name}, prompt {p} at step {step} of A, B, A")
    results, errors = {}, []

    def work(p):
        try:
            results[p] = [_run(model, shared, p) for _ in range(2)]
        except Exception as e:  # reported below, with the prompt
            errors.append((p, e))

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for p, runs in results.items():
        for r in runs:
            _assert_same(r, alone[p], f"{name}, prompt {p} from a thread")


@pytest.mark.parametrize("name", sorted(REGISTRY) + list(COMPOSITIONS))
def test_every_method_is_a_frozen_dataclass(art, name):
    m = _method(name, art)
    cls = type(m)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
    for base in cls.__mro__:
        if dataclasses.is_dataclass(base):
            assert base.__dataclass_params__.frozen, (name, base)
    field = dataclasses.fields(m)[0].name if dataclasses.fields(m) else "anything"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m._cache = {}
