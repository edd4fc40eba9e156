"""Reconstruction methods on the bundled model: calibration cost and per-layer reconstruction error on held-out text.

Calibrates echokv and lowrank once (stdlib source, see kvsum.calibrate), then compresses held-out contexts,
evaluation-style prose (the haystack text) and stdlib source the calibration did not read, at each budget,
and reports the relative Frobenius error ||rebuilt - original|| / ||original|| of the keys (post-RoPE, as
attention sees them) and of the values, per layer, plus the time of one decode-step attention read per layer.
Retrieval and LM quality come from the eval harness (kvsum.eval).

    python -m benchmarks run reconstruct                   # full run (minutes)
    python -m benchmarks.reconstruct --layers 1 --tokens 512 --heldout 256 --out /tmp/smoke   # smoke
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvsum
from kvsum.budget import full_nbytes
from kvsum.calibrate import Artifact, calibrate, calibration_text, stdlib_modules
from kvsum.methods import LayerInput, make_method

from .common import info_line, run_info
from .experiments import RESULTS

CONFIGS = [  # (label, method, knobs)
    ("echokv", "echokv", {}),
    ("echokv post-RoPE fit", "echokv", {"_post": True}),
    ("lowrank", "lowrank", {}),
    ("lowrank post", "lowrank", {"space": "post"}),
    ("lowrank share 2", "lowrank", {"share_layers": 2}),
]


def post_only(art: Artifact) -> Artifact:
    """The same calibration without pre-RoPE key moments: echokv then fits keys as cached."""
    stats = {k: v for k, v in art.stats.items() if k != "k_pre"}
    return Artifact(dict(art.meta, key_space="k_post"), stats, None)


def run_config(pre, method: str, knobs: dict, art: Artifact, budget: float, layers: int) -> dict:
    s = pre.shape
    knobs = dict(knobs)
    if knobs.pop("_post", False):
        art = post_only(art)
    m = make_method(method, artifact=art, **knobs)
    share = knobs.get("share_layers", 1)
    layers = min(s.n_layers, layers + (-layers) % share)  # whole layer groups only
    layer_full = full_nbytes(1, s.n_kv_heads, s.head_dim, pre.tokens)
    states, start = [], time.perf_counter()
    for i in range(layers):
        src = pre.cache.layers[i]
        x = LayerInput(src.keys[0].float(), src.values[0].float(), None, None, s.scales[i], i, s.n_layers,
                       budget * layer_full, torch.float16)
        states.append(m.compress(x))
    compress_s = time.perf_counter() - start
    row = dict(budget=budget, layers=len(states), ratio=sum(st.nbytes() for st in states) / (len(states) * layer_full),
               compress_s=round(compress_s, 3), k_err=[], v_err=[], attend_ms=[])
    G = pre.queries[0].shape[0] // s.n_kv_heads if pre.queries else 1
    for i, st in enumerate(states):
        src = pre.cache.layers[i]
        for w, ref in (("k", src.keys[0].float()), ("v", src.values[0].float())):
            row[f"{w}_err"].append(round(((st.rebuilt(w) - ref).norm() / ref.norm()).item(), 4))
        q = torch.randn(1, s.n_kv_heads, G, s.head_dim)
        times = []
        for _ in range(4):  # the first call warms up
            t0 = time.perf_counter()
            st.mix(torch.softmax(st.scores(q, s.scales[i]), -1))
            times.append(time.perf_counter() - t0)
        row["attend_ms"].append(round(1000 * min(times[1:]), 3))
    for key in ("k_err", "v_err", "attend_ms"):
        row[f"{key}_mean"] = round(sum(row[key]) / max(len(row[key]), 1), 4)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    ap.add_argument("--heldout", type=int, default=2048, help="tokens of each held-out context")
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers (smoke runs)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--artifact", default=None, help="reuse this artifact (else calibrate, save under the kvsum cache)")
    ap.add_argument("--out", default=str(RESULTS / "reconstruct" / "reconstruct"), help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)

    from kvsum.eval import text as evtext

    model, tok = kvsum.load_model(args.model)
    if args.artifact:
        art = Artifact.load(args.artifact, model)
        path = Path(args.artifact)
    else:
        art = calibrate(model, tok, tokens=args.tokens, method="all")
        path = art.save(kvsum.models.cache_dir() / f"{args.model}-reconstruct.kvsum")
    calib = dict(art.meta, file_bytes=path.stat().st_size, path=str(path))
    print(f"calibration: {calib['seconds']} s, {calib['nbytes'] / 1e6:.1f} MB, {calib['knobs']}")

    n_modules = len(stdlib_modules())
    code = calibration_text(chars=args.heldout * 6, start=n_modules - 40)
    assert code[:2000] not in calibration_text(chars=args.tokens * 6), "held-out code overlaps the calibration text"
    texts = {
        "prose (eval haystack)": evtext.join(evtext.haystack(tok, args.heldout, seed=0), evtext.sep_ids(tok)),
        "code (held-out stdlib)": tok(code, add_special_tokens=False).input_ids[: args.heldout],
    }
    results = []
    for text, ids in texts.items():
        pre = kvsum.prefill(model, torch.tensor([ids]))
        layers = min(args.layers or pre.shape.n_layers, pre.shape.n_layers)
        for label, method, knobs in CONFIGS:
            for budget in args.budgets:
                row = run_config(pre, method, knobs, art, budget, layers)
                row.update(text=text, label=label, method=method, knobs={k: v for k, v in knobs.items() if k[0] != "_"})
                results.append(row)
                print(f"{text:24} {label:22} budget {budget:.2f}: ratio {row['ratio']:.3f}  "
                      f"K {row['k_err_mean']:.4f}  V {row['v_err_mean']:.4f}  attend {row['attend_ms_mean']:.2f} ms")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(meta=run_info(args.model, torch.get_num_threads()), model=args.model, calibration=calib,
                   heldout_tokens=args.heldout, layers=layers, results=results)
    out.with_name(out.name + ".json").write_text(json.dumps(payload, indent=1))
    lines = [f"# Reconstruction: {args.model}", "", info_line(payload["meta"]), "",
             f"Calibration: {calib['seconds']} s on {calib['knobs']['tokens']} tokens of {calib['knobs']['text']}; "
             f"artifact {calib['nbytes'] / 1e6:.1f} MB of tensors ({calib['file_bytes'] / 1e6:.1f} MB file), "
             f"{calib['n_knobs']} calibration knobs, keys fitted as {calib['key_space']}.",
             "The artifact is a per-model constant: it is not charged to any cache.", "",
             f"Held-out contexts of {args.heldout} tokens, {layers} layers; relative Frobenius error of the rebuilt "
             "keys (post-RoPE) and values, mean and worst layer; attend = one decode-step read of one layer.", "",
             "| text | method | budget | bytes/full | K err | K worst | V err | V worst | attend ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['text']} | {r['label']} | {r['budget']:.2f} | {r['ratio']:.3f} | {r['k_err_mean']:.4f} | "
                     f"{max(r['k_err']):.4f} | {r['v_err_mean']:.4f} | {max(r['v_err']):.4f} | "
                     f"{r['attend_ms_mean']:.2f} |")
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
