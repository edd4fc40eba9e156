"""What `summary` with no knobs stands for: the best configuration measured at each budget, by one rule.

`kvsum.compress(model, ids, method="summary", budget=b)` is the flagship at every budget; the knobs stay for
research (any knob set, or `by_budget=False`, gives summary as configured). The rule, for a budget b (a
fraction of the full 16-bit cache) of a T-token prompt, from the measurements on the bundled models
(docs/results/flagship.md):
  1. b >= COVER_FROM: exact anchors by token surprisal over a 3.5-bit centered TurboQuant cover of every other
     token (at 0.25 little more than the sinks and the recent window are exact): the codes keep every token
     approximately present, where a selection at a quarter of the bytes loses retrieval; where the model's key
     projection has a bias (Qwen2), the cover's keys are coded before RoPE on PCA axes instead (COVER_PRE_ROPE):
     the bias is a constant key before RoPE that turns with the position, so codes after RoPE spend their
     precision on it and the continuation drifts; without a bias the rotated codes read it closer;
  2. below, where 3.5-bit codes of every token no longer fit: summary's selection stored as TurboQuant codes
     (`summary+turboquant`), anchors chosen as whole sentences (a fact is a sentence, not its sharpest token)
     ranked by their peak surprisal for their length (a short fact with one surprising word before a long
     sentence with a rare one: scores.sentences), key bits shifted from diffuse to sharp layers (key_shift=1)
     and keys centered per head before coding (center=True: a code spent on a head's constant key offset is
     lost to what differs, and Qwen's large key biases garble uncentered answers), and every layer and head
     given the same share
     (entropy_allocation=False: a sentence is kept or not in every layer; spread by attention entropy, the sharp
     layers' smaller shares cut the needle's sentence where the diffuse ones keep it, and its value comes out
     garbled or not at all);
     at 3 bits a 64-token recent window, its newest 8 tokens exact beside the codes (LOCAL: the next tokens
     read the newest hardest, and 3-bit codes of them cost the continuation's first tokens most of its error),
     keys one bit wider than values (skew=1: 4 and 2 bits; a logit error moves the attention over every token, a
     value error only its own token's share of the output, which the unbiased values no longer shrink), and the
     sentences kept only in the retrieval heads (RETRIEVAL: the KV heads whose kvsum.retrieval probe score is at
     least 0.14, a threshold and not a share, since a KV head counts where some query head of its group copies
     and larger groups hold more of them: a tenth of SmolLM2's heads, a third of Qwen2.5's; each with twice
     another head's bytes in its layer), every other head's anchors by
     SnapKV's vote of the observation window: a fact asked after compression is copied by those few heads, the
     others read what the continuation reads, so neither pays for the other's tokens; below RETRIEVAL_BELOW
     (from there the vote in every head drops facts the sentences would keep at little cost);
     from there, or without retrieval scores (a tokenizer that cannot encode, a short window), the same row with
     the sentences in every head, 3 anchors in 10 by the vote in place of summary's fitted summaries (a fitted
     summary returns less per byte), 45 in 100 below 0.1 of the bytes (VOTE_LOW: the answers held at 45 in 100
     and fell beyond it), and where the budget holds fewer than TWO_BITS_BELOW tokens' worth of 16-bit bytes a
     head (b x T) 2-bit codes with summary's own 32-token window, none exact (more tokens, each coarser; at 0.03
     of a 2k prompt's bytes, 61 tokens' worth, the 3-bit window took a third of the budget from the sentences);
  3. without sentence ends (no tokenizer given) the same composition on summary's own token scores.
Every code of the rule reads its values unbiased (unbiased="values": Lloyd-Max codes shrink each value by about
their distortion, and an attention output, an average over tokens, keeps the shrink while the codes' noise
partly cancels; the same bytes), and is in the seeded-sign Hadamard rotation where the head dim is a power of 2
(HADAMARD): the dense Haar rotation holds d * d fp16 bytes a layer, a tenth of the bytes at 0.05 of a 2k-token
prompt at head dim 64 and half of them at 0.125 on Gemma's one KV head of dim 256, where the Hadamard rotation
holds d sign bytes; the codes read no worse in it, so those bytes hold more tokens. Each configuration falls
back to the next where it does not fit the prompt (a short prompt, a large head dim: the cover's fixed costs), and
summary's own defaults come last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...spec import Spec
from ..base import Choice
from ..registry import make_method

if TYPE_CHECKING:
    from ...shape import ModelShape

COVER_FROM = 0.25
TWO_BITS_BELOW = 80  # 16-bit tokens' worth a head, between those measured (61: 2 bits better; 102 and 123: 3)
UNBIASED = {"unbiased": "values"}  # every code of the rule: the cover's, the pre-RoPE cover's, the compositions'
COVER = ("summary", {"cover": Spec("turboquant", {"bits": 3.5, "center": True, **UNBIASED}), "score": "surprisal"},
         "anchors by surprisal over a 3.5-bit centered TurboQuant cover")
PRE_ROPE = Spec("turboquant", {"bits": 3.5, "key_basis": "pca", "pre_rope": True, **UNBIASED, "skew": 0})
COVER_PRE_ROPE = ("summary", {"cover": PRE_ROPE, "score": "surprisal"},
                  "anchors by surprisal over a 3.5-bit TurboQuant cover, its keys coded before RoPE on PCA axes (the "
                  "model's key projection has a bias, which turns with the position)")
# both compositions: centered codes, unbiased values, the same share per layer
CODED = {"center": True, **UNBIASED, "entropy_allocation": False}
SENTENCES = ("summary+turboquant", {"score": "sentence", "key_shift": 1, **CODED},
             "summary's selection as centered TurboQuant codes, anchors as whole sentences, the same share per layer")
# the sentence composition at 3 bits: what the next tokens read (the window, SnapKV's vote) beside the sentences
LOCAL = {"summary_window": 64, "summary_recent_exact": 8, "summary_anchor_share": 1.0}
VOTE, VOTE_LOW, VOTE_LOW_BELOW = 0.3, 0.45, 0.1  # the vote's share of the anchors, VOTE_LOW below 0.1 of the bytes


# a retrieval head: a KV head whose probe score is at least this (between those measured: SmolLM2's top 9 of 90,
# Qwen2.5's top 16 of 48, each best on its dev split; the next heads score 0.125 and 0.126, the last taken 0.150 and
# 0.173)
RETRIEVAL = {"summary_retrieval_score": 0.14, "summary_retrieval_weight": 2.0}
RETRIEVAL_BELOW = 0.125  # between those measured: 0.1 (level or better at 2k and 4k) and 0.125 (worse at 4k)


def _local(anchors: dict, why: str) -> tuple[str, dict, str]:
    """The sentence composition at 3 bits (keys 4, values 2) with LOCAL's window, `anchors` placing the vote."""
    return (SENTENCES[0], {**SENTENCES[1], **LOCAL, **anchors, "skew": 1},
            SENTENCES[2] + f", a {LOCAL['summary_window']}-token window, its newest {LOCAL['summary_recent_exact']} "
            f"tokens exact, {why}, keys 4-bit and values 2-bit (skew=1)")


