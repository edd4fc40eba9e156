"""kvsum/breakeven.py: the break-even table, measured and read."""

import math

import kvsum
from kvsum.breakeven import crossing, markdown, measure
from tests.helpers import tiny_llama

LENGTHS = [256, 512, 1024, 2048, 4096]


def test_crossing_interpolates_in_log_length_and_needs_to_stay_below():
    assert crossing(LENGTHS, [1.5, 1.3, 1.1, 0.9, 0.8]) == round(math.exp((math.log(1024) + math.log(2048)) / 2))
    assert crossing(LENGTHS, [0.9, 0.9, 0.9, 0.9, 0.9]) == 256
    assert crossing(LENGTHS, [0.9, 1.2, 0.9, 1.1, 1.2]) is None  # ends above: never
    assert crossing(LENGTHS, [0.9, 1.2, 0.8, 0.9, 0.7]) == crossing(LENGTHS, [2, 1.2, 0.8, 0.9, 0.7])  # dip ignored
    assert crossing(LENGTHS, [None, None, 0.9, 0.8, 0.7]) == 1024  # refused lengths count as above


def test_measure_writes_a_table_the_policy_loads(ids):
    model = tiny_llama()
    t = measure(model, None, methods=["streaming_llm", "kivi"], lengths=[64, 128], new_tokens=4, rounds=1, ids=ids)
    assert t["lengths"] == [64, 128] and t["new_tokens"] == 4
    r = t["methods"]["streaming_llm"]
    assert len(r["ratio"]) == 2 and all(x > 0 for x in r["ratio"]) and len(t["full"]["step_s"]) == 2
    assert t["methods"]["kivi"]["ratio"] == [None, None] and "64" in t["methods"]["kivi"]["refused"]
    assert "| kivi | refused | refused | never |" in markdown(t)
    p = kvsum.Policy(table=t, mid="streaming_llm", long="streaming_llm")
    assert p.choose(100).method in ("full", "streaming_llm")
