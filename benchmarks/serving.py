"""Compress once, serve many: saved caches and the prefix store on the bundled model.

Part `save_load` (one prompt of --length tokens): per configuration, the file's bytes over `cache.nbytes()`,
save and load time (median of --repeats) over a plain forward of the same prompt (the prefill a loaded cache
spares), `fork()` time beside `copy.deepcopy`, and whether the loaded cache generates the same greedy tokens as
the saved one (a question of a few tokens, --new tokens, bit for bit).

Part `store`: --procs processes each call `Store.get_or_compress` --calls times over --prompts prompts of
--store-length tokens in one fresh directory; then one more process is killed between writing an entry's
temporary file and renaming it. Reported: compressions summed over the processes (each prompt exactly once
is the target), hits, every entry loads and equals a fresh compression's bytes, and the killed write left no
entry.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvsum
from kvsum.eval.text import prose_ids
from kvsum.persist import read_header

from .common import REPO, arguments, start, write_page
from .specs import parse_row

CONFIGS = ("full@1", "summary:cover=turboquant(bits=3.5,center=True),score=surprisal@0.25", "turboquant@0.25",
           "kivi:bits=4@0.5", "snapkv@0.25", "summary+turboquant:score=sentence,key_shift=1@0.125")
STORE_METHOD = "turboquant"


def _build(model, tok, ids, text: str):
    name, knobs, budgets = parse_row(text)
    return kvsum.compress(model, ids, method=name, budget=budgets[0], tokenizer=tok, **knobs)


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.no_grad()
def save_load(model, tok, args) -> list[dict]:
    ids = prose_ids(tok, args.length)
    q = tok("\n\nIn short,", return_tensors="pt", add_special_tokens=False).input_ids
    full_ids = torch.cat([ids, q], -1)
    model(ids[:, :256])  # warm-up
    prefill_s, _ = _median(lambda: model(ids), 2)
    rows, folder = [], Path(tempfile.mkdtemp(prefix="kvsum-serving-"))
    path = folder / "c.kvsum"
    for text in args.configs:
        cache = _build(model, tok, ids, text)
        save_s, _ = _median(lambda c=cache: c.save(path), args.repeats)
        load_s, loaded = _median(lambda: kvsum.load_cache(path, model), args.repeats)
        fork_s, _ = _median(cache.fork, args.repeats)
        deep_s, _ = _median(lambda c=cache: copy.deepcopy(c), args.repeats)
        gen = dict(max_new_tokens=args.new, do_sample=False)
        a = model.generate(full_ids, cache=cache.fork(), **gen)[0, full_ids.shape[1]:]
        b = model.generate(full_ids, cache=loaded, **gen)[0, full_ids.shape[1]:]
        size = path.stat().st_size
        rows.append(dict(config=text, tokens=args.length, ratio=round(cache.ratio(), 4), nbytes=cache.nbytes(),
                         file_bytes=size, file_over_nbytes=round(size / cache.nbytes(), 4),
                         prefill_s=round(prefill_s, 3), save_s=round(save_s, 4), load_s=round(load_s, 4),
                         save_load_over_prefill=round((save_s + load_s) / prefill_s, 4), fork_s=round(fork_s, 5),
                         deepcopy_s=round(deep_s, 5), identical=bool(torch.equal(a, b))))
        print(rows[-1], flush=True)
    return rows


CHILD = """
import os, signal, sys, torch, kvsum
from kvsum import persist
from kvsum.eval.text import prose_ids
from kvsum.persist import read_header
directory, mode, calls, n, length, method = sys.argv[1:7]
torch.set_num_threads(1)
model, tok = kvsum.load_model("smollm2")
store = kvsum.Store(directory)
prompts = [prose_ids(tok, int(length), seed=s) for s in range(int(n))]
if mode == "die":
    persist.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    store.get_or_compress(model, prompts[0][:, :-1], method=method, budget=0.25)
for i in range(int(calls)):
    store.get_or_compress(model, prompts[(i * 7 + int(mode)) % len(prompts)], method=method, budget=0.25)
