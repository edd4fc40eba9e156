"""The evaluation tests' fixture: the bundled SmolLM2's tokenizer (no model weights loaded)."""

import pytest

import kvsum


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kvsum.models.resolve("smollm2"))