def retrieval_row() -> tuple[str, dict, str]:
    """The 3-bit row with the sentences in the retrieval heads alone, the vote in every other head."""
    score, weight = RETRIEVAL["summary_retrieval_score"], RETRIEVAL["summary_retrieval_weight"]
    return _local(RETRIEVAL, f"the sentences in the KV heads of retrieval score at least {score:g} (each with "
                             f"{weight:g}x another head's bytes), every other head's anchors by the observation "
                             "window's vote")


def local_row(budget: float) -> tuple[str, dict, str]:
    """The 3-bit row with the sentences in every head, the vote's share of the anchors by `budget`."""
    share = VOTE_LOW if budget < VOTE_LOW_BELOW else VOTE
    return _local({"summary_attention_share": share},
                  f"{share:.0%} of the anchors by the observation window's vote instead of fitted summaries")

CODES = ("summary+turboquant", dict(CODED),
         "summary's selection as centered TurboQuant codes, the same share per layer")
PLAIN = ("summary", {"by_budget": False}, "summary's own defaults")
HADAMARD = {"rotation": "hadamard"}  # every code of the rule where the head dim has the matrix (a power of 2)


def hadamard(row: tuple[str, dict, str]) -> tuple[str, dict, str]:
    """`row` with its codes (the cover's, or the composition's) in the seeded-sign Hadamard rotation."""
    name, knobs, why = row
    if "cover" in knobs:
        knobs = {**knobs, "cover": Spec(knobs["cover"].name, {**knobs["cover"].knobs, **HADAMARD})}
    else:
        knobs = {**knobs, **HADAMARD}
    return name, knobs, why + ", in the seeded-sign Hadamard rotation (d bytes a layer, not d * d)"


def rows(budget: float, tokens: int, sentences: bool, shape: ModelShape | None = None) -> list[tuple[str, dict, str]]:
    """(method, knobs, why) in the rule's order at `budget` of a `tokens`-token prompt (`sentences`: the prefill
    marks sentence ends; `shape`: the model's, None where unknown: where its key projection has a bias the cover's
    keys are coded before RoPE, and every code is in the Hadamard rotation where its head dim has the matrix)."""
    key_bias, head_dim = (shape.key_bias, shape.head_dim) if shape is not None else (False, 0)
    top = ([COVER_PRE_ROPE, COVER] if key_bias else [COVER]) if budget >= COVER_FROM else []
    held = budget * tokens  # 16-bit tokens' worth of bytes a head
    two = held < TWO_BITS_BELOW
    codes = [SENTENCES if two else local_row(budget)] if sentences else []
    codes.append(CODES)
    if two:
        why2 = f", 2-bit (the budget holds {held:.0f} < {TWO_BITS_BELOW} tokens' worth of bytes a head)"
        codes = [(name, {**knobs, "bits": 2}, why + why2) for name, knobs, why in codes]
    if sentences and budget < RETRIEVAL_BELOW:  # at 3 bits whatever the budget holds; without scores the next
        codes.insert(0, retrieval_row())
    coded = [*top, *codes]
    light = head_dim > 0 and make_method("turboquant").lighter(head_dim) is not None  # the Hadamard matrix exists
    return [*(map(hadamard, coded) if light else coded), PLAIN]


def choices(budget: float, tokens: int, sentences: bool, shape: ModelShape | None = None) -> list[Choice]:
    """The rule's configurations at `budget` of a `tokens`-token prompt, built, best first (kvsum.compress takes
    the first that fits)."""
    where = f"summary configured by budget ({budget:g} {'>=' if budget >= COVER_FROM else '<'} {COVER_FROM})"
    out = []
    for name, knobs, why in rows(budget, tokens, sentences, shape):
        why += " (no tokenizer to find sentences)" if not sentences and name == CODES[0] else ""
        out.append(Choice(make_method(name, **knobs), name, dict(knobs), f"{where}: {why}"))
    return out
