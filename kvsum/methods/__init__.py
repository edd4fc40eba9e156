"""Compression methods, one per module; every module under this package is imported so it registers."""

import importlib
import pkgutil

from .base import Choice, LayerInput, Method, Plan
from .registry import REGISTRY, make_method, prefill_needs, register

for _info in pkgutil.walk_packages(__path__, __name__ + "."):
    importlib.import_module(_info.name)

__all__ = ["REGISTRY", "Choice", "LayerInput", "Method", "Plan", "make_method", "prefill_needs", "register"]
