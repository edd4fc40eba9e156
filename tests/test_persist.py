"""Saved caches (kvsum.persist, Cache.save / kvsum.load_cache) and forks (Cache.fork), on the tiny models.

Every registered method, the compositions and the demo's cover round-trip with the decoding-time state in
flight: a cache that already decoded 20 tokens is saved, and the saved and the loaded one then generate the
same tokens with the same logits, bit for bit. Bad files are one KVSumError each. A fresh process is checked
on the bundled model (tests/integration/test_smollm2.py).
"""

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

import kvsum
from kvsum.methods import REGISTRY
from kvsum.persist import FORMAT, from_bytes, read_header
from kvsum.spec import parse_spec
from tests.helpers import greedy_logits, random_ids, tiny_gemma, tiny_llama

SPECS = sorted(m for m in REGISTRY if m not in ("echokv", "lowrank")) + [
    "summary+turboquant", "snapkv+kivi", "summary:cover=turboquant(bits=3.5,center=True),score=surprisal",
    "turboquant:bits=2.5,key_basis=pca,pre_rope=True,unbiased=values,skew=0"]
Q = random_ids(5, 2)


def compressed(model, ids, spec, **extra):
    s = parse_spec(spec)
    budget = 0.6 if s.name == "kivi" or "cover" in s.knobs else 0.25
    return kvsum.compress(model, ids, method=s.name, budget=budget, **s.knobs, **extra)


def same_generation(model, ids, a, b, steps=30):
    full = torch.cat([ids, Q], -1)
    la, lb = greedy_logits(model, full, a, steps), greedy_logits(model, full, b, steps)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("spec", SPECS)
def test_a_loaded_cache_generates_what_the_saved_one_does(tiny, ids, spec, tmp_path):
    cache = compressed(tiny, ids, spec)
    greedy_logits(tiny, torch.cat([ids, Q], -1), cache, 20)  # streams mid-flight: quantized groups, a tail
    path = cache.save(tmp_path / "c.kvsum")
    loaded = kvsum.load_cache(path, tiny)
    assert loaded.nbytes() == cache.nbytes() and loaded.get_seq_length() == cache.get_seq_length()
    assert [r["entries"] for r in loaded.stats()] == [r["entries"] for r in cache.stats()]
    head = read_header(path)
    assert (head["format"], head["method"], head["tokens"]) == (FORMAT, cache.method, cache.get_seq_length())
    assert head["spec"].startswith(parse_spec(spec).name)
    same_generation(tiny, ids, cache, loaded)


def test_packed_codes_stay_packed_in_the_file(tiny, tmp_path):
    """The file is the bytes held plus a small graph: a 1,200-token cache saves within 2% of its nbytes (the
    shared word tables of the packed codes are the process's, rebuilt on load, not written)."""
    ids = random_ids(1200, 3)
    for spec in ("turboquant", "kivi", "summary+turboquant", "snapkv"):
        cache = compressed(tiny_llama(layers=4, head_dim=64, heads=4, kv_heads=2), ids, spec)
        size = cache.save(tmp_path / "c.kvsum").stat().st_size
        assert size <= 1.02 * cache.nbytes() + 16_000, (spec, size, cache.nbytes())


def test_reconstruction_decoding_eviction_and_sliding_layers_round_trip(tiny, ids, tiny_art, tmp_path):
    for method in ("echokv", "lowrank"):
        cache = kvsum.compress(tiny, ids, method=method, budget=0.5, artifact=tiny_art)
        same_generation(tiny, ids, cache, kvsum.load_cache(cache.save(tmp_path / "r.kvsum"), tiny))
    ev = kvsum.DecodingEviction(tiny, method="snapkv", max_tokens=64, every=8)
    cache = kvsum.compress(tiny, ids, method="full").attach(ev)
    greedy_logits(tiny, torch.cat([ids, Q], -1), cache, 30)  # evicted once at least: observed queries held
    assert ev.compressions() > 0
    same_generation(tiny, ids, cache, kvsum.load_cache(cache.save(tmp_path / "e.kvsum"), tiny), steps=40)
    gemma = tiny_gemma()
    cache = kvsum.compress(gemma, ids, method="turboquant", budget=0.3)
    same_generation(gemma, ids, cache, kvsum.load_cache(cache.save(tmp_path / "g.kvsum"), gemma))


