"""`summary`: entropy-guided anchors, fitted summary entries and a low-rank tier, per KV head.

Per head the byte budget is split by a fixed, explainable rule:
  - anchors (`anchor_share` of the bytes): exact entries; the attention sinks, the recent window and the
    tokens of highest entropy-weighted attention mass (mass received from sharp reference rows), or of highest
    surprisal (score="surprisal"), or whole sentences ranked by surprisal (score="sentence");
  - low-rank tier (`lowrank_share`): the next most important tokens, kept as rank-r coefficients on the
    head's own SVD bases, r as large as the share allows (up to `max_rank`);
  - summaries (the rest): the remaining tokens, in position order, are cut into chunks of consecutive
    tokens, each replaced by one entry (key, log-mass bias, value) fitted so that it reproduces the chunk's
    attention mass (NNLS) and output (ridge least squares) over the reference queries.
With entropy allocation on, diffuse heads and layers (high attention entropy) get more of the budget.
With a cover (`cover_share` low-rank factors, or `cover_bits` TurboQuant codes, keys on a random rotation or,
with cover_basis="pca", on the axes the reference queries read), every token that is not an anchor stays
approximately present instead of being summarized. The code cover leaves out the attention sinks (always anchors):
their keys are unlike every other token's, and coded with them they skew the codes' channel split and mean key
(3.5-bit centered cover at 0.25, 4k-token passkey / multikey: the answer's log-likelihood 0.55 / 0.60 nats below
the full cache's with them coded, 0.40 / 0.43 without; 12 examples each). Centering the cover's keys
(`cover_center`) still pays with the sinks left out at 4k (0.29 / 0.37 nats centered against 0.58 / 0.74, 14
examples), though not at 2k (multikey, 50 examples: 0.29 against 0.25, 47 and 48 right, full 49).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...budget import full_nbytes
from ...errors import KVSumError
from ...state import ConcatState, EntryState
from ..base import LayerInput, Method, register
from ..quant.turboquant import KEY_BASES, ROTATIONS, TurboQuant, key_shifts
from .cover import EXCLUDED_BYTES, CoverState, MaskedState, cover_bytes
from .fit import (
    causal_logits,
    fit_chunk_summaries,
    group_queries,
    head_diffuseness,
    normalized_entropy,
    split_by_weight,
    surprisal_spans,
)
from .lowrank import LowRankState


def _rank(score):
    """Rank of every token by descending score (0 = best)."""
    r = torch.empty_like(score)
    r[torch.argsort(score, descending=True)] = torch.arange(len(score), device=score.device, dtype=score.dtype)
    return r


SCORES = ("hybrid", "surprisal", "sentence", "repeat", "sharp_mass", "max", "mass")
MAX_SENTENCE = 64  # tokens: a longer stretch without a sentence end is cut into pieces of this length


@register
@dataclass
class Summary(Method):
    name = "summary"
    summary = "entropy-guided anchors + least-squares summaries + low-rank tier (the flagship)"
    needs_queries = True
    sinks: int = 4
    window: int = 32
    anchor_share: float = 0.8
    lowrank_share: float = 0.0
    max_rank: int = 16
    entropy_allocation: bool = True
    refit: bool = True  # fit biases and values; off = representatives as they are
    key_mode: str = "max"  # summary key: "max" (most attended real key) or "mean" (mass-weighted mean)
    ridge: float = 1.0
    score: str = "hybrid"  # anchor score: "surprisal", "sentence", or from attention: "sharp_mass", "max", "mass"
    max_refs: int = 384  # reference query rows per KV head used by the fits
    span: int = 9  # average the token score over a span of neighbours: facts are spans of tokens
    cover_share: float = 0.0  # bytes of the low-rank cover of every non-anchor token (cover.py)
    cover_bits: float = 0.0  # > 0: the cover is TurboQuant codes of every token at these bits instead
    cover_basis: str = "random"  # the cover's key basis (TurboQuant's key_basis; "pca" follows the queries)
    cover_center: bool = False  # the cover's keys coded less their mean (TurboQuant's center)
    cover_rotation: str = "qr"  # the cover's rotation (TurboQuant's rotation; "hadamard" holds d bytes a layer)
    cover_unbiased: str = "none"  # the cover's sides read unbiased (TurboQuant's unbiased; "values": lower KL)
    key_share: float = 0.25  # share of the cover's rank given to keys (values are less compressible)

    def __post_init__(self):
        self._shift = {}  # layer index -> key bits moved to its cover (layer_budgets fills it per prompt)
        for knob in ("anchor_share", "lowrank_share", "cover_share", "key_share"):
            if not 0 <= getattr(self, knob) <= 1:
                raise KVSumError(f"{knob} must be in [0, 1], got {getattr(self, knob)}")
        if self.anchor_share + self.lowrank_share > 1:
            raise KVSumError("anchor_share + lowrank_share must be at most 1")
        if self.score not in SCORES:
            raise KVSumError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.cover_basis not in KEY_BASES:
            raise KVSumError(f"cover_basis must be one of {', '.join(KEY_BASES)}, got {self.cover_basis!r}")
        if self.cover_rotation not in ROTATIONS:
            raise KVSumError(f"cover_rotation must be one of {', '.join(ROTATIONS)}, got {self.cover_rotation!r}")
        if self.key_mode not in ("max", "mean"):
            raise KVSumError(f"key_mode must be 'max' or 'mean', got {self.key_mode!r}")
        # the code cover's quantizer, built once: it also decides whether its keys shift bits between layers
        self._cover_quant = (TurboQuant(bits=self.cover_bits, key_basis=self.cover_basis, center=self.cover_center,
                                        rotation=self.cover_rotation, unbiased=self.cover_unbiased)
                            if self.cover_bits else None)

    def prefill_options(self) -> dict:
        return {"surprisal": self.score in ("hybrid", "surprisal", "sentence"), "repeat": self.score == "repeat",
                "sentences": self.score == "sentence"}

    def layer_budgets(self, inputs: list[LayerInput], budget: float) -> list[float]:
        self._shift = {}
        if not self.entropy_allocation:
            self._diffuse = None
            return [budget] * len(inputs)
        self._diffuse = {x.layer_idx: head_diffuseness(x) for x in inputs}
        means = {i: float(v.mean()) for i, v in self._diffuse.items()}
        tq = self._cover_quant
        if tq is not None and tq.shifts_layers():  # sharp layers' cover keys get bits from diffuse ones
            self._shift = key_shifts(means, tq.key_shift)
        weight = torch.tensor([means[x.layer_idx] for x in inputs])
        # spread within [0.5, 1.5] x the mean budget: diffuse layers get more, no layer starves
        w = 0.5 + (weight - weight.min()) / (weight.max() - weight.min()).clamp_min(1e-6)
        x = inputs[0]  # the cover costs every layer the same; only the anchors' bytes are spread
        base = min(budget, self._cover(x, torch.empty(0, dtype=x.storage).element_size())[1]
                   / (2 * x.H * x.T * x.d * 2))
        f = (base + (budget - base) * w / w.mean()).clamp(max=1.0)
        return [float(v) for v in f * (budget * len(inputs) / f.sum()).clamp(max=1.0)]

    def compress(self, x: LayerInput):
        if x.queries is None:
            raise KVSumError("summary needs reference queries (use kvsum.compress, which captures them)")
        elem = torch.empty(0, dtype=x.storage).element_size()
        cover, spend = self._cover(x, elem)
        if spend > x.budget_bytes:
            tq = self._cover_quant
            hint = tq.rotation_hint(x.d, full_nbytes(1, x.H, x.d, x.T), "cover_rotation") if tq is not None else ""
            raise KVSumError(f"summary: the cover (cover_bits={self.cover_bits}) alone exceeds the budget{hint}")
        left = int(x.budget_bytes - spend)
        diffuse = getattr(self, "_diffuse", None) if self.entropy_allocation else None
        if diffuse is not None:  # diffuse heads get more of the layer's bytes
            per_head = split_by_weight(left, 0.5 + diffuse[x.layer_idx], 0, left)
        else:
            per_head = [left // x.H] * x.H
        info = self._information(x)  # the same for every head: computed once per layer
        heads = [self._head(x, h, per_head[h], elem, info, anchors_only=cover is not None) for h in range(x.H)]
        if cover is not None:  # anchors exact, every other token in the cover
            exclude = torch.zeros(x.H, x.T, dtype=torch.bool, device=x.keys.device)
            for h, (a, _, _) in enumerate(heads):
                exclude[h, a[2]] = True
            entries = EntryState([a[0] for a, _, _ in heads], [a[1] for a, _, _ in heads], dtype=x.storage)
            return ConcatState([entries, cover(exclude)])
        entries = EntryState([torch.cat([a[0], s[0]]) for a, s, _ in heads],
                             [torch.cat([a[1], s[2]]) for a, s, _ in heads],
                             [torch.cat([torch.zeros(len(a[0]), device=a[0].device), s[1]]) for a, s, _ in heads],
                             dtype=x.storage)
        lowrank = [lr for _, _, lr in heads]
        if any(len(k) for k, _, _ in lowrank):
            return ConcatState([entries, LowRankState(lowrank, x.storage)])
        return entries

    def _cover(self, x: LayerInput, elem: int):
        """(a function exclude -> cover state, its bytes), or (None, 0) without a cover."""
        if self.cover_bits:
            tq, shift = self._cover_quant, self._shift.get(x.layer_idx, 0)
            q, s = tq.basis_queries(x), min(self.sinks, x.T)  # the sinks are always anchors: not coded
            return (lambda ex: MaskedState(tq.build(x.keys[:, s:], x.values[:, s:], self.cover_bits, x.layer_idx,
                                                    shift, q), ex[:, s:]),
                    tq.shifted_nbytes(x.H, x.T - s, x.d, self.cover_bits, shift))
        if self.cover_share > 0:
            n = x.H * x.d
            budget = int(x.budget_bytes * self.cover_share)
            total = max(0, (budget - 2 * n * elem) // ((n + x.T) * elem))
            rk = min(n, round(total * self.key_share))
            rv = min(n, total - rk)
            return (lambda ex: CoverState(x.keys, x.values, rk, rv, ex, x.rope, x.storage),
                    cover_bytes(x.T, x.H, x.d, rk, rv, elem))
        return None, 0

    def _information(self, x: LayerInput):
        """The head-independent part of the anchor score: surprisal spans ("hybrid", "surprisal") or whole
        sentences ("sentence"); None for the scores read from attention."""
        if self.score in ("hybrid", "surprisal"):
            return self._token_surprisal(x, self.span)
        return self._sentences(x) if self.score == "sentence" else None

    def _importance(self, x: LayerInput, q, pos, h: int, info):
        """Anchor score per token (a new tensor): `info` (surprisal spans or sentences), or a statistic of
        reference attention.

        "hybrid" interleaves two rankings: attention of the observation window (what the next tokens
        read) and surprisal spans (information the model cannot rebuild from context)."""
        if self.score == "hybrid":
            win = pos >= x.T - 64
            p = torch.softmax(causal_logits(q[win], pos[win], x.keys[h], x.scale), -1).mean(0)
            p = torch.nn.functional.avg_pool1d(p[None, None], 5, 1, 2, count_include_pad=False)[0, 0, :x.T]
            return -torch.minimum(_rank(p), _rank(info))  # kept as soon as either ranking wants it
        if info is not None:
            return info.clone()
        if self.score == "repeat":
            if x.key_scores is None:
                raise KVSumError("score='repeat' needs kvsum.prefill(..., repeat=True) (kvsum.compress asks for it)")
            return x.key_scores[h].clone()
        p = torch.softmax(causal_logits(q, pos, x.keys[h], x.scale), -1)
        if self.score == "max":
            return p.max(0).values
        if self.score == "mass":
            return p.sum(0)
        return ((1 - normalized_entropy(p, pos))[:, None] * p).sum(0)

    def _token_surprisal(self, x: LayerInput, span: int = 1):
        """Token surprisal (averaged over `span` neighbours), position 0 ranked with the most surprising."""
        if x.surprisal is None:
            raise KVSumError(f"score={self.score!r} needs the prefill's token surprisal (kvsum.prefill computes it)")
        return surprisal_spans(x.surprisal, span)

    def _sentences(self, x: LayerInput):
        """Whole sentences ranked by their surprisal: a sentence is kept as soon as its mean (information per
        token kept) or its peak (one token the model could not guess) ranks it, like "hybrid".

        A fact's digits carry less surprisal than the prose around them; scored alone they rank below the
        cut and the fact survives without its value. A fact stated in a template seen before has a low mean
        but still a surprising word. Sentences end at tokens holding . ! ? or a newline."""
        if x.sentence_ends is None:
            raise KVSumError("score='sentence' needs sentence ends: kvsum.compress(..., tokenizer=tokenizer)")
        s = self._token_surprisal(x)
        ends = x.sentence_ends.to(s.device)
        pos = torch.arange(x.T, device=s.device)
        start = torch.cat([pos.new_zeros(1), pos[:-1][ends[:-1]] + 1])  # first token of every sentence
        sent = torch.bucketize(pos, start, right=True) - 1
        piece = sent * x.T + (pos - start[sent]) // MAX_SENTENCE  # long sentences cut into pieces
        seg = torch.unique_consecutive(piece, return_inverse=True)[1]
        n = int(seg[-1]) + 1
        mean = s.new_zeros(n).index_add(0, seg, s) / s.new_zeros(n).index_add(0, seg, torch.ones_like(s))
        peak = s.new_full((n,), -float("inf")).scatter_reduce(0, seg, s, "amax")
        return -torch.minimum(_rank(mean), _rank(peak))[seg]

    def _head(self, x: LayerInput, h: int, budget: int, elem: int, info=None, anchors_only: bool = False):
        T, d = x.T, x.d
        # key + value, and the bias slot summaries need or the index by which a cover skips an anchor
        entry = (2 * d + int(not anchors_only)) * elem + (EXCLUDED_BYTES if anchors_only else 0)
        q, pos = group_queries(x, h, self.max_refs)
        importance = self._importance(x, q, pos, h, info)
        # bytes -> entries: anchors first, then the low-rank tier, the rest to summaries
        n_anchor = min(T, int(budget * (1.0 if anchors_only else self.anchor_share)) // entry)
        lr_bytes = int(budget * self.lowrank_share)
        forced = torch.cat([torch.arange(min(self.sinks, T)), torch.arange(max(T - self.window, 0), T)]).unique()
        importance[forced.to(importance.device)] = float("inf")
        # with a code cover the sinks must be anchors (the cover does not hold them): first among the forced.
        # (Putting the window's newest tokens next, where the anchors do not reach the whole window, did not help:
        # answer log-likelihood gap to full 0.20 -> 0.22 / 0.49 -> 0.50 nats, passkey / multikey, 20 at 2k.)
        order = torch.argsort(importance, descending=True, stable=anchors_only)
        n_anchor = max(n_anchor, min(self.sinks, T) if anchors_only else 0)
        anchor_idx = order[:n_anchor].sort().values
        if anchors_only:
            return (x.keys[h, anchor_idx], x.values[h, anchor_idx], anchor_idx), None, None
        rest = order[n_anchor:]
        # low-rank tier: the next most important tokens, rank as large as the share allows
        rank, n_lr = 0, 0
        if lr_bytes > 0 and len(rest):
            for r in range(min(self.max_rank, d), 0, -1):
                m = (lr_bytes // (2 * elem) - d - d * r) // r
                if m > 0:
                    rank, n_lr = r, min(int(m), len(rest))
                    break
        lr_idx = rest[:n_lr].sort().values
        drop = rest[n_lr:].sort().values
        spent = n_anchor * entry + (LowRankState.bytes_for(n_lr, rank, d, elem) if n_lr else 0)
        n_sum = max(0, min(len(drop), (budget - spent) // entry))
        keys, values = x.keys[h], x.values[h]
        if n_sum == 0 or len(drop) == 0:
            empty = keys[:0]
            summ = (empty, empty[:, 0], empty)
        else:
            chunk = (torch.arange(len(drop), device=keys.device) * n_sum // len(drop))
            logits = causal_logits(q, pos, keys[drop], x.scale, key_pos=drop)
            summ = fit_chunk_summaries(logits, q, x.scale, keys[drop], values[drop], chunk, n_sum,
                                       self.key_mode, self.ridge, self.refit)
        return (keys[anchor_idx], values[anchor_idx]), summ, (keys[lr_idx], values[lr_idx], rank)
