"""kvsum/cli.py: the command line; argument errors are one line and exit 2 before any model loads."""

import pytest
import torch

import kvsum
from kvsum import cli
from kvsum.cli import main


def test_methods_lists_every_registered_method(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == sorted(kvsum.methods())


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--method", "nope"], "unknown method 'nope'"),
    (["eval", "--method", ""], "unknown method ''"),
    (["eval", "--method", "full", "--budget", "1.5"], "budget must be a fraction in (0, 1]"),
    (["eval", "--method", "full", "--budget", "0"], "budget must be a fraction in (0, 1]"),
    (["eval", "--method", "full", "--budget", "abc"], "--budget must be comma-separated"),
    (["eval", "--method", "full", "--lengths", "0"], "argument --lengths: must be comma-separated positive integers"),
    (["report", "--short-lengths", "128,x"], "argument --short-lengths: must be comma-separated positive integers"),
    (["demo", "--budget", "2"], "budget must be a fraction in (0, 1]"),
    (["eval", "--method", "full", "--threads", "0"], "kvsum eval: error: argument --threads: must be a positive"),
    (["eval", "--budget", "0.5"], "the following arguments are required: --method"),
])
def test_bad_arguments_print_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_subcommand_exits_2(capsys):
    assert main(["frobnicate"]) == 2


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--text", "/nonexistent/file.txt"], "is not a readable file"),
])
def test_calibrate_bad_text_is_rejected(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--method", "snapkv:nope=1"], "has no knob nope"),
    (["eval", "--method", "summary:cover=turboquant:bits=3"], "written name(knob=value)"),
    (["eval", "--method", "snapkv:window=16,nope"], "unknown method 'nope'"),
    (["demo", "--method", "snapkv,full"], "--method takes one method"),
    (["demo", "--tokens", "0"], "argument --tokens: must be a positive integer, got '0'"),
    (["eval", "--method", "full", "--n", "0"], "argument --n: must be a positive integer"),
    (["eval", "--method", "full", "--threads", "-1"], "argument --threads: must be a positive integer, got '-1'"),
    (["bench", "breakeven", "--new-tokens", "x"], "argument --new-tokens: must be a positive integer"),
])
def test_method_specs_are_checked_before_the_model_loads(capsys, monkeypatch, argv, needle):
    import kvsum.models

    monkeypatch.setattr(kvsum.models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_every_option_has_help_and_shows_its_default():
    from kvsum.cli import parser

    p = parser()
    subs = next(a for a in p._actions if a.dest == "command").choices
    for name, sp in subs.items():
        text = sp.format_help()
        for a in sp._actions:
            if a.dest == "help":
                continue
            assert a.help, f"kvsum {name} {a.option_strings or a.dest} has no help line"
            if a.option_strings and a.default is not None and a.default is not False:
                assert "default" in (sp._get_formatter()._get_help_string(a)), (name, a.option_strings)
        assert "(default: smollm2)" in text or name in ("methods", "store")  # store: no model


def test_outputs_go_under_the_working_directory_by_default():
    from kvsum.cli import parser

    for argv in (["stability"], ["report"], ["bench", "breakeven"]):
        args = parser().parse_args(argv)
        assert args.out.startswith("kvsum-results") and "benchmarks" not in args.out


def test_a_missing_extra_is_one_line(capsys, monkeypatch):
    import kvsum.extras

    monkeypatch.setattr(kvsum.extras, "missing_eval", lambda modules=("rich", "matplotlib"): list(modules))
    for command in ("report", "stability", "demo"):
        assert main([command]) == 2
        err = capsys.readouterr().err
        assert f"kvsum {command} needs the eval extra: pip install 'kvsum[eval]'" in err
        assert len(err.strip().splitlines()) == 1
    with kvsum.extras.progress("no rich", 3) as bar:  # progress degrades to nothing
        bar.advance("step")


def test_eval_writes_into_the_chosen_folder(capsys, monkeypatch, tmp_path):
    import json

    import kvsum.eval.runner
    import kvsum.models
    from tests.helpers import CharTokenizer, tiny_llama

    monkeypatch.setattr(kvsum.models, "load_model", lambda name, **kw: (tiny_llama(), CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        assert main(["eval", "--method", "full,streaming_llm:sinks=4", "--budget", "0.5", "--task", "lm",
                     "--lengths", "300", "--n", "1", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    (folder,) = (tmp_path / "kvsum-results").iterdir()
    assert folder.name.startswith("eval-lm-") and (folder / "eval_lm.json").is_file()
    assert f"wrote kvsum-results/{folder.name}/eval_lm.json" in out and "sinks=4" in out
    assert json.loads((folder / "eval_lm.json").read_text())["meta"]["threads"] == 1  # a result says how it ran


def test_bench_breakeven_writes_a_table_with_its_meta(capsys, monkeypatch, tmp_path):
    import json

    import kvsum.models
    from tests.helpers import CharTokenizer, tiny_llama

    monkeypatch.setattr(kvsum.models, "load_model", lambda name: (tiny_llama(), CharTokenizer()))
    out = tmp_path / "be"
    assert main(["bench", "breakeven", "--methods", "snapkv", "--lengths", "64,128", "--new-tokens", "2",
                 "--rounds", "1", "--threads", "1", "--out", str(out)]) == 0
    table = json.loads(out.with_suffix(".json").read_text())
    assert table["lengths"] == [64, 128] and len(table["methods"]["snapkv"]["ratio"]) == 2
    assert {"date", "command", "kvsum", "torch", "transformers", "threads"} <= set(table["meta"])
    assert table["meta"]["command"].startswith("kvsum bench breakeven") and "break-even" in capsys.readouterr().out


def test_eval_chat_is_for_the_suite_tasks_and_reaches_them(capsys, monkeypatch, tmp_path):
    import json

    import kvsum.models
    from tests.helpers import CharTokenizer, tiny_llama

    class ChatTokenizer(CharTokenizer):
        chat_template = "set"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            got["templated"] = True
            return "<user>" + messages[0]["content"] + "</user><bot>"

    got = {}

    def load(name, **kw):
        got.update(kw)
        return tiny_llama(), ChatTokenizer()

    monkeypatch.setattr(kvsum.models, "load_model", load)
    assert main(["eval", "--method", "full", "--task", "passkey", "--chat", "--lengths", "300", "--n", "1",
                 "--out", str(tmp_path / "p")]) == 2
    assert "chat prompts are for the long-context suite's tasks" in capsys.readouterr().err
    assert main(["eval", "--method", "full", "--task", "niah_single", "--chat", "--dtype", "bf16", "--lengths", "600",
                 "--n", "1", "--out", str(tmp_path / "n")]) == 0
    info = json.loads((tmp_path / "n" / "eval_niah_single_chat.json").read_text())["meta"]
    assert info["chat"] is True and info["dtype"] == "bf16" and got["dtype"] is torch.bfloat16 and got["templated"]


def test_cli_rejects_bad_task(capsys):
    assert cli.main(["report", "--task", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--lengths", "256,x"], ["--new-tokens", "0"], ["--budget", "2"],
                                  ["--methods", "summary,nope"]])
def test_bench_breakeven_bad_arguments_exit_2(argv, capsys):
    from kvsum.cli import main

    assert main(["bench", "breakeven", *argv]) == 2
    err = capsys.readouterr().err  # "kvsum: error: ..." or, from argparse, "kvsum bench breakeven: error: ..."
    assert err.startswith("kvsum") and ": error: " in err and len(err.strip().splitlines()) == 1


def test_cli_rejects_bad_dtype(capsys):
    assert cli.main(["stability", "--dtypes", "fp8"]) == 2
    assert "fp8" in capsys.readouterr().err


def test_store_lists_sizes_and_removes_entries(capsys, tmp_path, tiny, ids):
    store = kvsum.Store(tmp_path)
    store.get_or_compress(tiny, ids, method="snapkv", budget=0.25)
    key = store.key(tiny, ids, "snapkv", 0.25)
    assert main(["store", "ls", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 entry" in out and key in out and "snapkv" in out and "300 tokens" in out
    assert main(["store", "du", "--dir", str(tmp_path)]) == 0
    assert f"{store.du() / 2**20:.2f} MiB in 1 entries" in capsys.readouterr().out
    assert main(["store", "rm", "nope", "--dir", str(tmp_path)]) == 2
    assert "no entry nope" in capsys.readouterr().err
    assert main(["store", "rm", key, "--dir", str(tmp_path)]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and store.ls() == []
    assert main(["store", "rm", "--dir", str(tmp_path)]) == 2
