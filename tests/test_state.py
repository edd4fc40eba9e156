"""kvsum/state.py: what a compressed layer holds."""

import torch

from kvsum.state import EntryState


def test_ragged_state_holds_only_its_entries():
    d = 8
    lengths = [2, 9, 4]
    state = EntryState([torch.zeros(n, d) for n in lengths], [torch.zeros(n, d) for n in lengths])
    assert state.lengths() == lengths
    # 15 entries x (K + V) x 8 dims x fp16, plus one int8 head index per entry
    assert state.nbytes() == 15 * 2 * d * 2 + 15
