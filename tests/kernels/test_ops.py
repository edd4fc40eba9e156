"""A GPU decoding step is bound by its launches (docs/results/gpu.md): what kvsum's attention adds to a step, in
aten operations and Triton launches per layer, stays near what benchmarks/step_ops.py measured."""

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from benchmarks.step_ops import model_of_shapes, step_counts  # noqa: E402

# spec: (most operations a layer beyond the full cache's, launches a layer); measured 47, 36, 55, 53
CEILING = {"turboquant:bits=3.5@0.3": (52, 1), "kivi:bits=4@0.5": (40, 1), "summary@0.25": (60, 1),
           "summary@0.1": (58, 1)}


def test_a_decoding_step_adds_few_operations(device):
    if device == "cuda":
        pytest.skip("counted on CPU tensors under Triton's interpreter")
    model = model_of_shapes()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 128, (1, 1200), generator=torch.Generator().manual_seed(1))
    full = step_counts(model, ids, "full@1")
    assert full["launches"] == 0
    over = {}
    for spec, (ops, launches) in CEILING.items():
        got = step_counts(model, ids, spec)
        added = (got["ops"] - full["ops"]) / layers
        if added > ops or got["launches"] != launches * layers:
            over[spec] = (added, got["kernels"])
    assert not over, over
