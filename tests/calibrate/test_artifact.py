"""kvsum/calibrate/artifact.py: saving, loading and checking an artifact against its model."""

import pytest
import torch

import kvsum
from kvsum.calibrate import Artifact, fingerprint
from tests.helpers import compress_with_plan, random_ids, tiny_llama


def test_calibration_round_trip(tiny, tiny_art, tmp_path):
    path = tiny_art.save(tmp_path / "tiny.kvsum")
    back = Artifact.load(path, tiny)
    assert back.meta == tiny_art.meta and set(back.stats) == set(tiny_art.stats) == {"k_pre", "k_post", "v"}
    for kind in tiny_art.stats:
        for name, t in tiny_art.stats[kind].items():
            assert torch.equal(back.stats[kind][name], t), (kind, name)
    assert torch.equal(back.rope["inv_freq"], tiny_art.rope["inv_freq"])
    meta = tiny_art.meta
    assert meta["nbytes"] == tiny_art.nbytes() > 0 and meta["seconds"] > 0 and meta["n_knobs"] == len(meta["knobs"])
    assert meta["knobs"]["tokens"] == 1600 and 0 < path.stat().st_size - tiny_art.nbytes() < 20_000
    # the loaded artifact drives a method just like the fresh one.
    a = compress_with_plan(tiny, random_ids(300, 1), "lowrank", 0.5, artifact=tiny_art)
    b = compress_with_plan(tiny, random_ids(300, 1), "lowrank", 0.5, artifact=str(path))
    assert torch.equal(a.layers[1].state.coef.k, b.layers[1].state.coef.k)


@pytest.mark.parametrize("other", [dict(seed=1), dict(kv_heads=1), dict(layers=3)])
def test_artifact_refuses_another_model(tiny_art, tmp_path, other):
    path = tiny_art.save(tmp_path / "tiny.kvsum")
    stranger = tiny_llama(**other)
    theirs = fingerprint(stranger)
    with pytest.raises(kvsum.KVSumError) as e:
        Artifact.load(path, stranger)
    msg = str(e.value)
    assert tiny_art.fingerprint["weights_sha256"] in msg and theirs["weights_sha256"] in msg
    assert f"{theirs['kv_heads']} KV heads" in msg and f"{theirs['layers']} layers" in msg
    if "seed" not in other:  # a path alone is checked against the cache's shape when compressing
        with pytest.raises(kvsum.KVSumError, match="calibration artifact is for"):
            kvsum.compress(stranger, random_ids(50, 2), method="echokv", budget=0.5, artifact=str(path))
