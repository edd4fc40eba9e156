"""The eviction family's fixture: one tiny Llama prefill that every budget test compresses."""

import pytest
import torch

import kvsum
from tests.helpers import tiny_llama


@pytest.fixture(scope="module")
def tiny_prefill():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    return model, ids, kvsum.prefill(model, ids)
