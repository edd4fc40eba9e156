"""Retrieval heads: the few KV heads that copy a fact from far back in the context when it is asked for.

Which heads they are is a property of the model, not of a prompt (a few percent of heads, the same across tasks
and formats: the "retrieval head" observation), and a question comes only after compression, so the probe runs
once per model on text of its own: stdlib source (kvsum.stdlib_text, disjoint from kvsum's evaluation text) with
FACTS planted sentences "The number of the <word> is <digits>.", then each one asked by its cue with the digits
teacher-forced. A KV head's score is the attention mass that its query group's answering positions put on the
asked fact's digits (mean over the digits and facts, max over the group): near 1 for a head that copies, near 0
for the rest. Summary keeps whole sentences in the top-scored heads and gives the others what the continuation
reads (its `retrieval_score` knob). One forward of about PROBE_TOKENS tokens per model: memoized per model
object, and saved under kvsum's cache folder by the model's fingerprint (kvsum.shape), so a later process reads it.
"""

from __future__ import annotations

import random
import weakref

import torch
from torch import Tensor

from .attention import Capture, use_kvsum_attention
from .cache import Cache
from .models import cache_dir
from .shape import ModelShape, fingerprint
from .stdlib_text import calibration_text

PROBE_TOKENS, FACTS, SEED = 1024, 8, 0
VERSION = 1  # of the probe: a saved score of another version is measured again
NOUNS = ("harbor", "lantern", "falcon", "orchid", "glacier", "compass", "walnut", "saddle", "thistle", "beacon")
_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Probe(Capture):
    """Per global layer, the (H,) mass each KV head's answering rows put on their fact's digits."""

    def __init__(self, rows: Tensor, targets: list[Tensor]):
        self.rows, self.targets = rows, targets  # answering positions; for each, the positions it should copy
        self.scores: dict[int, Tensor] = {}

    def add(self, layer_idx: int, query: Tensor, key: Tensor, scale: float) -> None:
        _, Hq, _, d = query.shape
        H, T = key.shape[1], key.shape[2]
        q = query[0, :, self.rows.to(query.device)].float()  # (Hq, m, d)
        logits = q @ key[0].float().repeat_interleave(Hq // H, 0).transpose(1, 2) * scale  # (Hq, m, T)
        future = torch.arange(T, device=key.device)[None, :] > self.rows.to(key.device)[:, None]
        p = torch.softmax(logits.masked_fill(future, float("-inf")), -1)
        mass = torch.stack([p[:, i, t.to(p.device)].sum(-1) for i, t in enumerate(self.targets)], 1)  # (Hq, m)
        self.scores[layer_idx] = mass.mean(1).view(H, Hq // H).amax(1).cpu()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def probe_ids(tokenizer, tokens: int = PROBE_TOKENS, facts: int = FACTS, seed: int = SEED
              ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(ids (1, n), the answering rows, each row's target positions): filler with `facts` planted sentences at
    even depths, then every fact asked in a shuffled order, its digits teacher-forced."""
    rng = random.Random(seed)
    filler = _encode(tokenizer, calibration_text(chars=tokens * 6))[:tokens]
    ids, where = [], []
    step = len(filler) // (facts + 1)
    names, numbers = rng.sample(NOUNS, facts), [str(rng.randrange(10_000, 100_000)) for _ in range(facts)]
    for i in range(facts):
        ids += filler[i * step:(i + 1) * step]
        cue = _encode(tokenizer, f"\nThe number of the {names[i]} is")
        ids += cue
        digits = _encode(tokenizer, f" {numbers[i]}")
        where.append(torch.arange(len(ids), len(ids) + len(digits)))
        ids += digits + _encode(tokenizer, ".\n")
    ids += filler[facts * step:]
    rows, targets = [], []
    for i in rng.sample(range(facts), facts):
        ids += _encode(tokenizer, f"\nThe number of the {names[i]} is")
        digits = _encode(tokenizer, f" {numbers[i]}")
        rows += range(len(ids) - 1, len(ids) + len(digits) - 1)  # each predicts the next digit
        targets += [where[i]] * len(digits)
        ids += digits + _encode(tokenizer, ".")
    return torch.tensor([ids]), torch.tensor(rows), targets


@torch.no_grad()
def retrieval_scores(model, tokenizer) -> dict[int, Tensor] | None:
    """Per global layer, (H,) each KV head's retrieval score in [0, 1] (the module docstring); None where the
    model's window cannot hold the probe. Memoized per model object."""
    if model in _memo:
        return _memo[model]
    ids, rows, targets = probe_ids(tokenizer)
    shape = ModelShape.of(model)
    fp = fingerprint(model, strict=False)
    path = None if fp is None else cache_dir() / "retrieval" / (
        f"{fp['model_type']}-{fp['layers']}x{fp['kv_heads']}x{fp['head_dim']}-{fp['weights_sha256']}.v{VERSION}.pt")
    scores = None
    if ids.shape[1] <= shape.max_len:  # else the window cannot hold the probe: no scores
        if path is not None and path.exists():
            scores = torch.load(path)
        else:
            use_kvsum_attention(model)
            with _Probe(rows, targets) as probe:
                model.get_decoder()(ids.to(model.device), cache=Cache(shape.n_layers, shape.windows), use_cache=True)
            scores = probe.scores
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(scores, path)
    _memo[model] = scores
    return scores
