"""kvsum.prefill: run a prompt once, keeping its full cache, reference queries and the extras methods ask for.

The result (`Prefill`) is reusable: `kvsum.compress_prefill` compresses it under any method and budget.
Also here: the input checks shared by every entry point, and the per-token signals (surprisal, sentence
ends) some methods read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import QueryCapture, RepeatScorer, use_kvsum_attention
from .cache import Cache, KVSumSlidingLayer
from .errors import KVSumError
from .retrieval import retrieval_scores
from .rope import rope_of
from .shape import ModelShape, fingerprint


@dataclass
class Prefill:
    """The full cache of a prompt plus its captured reference queries; reusable across methods.

    Attributes:
        cache: the full cache of the prompt.
        queries: per global layer, the (Hq, n, d) post-RoPE queries at `query_pos`.
        query_pos: (n,) prompt positions of the reference queries.
        shape: the model's shape.
        tokens: prompt length.
        surprisal: (T,) -log p(token | prefix) in nats, +inf at position 0 (prefill(surprisal=True)).
        sentence_ends: (T,) bool, True at the tokens that end a sentence (prefill(sentences=True)).
        repeat_scores: per layer (H, T), attention received while re-reading (prefill(repeat=True)).
        rope: per-layer RoPE tables (kvsum.rope.rope_of), None if not of the Llama form.
        fingerprint: the model's kvsum.shape.fingerprint (None if it has none), to find per-model artifacts.
        retrieval: per global layer, (H,) each KV head's retrieval score (prefill(retrieval=True); kvsum.retrieval).
    """

    cache: Cache
    queries: dict[int, Tensor]
    query_pos: Tensor
    shape: ModelShape
    tokens: int
    surprisal: Tensor | None = None
    sentence_ends: Tensor | None = None
    repeat_scores: dict[int, Tensor] | None = None
    rope: dict | None = None
    fingerprint: dict | None = None
    retrieval: dict[int, Tensor] | None = None


def reference_positions(T: int, window: int = 64, sample: int = 192) -> Tensor:
    """The observation window (last `window` positions) plus `sample` positions spread over the rest."""
    head = max(T - window, 0)
    spread = torch.linspace(0, head - 1, min(sample, head)).round().long() if head else torch.empty(0, dtype=torch.long)
    return torch.cat([spread, torch.arange(head, T)]).unique()


def check_ids(model, input_ids, batch: bool = False) -> Tensor:
    """input_ids as (B, T) (B = 1 unless `batch`), checked against the model: dtype, shape, length, device,
    vocabulary."""
    want = "(B, T)" if batch else "(1, T)"
    if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise KVSumError(f"input_ids must be an integer torch.Tensor of shape {want}, got "
                         + (f"dtype {input_ids.dtype}" if isinstance(input_ids, Tensor) else type(input_ids).__name__))
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise KVSumError(f"input_ids must have shape {want}, got {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1 and not batch:
        raise KVSumError(f"prefill takes one sequence (batch size 1), got batch size {input_ids.shape[0]}; "
                         "kvsum.compress takes batches")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise KVSumError(f"input_ids is empty (shape {tuple(input_ids.shape)}): nothing to compress")
    limit = ModelShape.of(model).max_len
    if input_ids.shape[1] > limit:
        raise KVSumError(f"context of {input_ids.shape[1]} tokens is longer than the model's window ({limit})")
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise KVSumError(f"input_ids is on {input_ids.device}, the model on {device}; "
                         f"move it with .to({str(device)!r})")
    vocab = model.get_input_embeddings().num_embeddings
    if input_ids.device.type != "meta" and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise KVSumError(f"input_ids must be token ids in [0, {vocab}), got values in "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")
    return input_ids.long()


def check_attention_mask(attention_mask, input_ids: Tensor) -> Tensor:
    """A (B, T) mask of 0/1 like input_ids, left padded (zeros then ones), at least one token per row."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype.is_floating_point or attention_mask.is_complex():
        raise KVSumError("attention_mask must be an integer or bool torch.Tensor of 0/1 shaped like input_ids")
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise KVSumError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.device != input_ids.device:
        raise KVSumError(f"attention_mask is on {attention_mask.device}, input_ids on {input_ids.device}")
    m = attention_mask.long()
    if bool(((m != 0) & (m != 1)).any()):
        raise KVSumError("attention_mask must hold only 0 (padding) and 1 (token)")
    if bool((m[:, 1:] < m[:, :-1]).any()):
        raise KVSumError("attention_mask must be left padded (zeros, then ones); pad on the left "
                         "(tokenizer.padding_side = 'left')")
    if bool((m.sum(1) == 0).any()):
        raise KVSumError("attention_mask has a row of padding only: every sequence needs at least one token")
    return m


