"""Numerical-stability audit: is the KV cache a neutral store, per precision, and what does compression add?

Two comparisons per precision (fp32, bf16, fp16; the fp32 model converted with `model.to(dtype)`):

1. Precision floor: cache-on (transformers' DynamicCache, one decode step per token) against cache-off (the
   whole sequence recomputed by a full forward at every step, no cache), both greedy from the same prompt.
   Mathematically identical; numerically they use different kernels (matrix-vector vs matrix-matrix,
   different reduction orders), so the difference is pure rounding. Reported: token mismatch rate and first
   divergence position of the two greedy generations; and, teacher-forced on the cache-off tokens (so both
   see the same prefix at every step), the top-1 agreement, KL(off || on), the largest logit difference and
   each layer's relative error of the last position's hidden state, over the decode steps 1..n-1 (step 0 is
   the prompt's own forward, the same computation in both).
2. Compression: each method at one budget against the full kvsum cache of the same precision and the same
   prompt: mismatch rate and first divergence of the greedy generations, and teacher-forced on the
   full-cache tokens, KL(full || method) and top-1 agreement. A method row close to the floor row means the
   method adds nothing beyond rounding; far above it is what compression costs.

Every (precision, prompt, part) result is cached as JSON, so a run cut short by `deadline` resumes; fp16
matrix products are much slower than fp32 on CPU, so fp16 runs dominate the cost.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from .compress import compress_prefill
from .errors import KVSumError
from .extras import progress as progress_bar
from .methods import make_method, prefill_needs
from .prefill import prefill
from .report.specs import Store, label

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Settings:
    model: str = "smollm2"
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp16"])
    prompts: int = 3
    prompt_tokens: int = 512
    new_tokens: int = 32
    budget: float = 0.25
    seed: int = 0
    dtype_prompts: dict[str, int] = field(default_factory=dict)  # fewer prompts for a slow precision (fp16 on CPU)
    onepass: list[str] = field(default_factory=list)  # precisions whose cache-off run is one teacher-forced pass

    def n_prompts(self, dtype: str) -> int:
        return min(self.prompts, self.dtype_prompts.get(dtype, self.prompts))

    def check(self) -> Settings:
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad:
            raise KVSumError(f"--dtypes: unknown {', '.join(bad)}; accepted: {', '.join(DTYPES)}")
        if any(d not in DTYPES or v < 1 for d, v in self.dtype_prompts.items()):
            raise KVSumError(f"--dtype-prompts must map precisions ({', '.join(DTYPES)}) to positive counts, "
                             f"got {self.dtype_prompts}")
        if self.prompts < 1 or self.prompt_tokens < 2 or self.new_tokens < 2:
            raise KVSumError("stability needs --prompts >= 1, --prompt-tokens >= 2 and --new-tokens >= 2")
        return self


def prompt_ids(tokenizer, settings: Settings) -> list[Tensor]:
    """Real prose prompts (the lm task's haystack), one per seed."""
    from .eval.tasks import LMFidelity, example_seed

    task = LMFidelity(continuation=1)
    return [task.example(tokenizer, settings.prompt_tokens, example_seed(settings.seed, i)).context_ids
            for i in range(settings.prompts)]


def _last(out) -> tuple[Tensor, Tensor | None]:
    """Logits (V,) in fp32 and hidden states (L+1, D) in fp32 of the last position."""
    hidden = None if out.hidden_states is None else torch.stack([h[0, -1] for h in out.hidden_states]).float()
    return out.logits[0, -1].float(), hidden


@torch.no_grad()
def cache_off(model, ids: Tensor, n: int) -> tuple[list[int], Tensor, Tensor]:
    """Greedy tokens, logits (n, V) and last-position hidden states (n, L+1, D), recomputing everything each step."""
    seq, toks, logits, hidden = ids, [], [], []
    for _ in range(n):
        lg, h = _last(model(seq, use_cache=False, output_hidden_states=True))
        logits.append(lg)
        hidden.append(h)
        toks.append(int(lg.argmax()))
        seq = torch.cat([seq, seq.new_tensor([[toks[-1]]])], -1)
    return toks, torch.stack(logits), torch.stack(hidden)


@torch.no_grad()
def cache_on(model, ids: Tensor, n: int, forced: list[int] | None = None, hidden: bool = False,
             cache=None) -> tuple[list[int], Tensor, Tensor | None]:
    """Decode with a cache: greedy, or teacher-forced on `forced` (step i feeds forced[i-1]).

    Without `cache` the whole prompt is run first (transformers' own DynamicCache); with one (a kvsum
    Cache of ids[:, :-1]) only the prompt's last token is. Returns tokens, logits (n, V), hidden (n, L+1, D).
    """
    x = ids if cache is None else ids[:, -1:]
    toks, logits, hs = [], [], []
    for i in range(n):
        out = model(x, cache=cache, use_cache=True, output_hidden_states=hidden)
        cache = out.cache
        lg, h = _last(out)
        logits.append(lg)
        hs.append(h)
        toks.append(int(lg.argmax()))
        nxt = forced[i] if forced is not None else toks[-1]
        x = ids.new_tensor([[nxt]])
    return toks, torch.stack(logits), torch.stack(hs) if hidden else None


@torch.no_grad()
def forced_logits(model, ids: Tensor, tokens: list[int], cache) -> Tensor:
    """Logits (n, V) for the prompt's last token then `tokens[:-1]`, in one forward on top of `cache`."""
    x = torch.cat([ids[:, -1:], ids.new_tensor([tokens[:-1]])], -1)
    return model(x, cache=cache, use_cache=True).logits[0].float()


def divergence(a: list[int], b: list[int]) -> dict:
    """first: index of the first differing token (None if none); rate: fraction of positions that differ."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return dict(first=diff[0] if diff else None, rate=len(diff) / len(a))


def kl_top1(ref: Tensor, other: Tensor) -> dict:
    """Mean KL(ref || other) in nats (float64) and top-1 agreement over positions, (n, V) logits each."""
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
    return dict(kl=kl.mean().item(), kl_max=kl.max().item(),
                top1=(ref.argmax(-1) == other.argmax(-1)).double().mean().item())


@torch.no_grad()
def cache_off_onepass(model, ids: Tensor, tokens: list[int]) -> tuple[list[int], Tensor, Tensor]:
    """Cache-off logits and hidden states for every step at once: one forward over the prompt and `tokens[:-1]`.

    Each position still sees only its prefix (causal attention), computed without a cache, in one batched pass
    instead of one per step (which fp16 on CPU cannot afford); the argmax at each position is what cache-off
    greedy decoding would pick after that prefix.
    """
    seq = torch.cat([ids, ids.new_tensor([tokens[:-1]])], -1)
    out = model(seq, use_cache=False, output_hidden_states=True)
    n, T = len(tokens), ids.shape[1]
    logits = out.logits[0, T - 1:T - 1 + n].float()
    hidden = torch.stack([h[0, T - 1:T - 1 + n] for h in out.hidden_states], 1).float()
    return logits.argmax(-1).tolist(), logits, hidden


def precision_floor(model, ids: Tensor, n: int, onepass: bool = False) -> dict:
    """Cache-on against cache-off on one prompt (see the module docstring).

    With `onepass`, cache-off is `cache_off_onepass` on the cache-on generation: the divergence is then the
    teacher-forced one (positions where the cache-off argmax after the same prefix differs), not two free runs.
    """
    if onepass:
        on_toks, f_logits, f_hidden = cache_on(model, ids, n, hidden=True)
        off_toks, off_logits, off_hidden = cache_off_onepass(model, ids, on_toks)
    else:
        off_toks, off_logits, off_hidden = cache_off(model, ids, n)
        on_toks, _, _ = cache_on(model, ids, n)
        _, f_logits, f_hidden = cache_on(model, ids, n, forced=off_toks, hidden=True)
    s = slice(1, n)  # decode steps; step 0 is the prompt's forward in both
    rel = ((f_hidden[s] - off_hidden[s]).norm(dim=-1) / off_hidden[s].norm(dim=-1).clamp_min(1e-30)).mean(0)
    return dict(**{f"div_{k}": v for k, v in divergence(off_toks, on_toks).items()},
                **kl_top1(off_logits[s], f_logits[s]),
                logit_maxdiff=(off_logits[s] - f_logits[s]).abs().max().item(),
                hidden_rel=rel[1:].tolist(),  # per decoder layer (index 0 of hidden_states is the embedding)
                off_tokens=off_toks, on_tokens=on_toks)


def method_vs_full(model, pre, ids: Tensor, n: int, name: str, knobs: dict, budget: float, ref: dict) -> dict:
    """One method against the full kvsum cache's greedy tokens and teacher-forced logits (`ref`)."""
    method = make_method(name, **knobs)
    cache = compress_prefill(pre, method, budget)
    ratio = cache.nbytes() / cache.reference_nbytes
    toks, _, _ = cache_on(model, ids, n, cache=cache)
    logits = forced_logits(model, ids, ref["tokens"], compress_prefill(pre, method, budget))
    return dict(**{f"div_{k}": v for k, v in divergence(ref["tokens"], toks).items()},
                **kl_top1(torch.tensor(ref["logits"]), logits), ratio=ratio, tokens=toks)


def _full_ref(model, pre, ids: Tensor, n: int) -> dict:
    full = make_method("full")
    toks, _, _ = cache_on(model, ids, n, cache=compress_prefill(pre, full, 1.0))
    logits = forced_logits(model, ids, toks, compress_prefill(pre, full, 1.0))
    return dict(tokens=toks, logits=logits.tolist())


def run(settings: Settings, specs: list[tuple[str, dict]], store: Store, load=None, deadline: float | None = None,
        progress: bool = True, threads: int | None = None, prompts: list[Tensor] | None = None) -> dict:
    """Run (or resume) the audit; returns {"settings", "floor", "methods", "complete", ...}.

    `load(dtype)` -> (model, tokenizer) in that dtype (default: kvsum.load_model(settings.model).to(dtype)).
    Units not started before `deadline` (time.time()) are left for the next run: "complete" says whether any are.
    `prompts`: token ids (1, T) to use instead of the prose prompts (tests on tiny models).
    """
    settings.check()
    if load is None:
        def load(dtype):
            from .models import load_model

            model, tok = load_model(settings.model)
            return model.to(DTYPES[dtype]), tok

    base = dict(model=settings.model, prompt_tokens=settings.prompt_tokens, new_tokens=settings.new_tokens,
                seed=settings.seed)
    opts = prefill_needs(make_method(name, **knobs) for name, knobs in specs)
    floor, methods, errors = {}, {}, {}
    complete = True
    units = sum(settings.n_prompts(dt) for dt in settings.dtypes) * (1 + len(specs))
    names = [name for name, _ in specs]
    with progress_bar("stability", units, enabled=progress) as bar:
        for dt in settings.dtypes:
            model = tok = None
            for i in range(settings.n_prompts(dt)):
                pre = ids = ref = None
                todo = [("floor", None, {})] + [("method", name, knobs) for name, knobs in specs]
                for part, name, knobs in todo:
                    shown = name if names.count(name) < 2 else label(name, knobs)  # variants: by spec
                    fields = dict(base, dtype=dt, prompt=i, part=part, method=name, knobs=knobs,
                                  **({"onepass": True} if part == "floor" and dt in settings.onepass else {}),
                                  budget=settings.budget if part == "method" else None)
                    bar.update(f"{dt} prompt {i} {shown or 'cache on/off'}")
                    res = store.get(fields)
                    if res is None:
                        if deadline is not None and time.time() > deadline:
                            complete = False
                            bar.advance()
                            continue
                        if model is None:
                            model, tok = load(dt)
                            if threads:
                                torch.set_num_threads(threads)
                        if ids is None:
                            prompts = prompts or prompt_ids(tok, settings)
                            ids = prompts[i].to(model.device)
                        t0 = time.perf_counter()
                        try:
                            if part == "floor":
                                res = precision_floor(model, ids, settings.new_tokens, dt in settings.onepass)
                            else:
                                if pre is None:
                                    pre = prefill(model, ids[:, :-1], tokenizer=tok, **opts)
                                    ref = _full_ref(model, pre, ids, settings.new_tokens)
                                res = method_vs_full(model, pre, ids, settings.new_tokens, name, knobs,
                                                     settings.budget, ref)
                        except Exception as e:  # a method that fails in one precision is reported, not fatal
                            res = dict(error=f"{type(e).__name__}: {e}")
                            if isinstance(e, KVSumError):  # refused settings: the same next time, so cached
                                store.put(fields, res)
                        else:
                            res["seconds"] = time.perf_counter() - t0
                            store.put(fields, res)
                    if "error" in res:
                        errors.setdefault(dt, {})[shown or "floor"] = res["error"]
                        bar.advance()
                        continue
                    if part == "floor":
                        floor.setdefault(dt, []).append(res)
                    else:
                        methods.setdefault(dt, {}).setdefault(shown, []).append(res)
                    bar.advance()
            del model
    return dict(settings=asdict(settings), floor=floor, methods=methods, errors=errors, complete=complete,
                summary=summarize(floor, methods, settings))


def _agg(recs: list[dict]) -> dict:
    firsts = [r["div_first"] for r in recs if r["div_first"] is not None]
    return dict(n=len(recs), diverged=sum(r["div_first"] is not None for r in recs),
                first=min(firsts) if firsts else None, rate=sum(r["div_rate"] for r in recs) / len(recs),
                kl=sum(r["kl"] for r in recs) / len(recs), top1=100 * sum(r["top1"] for r in recs) / len(recs))


def summarize(floor: dict, methods: dict, settings: Settings) -> dict:
    """Per precision: the floor (cache on vs off, per-layer drift, agreement with fp32) and one row per method."""
    out = {}
    fp32 = floor.get("fp32", [])
    for dt, recs in floor.items():
        row = _agg(recs)
        row["logit_maxdiff"] = max(r["logit_maxdiff"] for r in recs)
        layers = len(recs[0]["hidden_rel"])
        row["hidden_rel"] = [sum(r["hidden_rel"][j] for r in recs) / len(recs) for j in range(layers)]
        if dt != "fp32" and len(fp32) >= len(recs):  # the same prompts in fp32: how far the precision itself moves
            vs = [divergence(a["on_tokens"], b["on_tokens"]) for a, b in zip(fp32, recs)]
            row["vs_fp32_rate"] = sum(v["rate"] for v in vs) / len(vs)
            row["vs_fp32_diverged"] = sum(v["first"] is not None for v in vs)
        out[dt] = dict(floor=row, methods={})
    for dt, per in methods.items():
        out.setdefault(dt, dict(floor=None, methods={}))
        for name, recs in per.items():
            row = _agg(recs)
            row["ratio"] = sum(r["ratio"] for r in recs) / len(recs)
            out[dt]["methods"][name] = row
    return out
