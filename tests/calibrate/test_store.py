"""kvsum/calibrate/store.py: artifacts found by the model's fingerprint, stale ones refused."""

import pytest
import torch

import kvsum
from kvsum import models as kvsum_models
from kvsum.calibrate import Artifact, calibrate, fingerprint
from tests.helpers import cached_logits, random_ids, tiny_llama


class _Tokenizer:
    """Enough of a tokenizer for calibration text: one token id per character."""

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [ord(c) % 128 for c in text]})()


def test_artifact_found_by_fingerprint_after_kvsum_calibrate(tiny, ids, tmp_path, monkeypatch):
    """`kvsum calibrate --model M` saves under the kvsum cache by fingerprint; artifact=None then finds it."""
    from kvsum import cli
    from kvsum.calibrate import default_artifact_path

    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    for method in ("echokv", "lowrank"):
        with pytest.raises(kvsum.KVSumError, match="kvsum calibrate --model") as e:
            kvsum.compress(tiny, ids, method=method, budget=0.5)
        assert str(default_artifact_path(fingerprint(tiny), method)) in str(e.value)
    monkeypatch.setattr(kvsum_models, "load_model", lambda name: (tiny, _Tokenizer()))
    assert cli.main(["calibrate", "--model", "tiny", "--tokens", "800"]) == 0
    path = default_artifact_path(fingerprint(tiny), "all")
    assert path.is_file() and path.is_relative_to(tmp_path)
    saved = Artifact.load(path, tiny)
    q = random_ids(5, 3)
    for method, knobs in (("echokv", {}), ("lowrank", {}), ("lowrank", dict(share_layers=2))):
        found = kvsum.compress(tiny, ids, method=method, budget=0.5, **knobs)
        given = kvsum.compress(tiny, ids, method=method, budget=0.5, artifact=saved, **knobs)
        assert torch.equal(cached_logits(tiny, found, q), cached_logits(tiny, given, q)), method
    # another model of the same shape has another fingerprint: nothing is found for it
    with pytest.raises(kvsum.KVSumError, match="kvsum calibrate --model"):
        kvsum.compress(tiny_llama(seed=1), ids, method="echokv", budget=0.5)


def test_stale_or_mismatched_artifact_at_the_default_path_is_one_clear_error(tiny, tiny_art, ids, tmp_path,
                                                                              monkeypatch):
    from kvsum.calibrate import default_artifact_path

    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    fp = fingerprint(tiny)
    other = dict(fp, weights_sha256="0" * 16)
    Artifact(dict(tiny_art.meta, fingerprint=other), tiny_art.stats, tiny_art.rope).save(
        default_artifact_path(fp, "all"))
    with pytest.raises(kvsum.KVSumError, match="rerun `kvsum calibrate --model") as e:
        kvsum.compress(tiny, ids, method="lowrank", budget=0.5)
    assert "0" * 16 in str(e.value) and fp["weights_sha256"] in str(e.value)
    default_artifact_path(fp, "all").write_bytes(b"not an artifact")
    with pytest.raises(kvsum.KVSumError, match="unreadable or stale.*rerun `kvsum calibrate --model"):
        kvsum.compress(tiny, ids, method="echokv", budget=0.5)
    # an artifact calibrated for one method serves that method only
    calibrate(tiny, ids=random_ids(800, 7), tokens=800, seq_len=400, method="lowrank", progress=False).save(
        default_artifact_path(fp, "lowrank"))
    default_artifact_path(fp, "all").unlink()
    assert kvsum.compress(tiny, ids, method="lowrank", budget=0.5).nbytes() > 0
    with pytest.raises(kvsum.KVSumError, match="kvsum calibrate --model"):
        kvsum.compress(tiny, ids, method="echokv", budget=0.5)