def test_a_fork_answers_as_a_fresh_compression_and_leaves_the_prefix_alone(tiny, ids):
    for spec in ("summary+turboquant", "turboquant", "snapkv", "full"):
        cache = compressed(tiny, ids, spec)
        before = cache.nbytes(), cache.get_seq_length()
        one, two = cache.fork(), cache.fork()
        assert one.layers[0].state is not cache.layers[0].state or cache.layers[0].state is None
        same_generation(tiny, ids, one, compressed(tiny, ids, spec))  # question 1 on a fork
        q2 = random_ids(7, 9)
        a = greedy_logits(tiny, torch.cat([ids, q2], -1), two, 10)  # question 2 on another fork
        b = greedy_logits(tiny, torch.cat([ids, q2], -1), compressed(tiny, ids, spec), 10)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert (cache.nbytes(), cache.get_seq_length()) == before  # the prefix read no question


def test_a_fork_shares_the_compressed_tensors(tiny, ids):
    cache = compressed(tiny, ids, "snapkv")
    fork = cache.fork()
    assert fork.layers[0].state.keys is cache.layers[0].state.keys


def test_bad_files_are_one_clear_error_each(tiny, ids, tmp_path):
    cache = compressed(tiny, ids, "turboquant")
    data = cache.to_bytes()
    with pytest.raises(kvsum.KVSumError, match="altered or corrupted"):
        from_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:], tiny)  # one flipped byte in a tensor
    with pytest.raises(kvsum.KVSumError, match="truncated"):
        from_bytes(data[: len(data) // 2], tiny)
    with pytest.raises(kvsum.KVSumError, match="not a kvsum cache"):
        from_bytes(b"\x00" * 64, tiny)
    for meta in ({"kvsum": "[1, 2]"}, {"graph": "{}"}):  # a foreign safetensors file
        with pytest.raises(kvsum.KVSumError, match="not a kvsum cache"):
            from_bytes(save({"a": torch.zeros(1)}, metadata=meta), tiny)
    with pytest.raises(kvsum.KVSumError, match="another model"):
        from_bytes(data, tiny_llama(seed=1))
    with pytest.raises(kvsum.KVSumError, match="cannot read"):
        kvsum.load_cache(tmp_path / "missing.kvsum", tiny)
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    meta = json.loads(head["__metadata__"]["kvsum"])
    for change, match in (({"format": FORMAT + 1}, "format version"), ({"budget": 0.5}, "altered or corrupted"),
                          ({"fingerprint": {**meta["fingerprint"], "layers": 3}}, "altered or corrupted")):
        head["__metadata__"]["kvsum"] = json.dumps({**meta, **change})
        text = json.dumps(head).encode()
        text += b" " * (-(8 + len(text)) % 8)
        with pytest.raises(kvsum.KVSumError, match=match):
            from_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:], tiny)


def test_the_same_cache_gives_the_same_bytes_and_format_1_still_loads(tiny, ids):
    """Bytes depend on the cache alone (safetensors writes several metadata entries in an order that varies from
    save to save: a store keyed by content would see one cache as two); a file of the format before loads."""
    from kvsum import persist

    cache = compressed(tiny, ids, "summary+turboquant")
    data = cache.to_bytes()
    assert all(cache.to_bytes() == data for _ in range(20))
    header = read_header(data)
    graph = json.dumps(persist._metadata(data)[1], separators=persist.GRAPH_SEPARATORS)  # as format 1 wrote it
    old = {**header, "format": 1}
    old["sha256"] = persist._digest(old, graph, load(data))
    loaded = from_bytes(save(load(data), metadata={"kvsum": json.dumps(old), "graph": graph}), tiny)
    same_generation(tiny, ids, cache, loaded)


def test_only_kvsum_classes_are_rebuilt(tiny, ids):
    """A graph naming a class outside kvsum is refused even when its checksum was recomputed to match."""
    from kvsum import persist

    cache = compressed(tiny, ids, "snapkv")
    enc = persist._Encoder()
    root = enc.node(cache, "cache")
    enc.objects[1]["cls"] = "os:system"
    graph = json.dumps({"root": root, "objects": enc.objects})
    with pytest.raises(kvsum.KVSumError, match="only kvsum's own classes"):
        persist._decode(json.loads(graph), enc.tensors, torch.device("cpu"))


def test_a_cache_that_cannot_be_saved_says_why(tiny, ids):
    with pytest.raises(kvsum.KVSumError, match="does not know its model"):
        kvsum.Cache(2).to_bytes()
    cache = compressed(tiny, ids, "snapkv")
    cache.layers[0].stream = lambda *a: None
    with pytest.raises(kvsum.KVSumError, match=r"cache.layers\[0\].stream holds a builtins.function"):
        cache.to_bytes()
