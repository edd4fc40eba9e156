"""kvsum/methods/quant/packing.py: b-bit codes packed into bytes and read back through word tables."""

import math

import pytest
import torch

from kvsum.methods.quant.packing import Packed, pack, packed_nbytes, unpack


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_round_trip(bits):
    n = 3 * 7 * 5  # not a multiple of 8: exercises the padding
    codes = torch.randint(0, 2 ** bits, (3, 7, 5), generator=torch.Generator().manual_seed(bits))
    codes[0, 0, 0] = 2 ** bits - 1
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits) == math.ceil(n / 8) * bits
    assert torch.equal(unpack(packed, bits, n).view(3, 7, 5).long(), codes)
    # decoding through the word tables gives levels[code] for every width (3 bits: 12-bit words)
    levels = tuple(float(v) for v in torch.randn(2 ** bits, generator=torch.Generator().manual_seed(9)))
    assert torch.equal(Packed(codes, bits, levels).lookup(), torch.tensor(levels)[codes])


@pytest.mark.parametrize("bits", (2, 3, 5))
def test_append_repacks_only_the_padded_last_group(bits):
    """Rows of 5 codes (never a whole group of 8) appended one at a time, as pca keys' width groups grow at each
    decoding step: the store equals the whole tensor packed at once, and earlier groups' bytes are not rewritten."""
    g = torch.Generator().manual_seed(bits)
    rows = [torch.randint(0, 2 ** bits, (n, 5), generator=g) for n in (7, 1, 1, 3, 1)]
    levels = tuple(float(v) for v in range(2 ** bits))
    p = Packed(rows[0], bits, levels)
    for r in rows[1:]:
        before = p.data[:(math.prod(p.shape) // 8) * bits].clone()
        p.append(r)
        assert torch.equal(p.data[:before.numel()], before)
    whole = torch.cat(rows)
    assert p.shape == tuple(whole.shape) and torch.equal(p.data, pack(whole, bits))
    assert torch.equal(p.lookup(), torch.tensor(levels)[whole])
