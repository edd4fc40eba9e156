"""kvsum: compress the KV cache of Hugging Face transformers models under a byte budget."""

from .cache import Cache
from .compress import compress, compress_prefill, prefill
from .decoding import DecodingEviction
from .errors import KVSumError
from .methods import REGISTRY as _REGISTRY
from .methods import LayerInput, Method, register
from .models import load_model
from .policy import Decision, Policy, generate
from .state import EntryState, LayerState

__version__ = "0.1.0"


def methods() -> dict[str, str]:
    """Registered method names and one line on each."""
    return {name: cls.summary for name, cls in sorted(_REGISTRY.items())}


__all__ = ["Cache", "Decision", "DecodingEviction", "EntryState", "KVSumError", "LayerInput", "LayerState", "Method",
           "Policy", "compress", "compress_prefill", "generate", "load_model", "methods", "prefill", "register"]