print(store.compressions, store.hits)
"""


def _child(directory: Path, *args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(directory), *map(str, args)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def store(model, tok, args) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="kvsum-store-"))
    t0 = time.perf_counter()
    procs = [_child(directory, i, args.calls, args.prompts, args.store_length, STORE_METHOD) for i in range(args.procs)]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError("a store process failed: " + " | ".join(o[1][-1500:] for o in outs))
    counts = [tuple(map(int, o[0].split())) for o in outs]
    s = kvsum.Store(directory)
    entries = s.ls()
    same, threads = 0, torch.get_num_threads()
    torch.set_num_threads(1)  # as the processes ran: the same prefill, to the bit
    for seed in range(args.prompts):  # every entry loads (checksum, fingerprint) and holds what a fresh run holds
        ids = prose_ids(tok, args.store_length, seed=seed)
        key = s.key(model, ids, STORE_METHOD, 0.25)
        loaded = s.get(key, model)
        fresh = kvsum.compress(model, ids, method=STORE_METHOD, budget=0.25)
        same += loaded is not None and read_header(s.path(key))["sha256"] == read_header(fresh.to_bytes())["sha256"]
    torch.set_num_threads(threads)
    killed = _child(directory, "die", 0, 1, args.store_length, STORE_METHOD)
    killed.communicate()
    left = [p.name for p in directory.glob(".*.tmp")]
    after_kill = len(kvsum.Store(directory).ls())
    return dict(procs=args.procs, calls_each=args.calls, prompts=args.prompts, tokens=args.store_length,
                method=STORE_METHOD, compressions=[c for c, _ in counts], hits=[h for _, h in counts],
                compressions_total=sum(c for c, _ in counts), entries=len(entries),
                entries_equal_to_fresh=same, wall_s=round(wall, 1), killed_exit=killed.returncode,
                killed_left_temporary=len(left), entries_after_kill=after_kill,
                killed_entry_absent=kvsum.Store(directory).get(
                    s.key(model, prose_ids(tok, args.store_length, seed=0)[:, :-1], STORE_METHOD, 0.25), model)
                is None)


def render(rows: list[dict], st: dict | None) -> list[str]:
    out = []
    if rows:
        out += [f"Save and load at {rows[0]['tokens']} tokens (plain prefill {rows[0]['prefill_s']} s):", "",
                "| configuration | bytes / full 16-bit | file / nbytes | save s | load s | (save + load) / prefill "
                "| fork s | deepcopy s | greedy after load identical |", "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| `{r['config']}` | {r['ratio']:.3f} | {r['file_over_nbytes']:.4f} | {r['save_s']:.3f} | "
                f"{r['load_s']:.3f} | {r['save_load_over_prefill']:.4f} | {r['fork_s']:.4f} | {r['deepcopy_s']:.4f} "
                f"| {'yes' if r['identical'] else 'NO'} |" for r in rows]
    if st:
        out += ["", f"Store: {st['procs']} processes x {st['calls_each']} get_or_compress calls on {st['prompts']} "
                f"prompts of {st['tokens']} tokens ({st['method']}, 0.25), {st['wall_s']} s:", "",
                f"- compressions per process {st['compressions']}, total {st['compressions_total']} "
                f"(target: {st['prompts']}); hits {st['hits']}",
                f"- entries {st['entries']}; each loads, and its content (checksum) equals a fresh compression's: "
                f"{st['entries_equal_to_fresh']} / {st['prompts']}",
                f"- a writer killed between its temporary file and the rename (exit {st['killed_exit']}): "
                f"entries after it {st['entries_after_kill']}, its entry absent: {st['killed_entry_absent']}, "
                f"temporary files left {st['killed_left_temporary']} (swept by the next Store.du / put)"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, "perf/serving", threads=2)
    ap.add_argument("--part", choices=["all", "save_load", "store"], default="all")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), help="spec@budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--store-length", type=int, default=512)
    args = ap.parse_args(argv)
    model, tok, t0 = start(args)
    rows = save_load(model, tok, args) if args.part in ("all", "save_load") else []
    st = store(model, tok, args) if args.part in ("all", "store") else None
    write_page(rows, args, t0, "Compress once, serve many: saved caches and the prefix store", render(rows, st),
               store=st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
