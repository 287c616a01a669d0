"""Ctrl-C in ``metasd generate``: what was generated so far is printed (a stream's text stays, the rest follows;
``--no-stream`` prints the partial text, ``--json`` the partial record), then the partial stats line; exit 130 and no
traceback (``main`` returns instead of raising). The interrupt is raised where a real one lands: inside a step (the
drafter), or in the CLI between two pieces of a stream (its ``print``)."""
import json

import pytest
import yaml

import metasd.cli
import metasd.config
from metasd.cli import main
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

PROMPT = "w7 w8 w9 w7 w8"
MAX_NEW = 24


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """A pool of a tiny verifier and an n-gram drafter on disk; ``built`` gets each engine the CLI builds."""
    tok = tiny_tokenizer()
    tiny_qwen(seed=0).save_pretrained(tmp_path / "verifier")
    tok.save_pretrained(tmp_path / "verifier")
    pool = {"verifier": {"model": str(tmp_path / "verifier"), "dtype": "fp32", "device": "cpu"},
            "drafters": [{"name": "ngram", "type": "ngram", "params": {"k": 4, "n_max": 2}}]}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    built = []
    build = metasd.config.build_engine

    def build_with_tiny_tokenizer(*args, **kwargs):  # AutoTokenizer reloads the word-level tokenizer as Qwen2's BPE
        engine = build(*args, **kwargs)
        engine.tokenizer = tok
        built.append(engine)
        return engine

    monkeypatch.setattr(metasd.config, "build_engine", build_with_tiny_tokenizer)
    argv = ["generate", "--pool", str(tmp_path / "pool.yaml"), "--raw", "--max-new-tokens", str(MAX_NEW), "--threads", "1"]
    return argv, built, tok


def _interrupt_the_drafter_at_step(engine, step: int):
    drafter = engine.drafters[0]
    propose, calls = drafter.propose, []

    def interrupted(ctx):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return propose(ctx)

    drafter.propose = interrupted


def _full_greedy(tok) -> list[int]:
    return plain_greedy(tiny_qwen(seed=0), tok.encode(PROMPT), MAX_NEW)


@pytest.mark.parametrize("flags, terminal", [(["--no-stream"], True), (["--json"], False), (["--stream"], False)])
def test_ctrl_c_in_a_step_prints_the_partial_text_and_stats_and_exits_130(cli, monkeypatch, capsys, flags, terminal):
    argv, built, tok = cli
    monkeypatch.setattr(metasd.cli, "_stdout_is_terminal", lambda: terminal)
    build = metasd.config.build_engine

    def build_and_interrupt(*args, **kwargs):
        engine = build(*args, **kwargs)
        _interrupt_the_drafter_at_step(engine, 4)  # three steps commit, the fourth is interrupted while drafting
        return engine

    monkeypatch.setattr(metasd.config, "build_engine", build_and_interrupt)
    assert main([*argv, *flags, PROMPT]) == 130
    out, err = capsys.readouterr()
    full = _full_greedy(tok)
    (stats_line,) = [line for line in err.splitlines() if line.startswith("[metasd] interrupted: ")]
    n = int(stats_line.removeprefix("[metasd] interrupted: ").split(" tokens in ")[0])
    assert 3 <= n < MAX_NEW and ", 3 steps," in stats_line  # the three steps that ran, their tokens
    want = tok.decode(full[:n], skip_special_tokens=True)
    assert want
    if "--json" in flags:
        record = json.loads(out)
        assert record["token_ids"] == full[:n] and record["text"] == want
        assert record["stats"]["stop_reason"] == "interrupted" and record["stats"]["new_tokens"] == n
        assert record["stats"]["steps"] == 3
    else:
        assert out == want + "\n"  # streamed pieces and the rest, or the partial text
    assert "Traceback" not in err
    assert built[-1].generate(PROMPT, max_new_tokens=4).token_ids == full[:4]  # the engine is not left busy


def test_ctrl_c_between_two_pieces_of_a_stream_ends_the_request_and_keeps_the_text(cli, monkeypatch, capsys):
    """The interrupt lands in the CLI itself, while it prints the third piece: the piece shown so far stay, the
    request is ended through the stream (its stats are the steps that ran), and the rest of its text follows."""
    argv, built, tok = cli
    printed, calls = [], []

    def print_until_interrupted(*args, **kwargs):
        if kwargs.get("end") == "":  # a piece of the stream
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
        text = kwargs.get("sep", " ").join(map(str, args)) + kwargs.get("end", "\n")
        (printed if kwargs.get("file") is None else []).append(text)
        print(*args, **kwargs)

    monkeypatch.setattr(metasd.cli, "print", print_until_interrupted, raising=False)
    assert main([*argv, "--stream", PROMPT]) == 130
    out, err = capsys.readouterr()
    full = _full_greedy(tok)
    (stats_line,) = [line for line in err.splitlines() if line.startswith("[metasd] interrupted: ")]
    n = int(stats_line.removeprefix("[metasd] interrupted: ").split(" tokens in ")[0])
    assert 2 <= n < MAX_NEW
    assert out == "".join(printed) == tok.decode(full[:n], skip_special_tokens=True) + "\n"
    assert built[-1].generate(PROMPT, max_new_tokens=4).token_ids == full[:4]  # the engine is not left busy


def test_ctrl_c_while_loading_exits_130_without_a_traceback(cli, monkeypatch, capsys):
    argv, _, _ = cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(metasd.config, "build_engine", interrupted)
    assert main([*argv, "--no-stream", PROMPT]) == 130
    out, err = capsys.readouterr()
    assert out == "" and "[metasd] interrupted" in err
