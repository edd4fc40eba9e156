"""Every bad input we could think of, and the error kvsum gives for it.

Each case calls a public function (or the CLI) with one bad argument; kvsum must raise one KVSumError
whose single-line message names the argument and what is accepted (the CLI: one line, exit code 2).
Writes benchmarks/results/robust/bad_input.{json,md} (--out); tests/test_robust.py asserts every case. Tiny random
models only: runs in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import kvsum
from kvsum.attention import use_kvsum_attention
from kvsum.calibrate import Artifact, calibrate
from kvsum.methods import make_method

OUT = Path(__file__).parent / "results" / "robust" / "bad_input"


def llama(layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    use_kvsum_attention(model)
    return model


def gemma():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    use_kvsum_attention(model)
    return model


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2)).eval()


def cases() -> list[tuple[str, Callable[[], object]]]:
    """(what is wrong, a call that must raise KVSumError)."""
    m, g = llama(), gemma()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    pad_ids = torch.ones(2, 9, dtype=torch.long)
    art = calibrate(m, ids=torch.randint(0, 128, (800,), generator=torch.Generator().manual_seed(2)), tokens=800,
                    seq_len=400, progress=False)
    folder = Path(tempfile.gettempdir()) / "kvsum-bad-input"
    folder.mkdir(exist_ok=True)
    art.save(folder / "a.kvsum")
    (folder / "junk.kvsum").write_bytes(b"not an artifact")

    def consumed():
        pre = kvsum.prefill(m, ids)
        kvsum.compress_prefill(pre, "streaming_llm", 0.25, consume=True)
        return kvsum.compress_prefill(pre, "streaming_llm", 0.25)

    def batch_cache_on_bigger_batch():
        cache = kvsum.compress(m, ids, method="streaming_llm")
        with torch.no_grad():
            return m(ids[:, :2].expand(2, -1), past_key_values=cache)

    def crop():
        cache = kvsum.compress(m, ids, method="streaming_llm")
        return cache.crop(-5)

    def stream_on_batch():
        return kvsum.compress(m, ids.expand(2, -1), method="streaming_llm").attach(lambda i: None)

    return [
        # architecture and model
        ("unsupported architecture (GPT-2: no num_key_value_heads)", lambda: kvsum.compress(gpt2(), ids)),
        ("model is not a model", lambda: kvsum.compress("smollm2", ids)),
        ("unknown bundled model", lambda: kvsum.load_model("llama-70b")),
        ("load_model attn", lambda: kvsum.load_model("smollm2", attn="flash_attention_2")),
        ("load_model dtype", lambda: kvsum.load_model("smollm2", dtype=torch.int8)),
        # budget and storage
        ("budget = 0", lambda: kvsum.compress(m, ids, budget=0)),
        ("budget = 1.5", lambda: kvsum.compress(m, ids, budget=1.5)),
        ("budget = -0.25", lambda: kvsum.compress(m, ids, budget=-0.25)),
        ("budget = nan", lambda: kvsum.compress(m, ids, budget=float("nan"))),
        ("budget = '0.5' (a string)", lambda: kvsum.compress(m, ids, budget="0.5")),
        ("budget = True", lambda: kvsum.compress(m, ids, budget=True)),
        ("storage_dtype = int8", lambda: kvsum.compress(m, ids, storage_dtype=torch.int8)),
        ("a budget too small for the method (kivi at 5%)", lambda: kvsum.compress(m, ids, "kivi", 0.05)),
        # methods and knobs
        ("unknown method", lambda: kvsum.compress(m, ids, method="nope")),
        ("unknown knob", lambda: kvsum.compress(m, ids, method="streaming_llm", window=3)),
        ("knob of the wrong type (sinks='4')", lambda: kvsum.compress(m, ids, method="streaming_llm", sinks="4")),
        ("negative knob (sinks=-1)", lambda: kvsum.compress(m, ids, method="streaming_llm", sinks=-1)),
        ("knob outside its choices (allocation='ada')", lambda: make_method("snapkv", allocation="ada")),
        ("register a non-method", lambda: kvsum.register(dict)),
        ("compress_prefill with a non-method", lambda: kvsum.compress_prefill(kvsum.prefill(m, ids), 42, 0.25)),
        # context
        ("budget below a fixed width's bytes (turboquant bits=4 at 0.1): names the smallest that fits",
         lambda: kvsum.compress(m, ids, method="turboquant", bits=4, budget=0.1)),
        ("empty input_ids (1, 0)", lambda: kvsum.compress(m, torch.zeros(1, 0, dtype=torch.long))),
        ("empty batch (0, 5)", lambda: kvsum.compress(m, torch.zeros(0, 5, dtype=torch.long))),
        ("context longer than the model's window", lambda: kvsum.compress(m, torch.zeros(1, 5000, dtype=torch.long))),
        # tensors: type, shape, dtype, values, device
        ("input_ids a list", lambda: kvsum.compress(m, [1, 2, 3])),
        ("input_ids float", lambda: kvsum.compress(m, ids.float())),
        ("input_ids 3-D", lambda: kvsum.compress(m, ids[None])),
        ("token id outside the vocabulary", lambda: kvsum.compress(m, ids + 100)),
        ("input_ids on another device (meta)", lambda: kvsum.compress(m, ids.to("meta"))),
        ("prefill given a batch", lambda: kvsum.prefill(m, ids.expand(2, -1))),
        ("attention_mask float", lambda: kvsum.compress(m, pad_ids, attention_mask=torch.ones(2, 9))),
        ("attention_mask of another shape",
         lambda: kvsum.compress(m, pad_ids, attention_mask=torch.ones(2, 8, dtype=torch.long))),
        ("attention_mask right padded",
         lambda: kvsum.compress(m, pad_ids, attention_mask=torch.tensor([[1] * 9, [1] * 4 + [0] * 5]))),
        ("attention_mask with a row of padding only",
         lambda: kvsum.compress(m, pad_ids, attention_mask=torch.tensor([[1] * 9, [0] * 9]))),
        ("attention_mask values other than 0/1",
         lambda: kvsum.compress(m, pad_ids, attention_mask=torch.full((2, 9), 2))),
        ("attention_mask on another device",
         lambda: kvsum.compress(m, pad_ids, attention_mask=torch.ones(2, 9, dtype=torch.long, device="meta"))),
        ("EntryState with mismatched heads", lambda: kvsum.EntryState([torch.zeros(2, 4)], [])),
        # calibration artifacts
        ("echokv without an artifact", lambda: kvsum.compress(m, ids, method="echokv")),
        ("artifact for another model shape (2 layers, used on 3)",
         lambda: kvsum.compress(llama(layers=3), ids, method="echokv", artifact=art)),
        ("artifact for another model (same shape, other weights)",
         lambda: Artifact.load(folder / "a.kvsum", llama(seed=1))),
        ("artifact file that is not one",
         lambda: kvsum.compress(m, ids, method="lowrank", artifact=folder / "junk.kvsum")),
        ("calibrate on fewer than 2 tokens", lambda: calibrate(g, ids=ids[0], tokens=1, progress=False)),
        # caches
        ("compress_prefill on a consumed prefill", consumed),
        ("compressed cache (1 sequence) fed a batch of 2", batch_cache_on_bigger_batch),
        ("crop into the compressed part", crop),
        ("a stream on a batch cache", stream_on_batch),
    ]


CLI = [
    ["eval", "--method", "full", "--budget", "2"],
    ["eval", "--method", "nope"],
    ["demo", "--budget", "0"],
    ["calibrate", "--model", "smollm2", "--text", "/nonexistent/calibration.txt"],
]


def run_cases() -> list[dict]:
    rows = []
    for what, call in cases():
        try:
            call()
            rows.append(dict(input=what, error="(no error)", ok=False))
        except kvsum.KVSumError as e:
            rows.append(dict(input=what, error=f"KVSumError: {e}", ok="\n" not in str(e)))
        except Exception as e:  # noqa: BLE001 - recorded as a failure of this check
            rows.append(dict(input=what, error=f"{type(e).__name__}: {e}", ok=False))
    return rows


def run_cli(cmd: list[str]) -> dict:
    p = subprocess.run([sys.executable, "-m", "kvsum.cli", *cmd], capture_output=True, text=True, timeout=300)
    # transformers' own weight-loading progress bar may precede the error: not kvsum's output
    lines = [x for x in p.stderr.splitlines() + p.stdout.splitlines() if x.strip() and "Loading weights" not in x]
    return dict(input="kvsum " + " ".join(cmd), error=" | ".join(lines), exit=p.returncode,
                ok=p.returncode == 2 and len(lines) == 1)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from benchmarks.common import info_line, run_info  # this file is also loaded alone, by tests/test_robust.py

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help="output stem (.json and .md)")
    out = Path(ap.parse_args(argv).out)
    torch.set_num_threads(1)
    rows = run_cases() + [run_cli(c) for c in CLI]
    info = run_info(None, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
    md = ["# Bad inputs and the errors kvsum gives", "", info_line(info), "", "Every call raises one "
          "KVSumError with a one-line message (the CLI prints that line and exits with code 2).", "",
          "| input | error | ok |", "|---|---|---|"]
    md += [f"| {r['input']} | {r['error'].replace('|', '/')} | {'yes' if r['ok'] else 'NO'} |" for r in rows]
    out.with_name(out.name + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} inputs give one clear error")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
