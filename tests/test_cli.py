import pytest

import kvsum
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
    (["eval", "--method", "full", "--lengths", "0"], "--lengths must be positive"),
    (["demo", "--budget", "2"], "budget must be a fraction in (0, 1]"),
])
def test_bad_arguments_print_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_subcommand_exits_2(capsys):
    assert main(["frobnicate"]) == 2


@pytest.mark.model
def test_context_longer_than_window_is_rejected(capsys, smollm2):
    assert main(["eval", "--method", "full", "--lengths", "100000"]) == 2
    assert "longer than the model's window" in capsys.readouterr().err


@pytest.mark.model
def test_demo_runs_on_the_bundled_model(capsys, smollm2):
    assert main(["demo", "--method", "streaming_llm", "--tokens", "600"]) == 0
    out = capsys.readouterr().out
    assert "bytes held" in out and "pass key" in out


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--text", "/nonexistent/file.txt"], "is not a readable file"),
])
def test_calibrate_bad_text_is_rejected(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
