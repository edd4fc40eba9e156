"""kvsum/shape.py: the model fingerprint."""

import torch

import kvsum
from kvsum.calibrate import fingerprint
from tests.helpers import random_ids, tiny_llama


def test_fingerprint_is_cached_per_model_and_follows_its_weights():
    m = tiny_llama()
    before = fingerprint(m)
    assert fingerprint(m) == before and fingerprint(m) is not fingerprint(m)  # a copy: callers may not edit it
    with torch.no_grad():
        next(p for n, p in m.named_parameters() if n.endswith("k_proj.weight")).add_(1.0)
    assert fingerprint(m)["weights_sha256"] != before["weights_sha256"]
    assert kvsum.prefill(m, random_ids(20, 1)).fingerprint == fingerprint(m)
