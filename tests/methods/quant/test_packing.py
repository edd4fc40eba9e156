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
