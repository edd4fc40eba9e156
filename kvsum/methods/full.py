"""The uncompressed reference: the prompt stays in the tail, attention is transformers' own."""

from dataclasses import dataclass

from .base import Method
from .registry import register


@register
@dataclass(frozen=True)
class Full(Method):
    """The full cache: nothing is compressed, transformers' own attention reads it (no knobs)."""

    name = "full"
    summary = "no compression: transformers' own cache and attention, bit for bit"
