"""kvsum.Store (kvsum/store.py): compress once and load afterwards, across processes, within max_bytes."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvsum
from kvsum.store import Store
from tests.helpers import greedy_logits, random_ids

ROOT = Path(__file__).resolve().parents[1]


def test_the_second_call_loads_what_the_first_compressed(tiny, ids, tmp_path):
    store = Store(tmp_path)
    first = store.get_or_compress(tiny, ids, method="turboquant", budget=0.25)
    again = store.get_or_compress(tiny, ids, method="turboquant", budget=0.25)
    assert (store.compressions, store.hits) == (1, 1)
    q = torch.cat([ids, random_ids(4, 5)], -1)
    a, b = greedy_logits(tiny, q, first, 8), greedy_logits(tiny, q, again, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    [row] = store.ls()
    assert row["tokens"] == ids.shape[1] and row["spec"].startswith("turboquant") and row["bytes"] == store.du()


def test_keys_name_everything_that_determines_the_cache(tiny, ids, tmp_path):
    store = Store(tmp_path)
    key = store.key(tiny, ids, "snapkv", 0.25)
    assert store.key(tiny, ids, "snapkv", 0.25, window=kvsum.make_method("snapkv").window) == key  # a default
    others = {store.key(tiny, ids, "snapkv", 0.5), store.key(tiny, ids, "h2o", 0.25),
              store.key(tiny, ids, "snapkv", 0.25, window=8), store.key(tiny, ids[:, 1:], "snapkv", 0.25),
              store.key(tiny, ids, "snapkv", 0.25, storage_dtype=torch.bfloat16)}
    assert key not in others and len(others) == 5
    with pytest.raises(kvsum.KVSumError, match=r"ids of shape \(1, T\)"):
        store.key(tiny, ids.repeat(2, 1), "snapkv", 0.25)
    with pytest.raises(kvsum.KVSumError, match="max_bytes"):
        Store(tmp_path, max_bytes=-1)


def test_least_recently_used_entries_go_past_max_bytes(tiny, tmp_path):
    store = Store(tmp_path)
    prompts = [random_ids(200, s) for s in range(3)]
    keys = [store.key(tiny, p, "snapkv", 0.25) for p in prompts]
    for p in prompts[:2]:
        store.get_or_compress(tiny, p, method="snapkv", budget=0.25)
    size = store.du() // 2
    old = store.path(keys[0]).stat().st_mtime
    os.utime(store.path(keys[1]), (old - 10, old - 10))  # entry 1 is older ...
    assert store.get(keys[1], tiny) is not None  # ... until this hit refreshes it
    store.max_bytes = 2 * size + size // 2
    store.get_or_compress(tiny, prompts[2], method="snapkv", budget=0.25)
    assert [store.path(k).exists() for k in keys] == [False, True, True]
    assert store.du() <= store.max_bytes


def test_a_damaged_entry_is_replaced_not_loaded(tiny, ids, tmp_path):
    store = Store(tmp_path)
    store.get_or_compress(tiny, ids, method="snapkv", budget=0.25)
    path = store.path(store.key(tiny, ids, "snapkv", 0.25))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(kvsum.KVSumError, match="altered or corrupted"):
        store.get(path.stem, tiny)
    with pytest.warns(UserWarning, match="damaged entry"):
        store.get_or_compress(tiny, ids, method="snapkv", budget=0.25)
    assert store.compressions == 2 and store.get(path.stem, tiny) is not None


CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from kvsum import persist
    from kvsum.store import Store
    from tests.helpers import random_ids, tiny_llama
    store, model = Store(sys.argv[1]), tiny_llama()
    if sys.argv[2] == "die":  # killed between writing the temporary file and renaming it
        persist.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        store.get_or_compress(model, random_ids(300, 0), method="turboquant", budget=0.25)
    calls, prompts = int(sys.argv[3]), [random_ids(300, s) for s in range(int(sys.argv[4]))]
    for i in range(calls):
        store.get_or_compress(model, prompts[(i * 7 + int(sys.argv[2])) % len(prompts)], method="turboquant",
                              budget=0.25)
    print(store.compressions, store.hits)
""")


def _child(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_processes_sharing_a_store_compress_each_prompt_once(tmp_path):
    procs = [_child(tmp_path, i, 50, 10) for i in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    counts = [tuple(map(int, o[0].split())) for o in outs]
    assert sum(c for c, _ in counts) == 10  # every prompt compressed exactly once, by one of the processes
    assert sum(c + h for c, h in counts) == 200
    assert len(Store(tmp_path).ls()) == 10


def test_a_writer_killed_mid_write_leaves_no_entry(tiny, tmp_path):
    p = _child(tmp_path, "die", 0, 1)
    p.communicate(timeout=600)
    assert p.returncode == -9
    assert list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob("*.kvsum"))  # only the temporary file
    store = Store(tmp_path)
    assert store.du() == 0 and not list(tmp_path.glob(".*.tmp"))  # swept: its writer is gone
    store.get_or_compress(tiny, random_ids(300, 0), method="turboquant", budget=0.25)  # the lock was released
    assert store.compressions == 1