def token_surprisal(model, hidden: Tensor, input_ids: Tensor, common: int = 8192, chunk: int = 512,
                    start: int = 0, out: Tensor | None = None) -> Tensor:
    """(T,) surprisal -log p(token | prefix) of every prompt token, from the final hidden states.

    `hidden` may hold only the positions from `start` on (a chunked prefill): their tokens' part of `out`
    (the (T,) result of the earlier chunks) is filled in, with the normalizer of the whole prompt.

    The softmax normalizer runs over a restricted vocabulary: the `common` lowest token ids (BPE ids
    follow merge order, so these are the frequent tokens) plus every token of the prompt. That is much
    cheaper than the full output layer and ranks tokens almost as the exact surprisal does; it can only
    underestimate (docs/results/summary.md has the measured agreement).
    """
    weight = model.get_output_embeddings().weight
    ids = input_ids[0]
    vocab = torch.unique(torch.cat([torch.arange(min(common, weight.shape[0]), device=ids.device), ids]))
    w_vocab = weight[vocab]
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    def soft(z):
        return torch.tanh(z / cap) * cap if cap else z

    if out is None:
        out = torch.full((ids.shape[0],), float("inf"), device=hidden.device)
    end = min(start + hidden.shape[1], ids.shape[0] - 1)
    for a in range(start, end, chunk):
        b = min(a + chunk, end)
        h = hidden[0, a - start:b - start]
        lse = torch.logsumexp(soft((h @ w_vocab.t()).float()), -1)
        out[a + 1:b + 1] = lse - soft((h * weight[ids[a + 1:b + 1]]).sum(-1).float())  # this chunk's next tokens
    return out


SENTENCE_END = ".!?\n"  # characters that end a sentence when a token's text holds one


def sentence_ends(tokenizer, input_ids: Tensor) -> Tensor:
    """(T,) bool: True at the tokens whose text holds one of . ! ? or a newline (they end a sentence).

    The model alone cannot say where sentences end; its tokenizer can, once per distinct token id."""
    ids = input_ids.reshape(-1)
    if not callable(getattr(tokenizer, "batch_decode", None)):
        raise KVSumError("tokenizer must be a transformers tokenizer (with batch_decode), "
                         f"got {type(tokenizer).__name__}")
    uniq, inv = ids.cpu().unique(return_inverse=True)
    texts = tokenizer.batch_decode(uniq[:, None].tolist())
    ends = torch.tensor([any(c in t for c in SENTENCE_END) for t in texts], dtype=torch.bool)
    return ends[inv].to(ids.device)


WHOLE = 8192  # prompts up to this many tokens run in one forward pass (every committed figure was measured so)
CHUNK = 2048  # longer prompts run this many tokens at a time


