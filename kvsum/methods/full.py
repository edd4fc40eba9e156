"""The uncompressed reference: the prompt stays in the tail, attention is transformers' own."""

from dataclasses import dataclass

from .base import Method, register


@register
@dataclass
class Full(Method):
    name = "full"
    summary = "no compression: transformers' own cache and attention, bit for bit"
