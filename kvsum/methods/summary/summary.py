"""`summary`: entropy-guided anchors, fitted summary entries and a low-rank tier, per KV head.

Per head the byte budget is split by a fixed, explainable rule:
  - anchors (`anchor_share` of the bytes): exact entries; the attention sinks, the recent window and the tokens
    of highest entropy-weighted attention mass (received from sharp reference rows), of highest surprisal
    (score="surprisal"), or whole sentences ranked by surprisal (score="sentence"), a share of them by SnapKV's
    vote (attention_share); scores.py;
  - low-rank tier (`lowrank_share`): the next most important tokens as rank-r coefficients on the head's own
    SVD bases, r as large as the share allows (up to `max_rank`);
  - summaries (the rest): the remaining tokens, in position order, cut into chunks of consecutive tokens, each
    replaced by one entry (key, log-mass bias, value) fitted to reproduce the chunk's attention mass (NNLS) and
    output (ridge least squares) over the reference queries.
With entropy allocation on, diffuse heads and layers (high attention entropy) get more of the budget. With a
cover (`cover`: a quantizer's codes, e.g. TurboQuant(bits=3.5, center=True), or `cover_share` low-rank factors),
every token that is not an anchor stays approximately present instead of being summarized. The code cover leaves
out the attention sinks (always anchors): their keys are unlike every other token's, and coded with them they
skew the codes' channel split and mean key (docs/results/summary.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...budget import full_nbytes
from ...errors import KVSumError
from ...state import ConcatState, EntryState
from ..attention_stats import causal_logits, group_queries, head_diffuseness, window_votes
from ..base import Choice, LayerInput, Method, Plan
from ..quantizer import KeyShiftPlan, Quantizer
from ..refusal import budget_hint, least_budget
from ..registry import register
from . import default, heads, scores
from .cover import EXCLUDED_BYTES, check_cover, make_cover
from .fit import fit_chunk_summaries, floored, spread
from .lowrank import LowRankState
from .scores import SCORES


@dataclass(frozen=True)
class SummaryPlan(KeyShiftPlan):
    """Summary's plan: fractions, the cover's key shifts, each layer's head diffuseness (layer index -> (H,);
    None without entropy allocation) and the cover quantizer the layers use (the lighter one where the
    configured one's fixed costs do not fit)."""

    diffuse: dict | None = None
    cover: Quantizer | None = None
    note: str = ""  # what the plan degraded to fit (for the states' notes)
    retrieval: dict | None = None  # layer index -> (H,) True at the retrieval heads (heads.py); None: all alike


@register
@dataclass(frozen=True)
class Summary(Method):
    """Exact anchors, fitted summary entries and a low-rank tier per KV head, or anchors over a cover.

    Attributes:
        sinks: the first tokens, always anchors.
        window: the newest tokens, anchors first after the sinks.
        recent_exact: in a composition, the newest tokens (of the window) kept exact beside the codes, with the
            sinks: the next tokens read them hardest (kvsum/methods/sinks.py).
        attention_share: share of the anchors taken by SnapKV's vote of the observation window (what the next
            tokens read), interleaved with the score's ranking.
        anchor_share: share of a head's bytes for exact anchors.
        lowrank_share: share of a head's bytes for the low-rank tier.
        max_rank: the low-rank tier's largest rank.
        entropy_allocation: diffuse heads and layers (high attention entropy) get more of the budget.
        refit: fit the summaries' biases and values; off: the chunks' representatives as they are.
        key_mode: a summary's key: "max" (the chunk's most attended key) or "mean" (mass-weighted mean).
        ridge: pull of a summary's value towards its representative's (in units of received attention).
        score: anchor score: "hybrid", "surprisal", "sentence", "repeat", "sharp_mass", "max" or "mass".
        max_refs: reference query rows per KV head used by the fits.
        span: the token score averaged over this many neighbours (facts are spans of tokens).
        cover_share: share of the bytes for a low-rank cover of every non-anchor token (cover.py).
        cover: a quantizer (e.g. TurboQuant(bits=3.5)) coding every non-anchor token instead (takes
            precedence over cover_share); its bits (else its default_bits) are used as given.
        key_share: share of the low-rank cover's rank given to keys (values are less compressible).
        retrieval_score: the KV heads whose retrieval score (kvsum.retrieval) is at least this, and the top one,
            keep the anchors as scored; the others take every anchor by the vote (heads.py; needs
            entropy_allocation=False). 0: all alike.
        retrieval_weight: a retrieval head's bytes over another head's of its layer.
        by_budget: with no other knob set, kvsum.compress configures summary by budget (default.py); False: as here.
    """

    name = "summary"
    summary = "entropy-guided anchors + least-squares summaries + low-rank tier (the flagship)"
    needs_queries = True
    composed_defaults = {"by_budget": False}  # a composition's summary is the one configured, never the rule
    sinks: int = 4
    window: int = 32
    recent_exact: int = 0
    anchor_share: float = 0.8
    lowrank_share: float = 0.0
    max_rank: int = 16
    entropy_allocation: bool = True
    refit: bool = True
    key_mode: str = "max"
    ridge: float = 1.0
    score: str = "hybrid"
    max_refs: int = 384
    span: int = 9
    cover_share: float = 0.0
    cover: Quantizer | None = None
    key_share: float = 0.25
    by_budget: bool = True
    attention_share: float = 0.0
    retrieval_score: float = 0.0
    retrieval_weight: float = 2.0

    def __post_init__(self):
        for knob in ("anchor_share", "lowrank_share", "cover_share", "key_share", "retrieval_score"):
            if not 0 <= getattr(self, knob) <= 1:
                raise KVSumError(f"{knob} must be in [0, 1], got {getattr(self, knob)}")
        if not 0 <= self.attention_share < 1:
            raise KVSumError(f"attention_share must be in [0, 1), got {self.attention_share}")
        if self.retrieval_score and self.entropy_allocation:
            raise KVSumError("retrieval_score sets each head's bytes itself: it needs entropy_allocation=False")
        if not 0 <= self.recent_exact <= self.window:
            raise KVSumError(f"recent_exact must be in [0, window={self.window}], got {self.recent_exact}")
        if self.anchor_share + self.lowrank_share > 1:
            raise KVSumError("anchor_share + lowrank_share must be at most 1")
        if self.score not in SCORES:
            raise KVSumError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.key_mode not in ("max", "mean"):
            raise KVSumError(f"key_mode must be 'max' or 'mean', got {self.key_mode!r}")
        check_cover(self.cover)

    def choices(self, budget: float, tokens: int, sentences: bool, shape=None) -> list[Choice]:
        if self.by_budget and self == Summary():  # no knob of the user's: configured by budget (default.py)
            return default.choices(budget, tokens, sentences, shape)
        return super().choices(budget, tokens, sentences, shape)

    def prefill_options(self) -> dict:
        if self.by_budget and self == Summary():  # what any configuration of the rule needs
            return {"surprisal": True, "sentences": "optional", "retrieval": "optional"}
        return {"surprisal": self.score in ("hybrid", "surprisal", "sentence"), "repeat": self.score == "repeat",
                "sentences": self.score == "sentence", "retrieval": self.retrieval_score > 0}

    def plan(self, inputs: list[LayerInput], budget: float) -> SummaryPlan:
        """Diffuse layers get more bytes (within [0.5, 1.5] x the mean anchors' share, the cover's bytes the same
        for every layer), sharp layers' cover keys bits from diffuse ones. Where some layer's share cannot hold
        the code cover and the sinks, the shares are floored at that (taken from the other layers), or the
        cover's lighter variant is used, in that order; a budget where neither fits is refused here, naming
        the smallest that fits."""
        if not self.entropy_allocation:
            return SummaryPlan(tuple([budget] * len(inputs)), cover=self.cover,
                               retrieval=heads.masks(inputs, self.retrieval_score))
        diffuse = {x.layer_idx: head_diffuseness(x) for x in inputs}
        means = {i: float(v.mean()) for i, v in diffuse.items()}
        shifts = self.cover.key_shifts(means) if self.cover is not None else {}
        if self.cover is None:
            return SummaryPlan(tuple(self._fractions(inputs, budget, means, shifts, None)), shifts, diffuse)
        light = self.cover.lighter(inputs[0].d)
        covers = [self.cover] + ([light] if light is not None else [])
        for cover in covers:
            fractions, note = self._fitted(inputs, budget, means, shifts, cover)
            if fractions is not None:
                note = "; ".join(n for n in (note, self.cover.lighter_note() if cover is light else "") if n)
                return SummaryPlan(tuple(fractions), shifts, diffuse, cover, note)
        least = least_budget(lambda b: any(self._fitted(inputs, b, means, shifts, c)[0] is not None for c in covers),
                             budget)
        if least is None:  # so few tokens that no budget holds the codes: anchors and summaries alone
            return SummaryPlan(tuple(self._fractions(inputs, budget, means, {}, None)), {}, diffuse, None,
                               self._uncovered_note())
        named = f"the smallest budget that fits: {least:.3f}"
        raise KVSumError(f"summary: the cover ({self.cover.name}, bits={self.cover.fixed_bits()}) and the sinks "
                         f"exceed the budget {budget:.4f} in some layer; {named}")

    def _fitted(self, inputs, budget: float, means: dict, shifts: dict, cover) -> tuple[list[float] | None, str]:
        """(the layers' fractions with `cover`, a note where they were floored at the cover and sinks), or
        (None, "") where the budget cannot hold them in every layer."""
        need = [(self._cover(x, shifts.get(x.layer_idx, 0), cover)[1] + self._sink_bytes(x))
                / full_nbytes(1, x.H, x.d, x.T) * (1 + 1e-9) for x in inputs]
        return floored(self._fractions(inputs, budget, means, shifts, cover), need)

    def _fractions(self, inputs, budget: float, means: dict, shifts: dict, cover) -> list[float]:
        x = inputs[0]  # the cover costs every layer the same; only the anchors' bytes are spread
        base = min(budget, self._cover(x, shifts.get(x.layer_idx, 0), cover)[1] / full_nbytes(1, x.H, x.d, x.T))
        return spread(torch.tensor([means[i.layer_idx] for i in inputs]), budget, base)

    def _uncovered_note(self) -> str:
        return f"no cover: {self.cover.name}'s fixed costs exceed the layer's full bytes"

    def _sink_bytes(self, x: LayerInput) -> int:
        """The sinks' bytes beside a code cover (always anchors, each also skipped by the cover)."""
        return min(self.sinks, x.T) * x.H * (2 * x.d * x.storage.itemsize + EXCLUDED_BYTES)

    def _cover_quant(self, x: LayerInput, budget_bytes: float, shift: int, cover) -> Quantizer | None:
        """The code cover's quantizer for layer x: `cover`, or its lighter variant where only that one's bytes
        fit `budget_bytes`."""
        if cover is None or self._cover(x, shift, cover)[1] <= budget_bytes:
            return cover
        light = cover.lighter(x.d)
        if light is not None and self._cover(x, shift, light)[1] <= budget_bytes:
            return light
        return cover

    def compress(self, x: LayerInput, plan: Plan | None = None):
        if x.queries is None:
            raise KVSumError("summary needs reference queries (use kvsum.compress, which captures them)")
        shift = plan.shift(x.layer_idx) if isinstance(plan, KeyShiftPlan) else 0
        planned = plan if isinstance(plan, SummaryPlan) else SummaryPlan((), cover=self.cover)
        quant = self._cover_quant(x, x.budget_bytes, shift, planned.cover)
        uncovered, full = "", full_nbytes(1, x.H, x.d, x.T)
        if quant is not None and self._cover(x, shift, quant)[1] + self._sink_bytes(x) > full:
            quant, uncovered = None, self._uncovered_note()  # so few tokens that no budget holds the codes
        cover, spend = self._cover(x, shift, quant)
        sinks = self._sink_bytes(x) if quant is not None else 0
        if cover is not None and spend + sinks > x.budget_bytes:
            what = f"{quant.name}, bits={quant.fixed_bits()}" if quant else f"cover_share={self.cover_share}"
            raise KVSumError(f"summary: the cover ({what}) and the sinks exceed the budget {x.budget_bytes / full:.3f} "
                             f"of layer {x.layer_idx}; "
                             f"{budget_hint(spend + sinks, full).replace('budget', 'layer budget')}")
        left = int(x.budget_bytes - spend)
        diffuse = planned.diffuse[x.layer_idx] if planned.diffuse is not None and self.entropy_allocation else None
        retrieval = planned.retrieval[x.layer_idx] if planned.retrieval is not None else None
        per_head = heads.head_bytes(left, x.H, diffuse, retrieval, self.retrieval_weight)
        shares = heads.vote_shares(retrieval, x.H, self.attention_share)
        # each only where some head reads it: the score's ranking (the same for every head) and the window's vote
        info = scores.information(x, self.score, self.span) if min(shares) < 1 else None
        votes = window_votes(x) if any(shares) else None
        kept = [self._head(x, h, per_head[h], info, votes, cover is not None, shares[h]) for h in range(x.H)]
        if cover is not None:  # anchors exact, every other token in the cover
            exclude = torch.zeros(x.H, x.T, dtype=torch.bool, device=x.keys.device)
            for h, (a, _, _) in enumerate(kept):
                exclude[h, a[2]] = True
            entries = EntryState([a[0] for a, _, _ in kept], [a[1] for a, _, _ in kept], dtype=x.storage)
            state = ConcatState([entries, cover(exclude)])
            notes = [planned.note, quant.lighter_note() if quant is not planned.cover else ""]
            state.note = "; ".join(dict.fromkeys(n for n in notes if n))
            return state
        biases = [torch.cat([torch.zeros(len(a[0]), device=a[0].device), s[1]]) for a, s, _ in kept] \
            if self.entry_bias else None
        entries = EntryState([torch.cat([a[0], s[0]]) for a, s, _ in kept],
                             [torch.cat([a[1], s[2]]) for a, s, _ in kept], biases, dtype=x.storage)
        lowrank = [lr for _, _, lr in kept]
        state = ConcatState([entries, LowRankState(lowrank, x.storage)]) if any(len(k) for k, _, _ in lowrank) \
            else entries
        note = "; ".join(dict.fromkeys(n for n in (planned.note, uncovered) if n))
        if note:  # what was degraded to fit (cache.stats() reads it)
            state.note = note
        return state

    @property
    def entry_bias(self) -> bool:
        """Fitted summaries carry a log-mass bias; with anchor_share=1 every entry is an exact anchor and none is
        stored (an all-zero fp16 bias costs 2 bytes an entry: at head dim 64, 4% of a 3-bit coded one)."""
        return self.anchor_share < 1

    def _cover(self, x: LayerInput, shift: int = 0, quant: Quantizer | None = None):
        """(a function exclude -> cover state, its bytes), or (None, 0) without a cover (cover.py)."""
        return make_cover(x, quant, shift, self.sinks, self.cover_share, self.key_share)

    def _head(self, x: LayerInput, h: int, budget: int, info=None, votes=None, anchors_only: bool = False,
              vote: float | None = None):
        T, d, elem = x.T, x.d, x.storage.itemsize
        # key + value, and the bias slot summaries need or the index by which a cover skips an anchor
        entry = (2 * d + int(self.entry_bias and not anchors_only)) * elem + (EXCLUDED_BYTES if anchors_only else 0)
        q, pos = group_queries(x, h, self.max_refs)
        vote = self.attention_share if vote is None else vote  # the vote's share of this head's anchors
        # all by the vote (what the continuation reads), else the score's ranking with that share by the vote
        importance = votes[h].clone() if vote >= 1 else scores.importance(x, q, pos, h, info, self.score)
        if 0 < vote < 1:
            importance = scores.interleave(importance, votes[h], vote)
        # bytes -> entries: anchors first, then the low-rank tier, the rest to summaries
        n_anchor = min(T, int(budget * (1.0 if anchors_only else self.anchor_share)) // entry)
        lr_bytes = int(budget * self.lowrank_share)
        forced = torch.cat([torch.arange(min(self.sinks, T)), torch.arange(max(T - self.window, 0), T)]).unique()
        importance[forced.to(importance.device)] = float("inf")
        # with a code cover the sinks must be anchors (the cover does not hold them): first among the forced
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