@torch.no_grad()
def prefill(model, input_ids: Tensor, window: int = 64, sample: int = 192, surprisal: bool = False,
            repeat: bool = False, sentences: bool | str = False, tokenizer=None, chunk: int = CHUNK,
            whole: int = WHOLE, retrieval: bool | str = False) -> Prefill:
    """Run the prompt once through the model, keeping the full cache and the reference queries.

    A prompt of at most `whole` tokens runs in one forward pass; a longer one runs `chunk` tokens at a time
    on top of the cache (transformers' own forward, chunk after chunk), the reference queries and the
    surprisal gathered per chunk, so no attention step is larger than chunk x T per head (the chunked
    result equals the one-pass one up to float rounding).

    With `surprisal`, the final hidden states are also turned into each token's surprisal (one pass of the
    output layer over the prompt), the information signal the summary method uses to pick anchors. Both
    extras cost time, so they run only when asked: `Method.prefill_options()` says what a method needs.
    With `repeat` (the richer, costlier mode), the model then reads the context a second time on top of
    its cache and every context key is scored by the attention it receives while being re-read (what a
    future question that needs it would do); the re-read is cropped off the cache afterwards.
    With `sentences`, the `tokenizer` marks the tokens that end a sentence (methods keep whole sentences);
    sentences="optional" marks them where a tokenizer is given (summary by budget uses them where present).
    With `retrieval`, each KV head's retrieval score, probed once per model with the `tokenizer`
    (kvsum.retrieval); retrieval="optional" where a tokenizer is given.
    """
    input_ids = check_ids(model, input_ids)
    if not (isinstance(chunk, int) and chunk > 0 and isinstance(whole, int) and whole >= 0):
        raise KVSumError(f"chunk must be an integer > 0 and whole one >= 0, got chunk={chunk!r}, whole={whole!r}")
    T = input_ids.shape[1]
    step = T if T <= whole else chunk
    if repeat and step < T:
        raise KVSumError(f"repeat scoring re-reads the prompt in one pass; a prompt of {T} tokens is longer than "
                         f"whole={whole} and is run in chunks: use a method without repeat scoring, or pass a "
                         "larger whole= (its memory grows with the square of the prompt length)")
    if sentences == "optional":  # where the tokenizer can decode single tokens
        sentences = callable(getattr(tokenizer, "batch_decode", None))
    if sentences and tokenizer is None:
        raise KVSumError("this method keeps whole sentences and needs the model's tokenizer to find them: "
                         "pass tokenizer= to kvsum.compress (or kvsum.prefill)")
    ends = sentence_ends(tokenizer, input_ids[0]) if sentences else None
    if retrieval == "optional":  # where the tokenizer can encode the probe's text
        retrieval = callable(tokenizer)
    if retrieval and not callable(tokenizer):
        raise KVSumError("retrieval heads are probed with the model's tokenizer: pass tokenizer= to kvsum.compress "
                         "(or kvsum.prefill)")
    heads = retrieval_scores(model, tokenizer) if retrieval else None
    use_kvsum_attention(model)
    shape = ModelShape.of(model)
    cache = Cache(shape.n_layers, shape.windows)
    pos = reference_positions(T, window, sample)
    info = None
    with QueryCapture(pos) as cap:  # the decoder alone: no logits for the prompt unless asked for
        for a in range(0, T, step):
            hidden = model.get_decoder()(input_ids[:, a:a + step], cache=cache, use_cache=True).last_hidden_state
            if surprisal:
                info = token_surprisal(model, hidden, input_ids, start=a, out=info)
            del hidden
    scores = None
    if repeat:
        sliding = [layer for layer in cache.layers if isinstance(layer, KVSumSlidingLayer)]
        for layer in sliding:  # so that the re-read can be cropped off a full window
            layer.activate_past_recording()
        with RepeatScorer(T) as rs:
            model.get_decoder()(input_ids, cache=cache, use_cache=True)
        cache.crop(-T)
        for layer in sliding:
            layer.record_past = False
        scores = rs.scores
    cache.reference_nbytes, cache.budget_reference_nbytes = shape.reference_nbytes(T)
    cache.model_reference_nbytes = shape.reference_nbytes(T, 8 * cache.layers[0].keys.element_size())[0]
    cache.fingerprint = fingerprint(model, strict=False)
    return Prefill(cache, cap.queries, pos.to(input_ids.device), shape, T, info, ends, scores,
                   rope_of(model, shape.head_dim, shape.n_layers), cache.fingerprint, heads)


def check_prefill(pre) -> Prefill:
    """`pre` if it is a Prefill whose full layers are still there (not consumed by compress_prefill)."""
    if not isinstance(pre, Prefill):
        raise KVSumError(f"pre must be the Prefill that kvsum.prefill returns, got {type(pre).__name__}")
    if any(layer.state is not None or (not layer.is_initialized and layer.offset == 0) for layer in pre.cache.layers):
        raise KVSumError("pre was already consumed by compress_prefill(..., consume=True); run kvsum.prefill again")
    return pre
