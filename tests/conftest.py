"""Shared fixtures: a tiny random Llama (seconds), a calibration artifact of the tiny Llama, and the
bundled SmolLM2 (integration, marked `model`). Helpers that tests call with arguments are in tests/helpers.py."""

import pytest
import torch

# assert_full_is_dynamic_cache, greedy_logits, tiny_llama: re-exported for tests that still import them
# from here; new tests import them from tests.helpers
from tests.helpers import assert_full_is_dynamic_cache, greedy_logits, random_ids, tiny_llama  # noqa: F401


@pytest.fixture(autouse=True, scope="session")
def _probe_scores_in_tmp(tmp_path_factory):
    """The retrieval probe saves its scores under the session's temporary folder, not the user's kvsum cache (the
    tiny random models' scores are of no use there; the bundled models' are measured again once a session)."""
    import kvsum.retrieval

    folder = tmp_path_factory.getbasetemp() / "kvsum-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvsum.retrieval, "cache_dir", lambda: folder)
        yield


@pytest.fixture
def tiny():
    return tiny_llama()


@pytest.fixture
def ids():
    return torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def tiny_art():
    """The calibration artifact (echokv, lowrank) of `tiny_llama()`, the model the `tiny` fixture returns."""
    from kvsum.calibrate import calibrate

    return calibrate(tiny_llama(), ids=random_ids(1600, 7), tokens=1600, seq_len=400, progress=False)


@pytest.fixture(scope="session")
def smollm2():
    import kvsum

    return kvsum.load_model("smollm2")
