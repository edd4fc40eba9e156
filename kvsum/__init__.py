"""kvsum: compress the KV cache of Hugging Face transformers models under a byte budget.

Compress a prompt and generate from it::

    cache = kvsum.compress(model, input_ids, method="summary", budget=0.25)
    out = model.generate(input_ids_plus_question, past_key_values=cache)

Public API:
    compress: prefill a prompt and return a compressed `Cache` (one call).
    prefill, compress_prefill: the same in two steps, to compress one prefill under several methods or budgets.
    Cache: the compressed cache (a transformers Cache), with its byte accounting and `stats()`.
    methods, make_method: the registered method names, and a configured method from a name and knobs.
    Method, LayerInput, Plan, register, EntryState, LayerState: to write and register a method.
    TurboQuant, KIVI: the quantizers, as configs (e.g. a summary's `cover=TurboQuant(bits=3.5)`).
    Policy, Decision, generate: pick the method and budget per request from a measured break-even table.
    DecodingEviction: bound the cache while generating.
    Store: a directory of compressed prefixes shared by processes (compress once, load afterwards).
    load_cache: a cache saved with `cache.save(path)`, in any process.
    load_model: the bundled models; KVSumError: every error kvsum raises on bad input.
"""

import importlib
import sys
import types

from ._version import __version__  # noqa: F401 (public)
from .errors import KVSumError

# Each public name and the module that defines it, imported on first use: `import kvsum` (and so `kvsum --help`
# and kvsum.spec) needs no torch.
_API = {"Cache": ".cache", "compress": ".compress", "compress_prefill": ".compress", "DecodingEviction": ".decoding",
        "LayerInput": ".methods", "Method": ".methods", "Plan": ".methods", "make_method": ".methods",
        "register": ".methods", "KIVI": ".methods.quant.kivi", "TurboQuant": ".methods.quant.turboquant",
        "load_model": ".models", "load_cache": ".persist", "Decision": ".compress", "Policy": ".policy",
        "generate": ".policy", "prefill": ".prefill", "Store": ".store", "EntryState": ".state", "LayerState": ".state"}


def methods() -> dict[str, str]:
    """Registered method names and one line on each."""
    from .methods import REGISTRY

    return {name: cls.summary for name, cls in sorted(REGISTRY.items())}


class _Package(types.ModuleType):
    """kvsum itself: the public names are properties, so they win over the same-named submodules
    (kvsum.compress, kvsum.prefill, kvsum.methods) that the import system binds on the package."""


def _public(name: str, module: str | None) -> property:
    def get(self):
        return methods if module is None else getattr(importlib.import_module(module, __name__), name)

    return property(get, lambda self, value: None)  # binding a submodule of that name keeps the API name


for _name, _module in {**_API, "methods": None}.items():
    setattr(_Package, _name, _public(_name, _module))
sys.modules[__name__].__class__ = _Package


__all__ = ["KIVI", "Cache", "Decision", "DecodingEviction", "EntryState", "KVSumError", "LayerInput", "LayerState",
           "Method", "Plan", "Policy", "Store", "TurboQuant", "compress", "compress_prefill", "generate", "load_cache",
           "load_model", "make_method", "methods", "prefill", "register"]
