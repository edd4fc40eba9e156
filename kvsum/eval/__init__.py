"""kvsum.eval: query-agnostic retrieval and language-model fidelity on real text, sharing each prefill."""

from . import ruler  # registers the long-context suite (niah_*, vt, cwe, fwe) in TASKS
from .report import markdown, write
from .runner import run
from .tasks import DEPTHS, TASKS, Example, LMFidelity, MultiKey, Passkey, Task, get_task

__all__ = ["DEPTHS", "TASKS", "Example", "LMFidelity", "MultiKey", "Passkey", "Task", "get_task", "markdown",
           "ruler", "run", "write"]
