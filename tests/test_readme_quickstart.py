"""The README's server quickstart stays true: its ``metasd serve`` line parses and passes every check made before a
model loads, and its curl command and its openai-client snippet, run as printed (only the address changed), get an
answer from a server of a tiny model under the model id the ``metasd serve`` line gives. Also: the README's install
lines never make PyTorch's index the only one (``--index-url`` alone fails on a machine that reaches only PyPI), and
it keeps the test command ``.ci/run`` runs."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from metasd.cli import build_parser  # noqa: E402
from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from metasd.serve.cli import pool_recipe, served_model_name  # noqa: E402
from serve_helpers import ServerThread, tiny_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ADDRESS = "http://127.0.0.1:8000"


def _section(title: str) -> str:
    start = README.index(f"\n### {title}\n")
    return README[start: README.index("\n#", start + 5)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _quickstart() -> tuple[list[str], str, str]:
    """(the ``metasd serve`` argv, the curl command, the python snippet) of the README's "Serve it"."""
    section = _section("Serve it")
    bash = _blocks(section, "bash")
    serve = next(line.split("#")[0] for b in bash for line in b.splitlines() if line.startswith("metasd serve"))
    curl = next(b for b in bash if b.startswith("curl "))
    (python,) = _blocks(section, "python")
    return shlex.split(serve)[1:], curl, python


def _run_curl(command: str, base_url: str) -> httpx.Response:
    """The curl command as httpx sends it: its URL, ``-H`` headers and ``-d`` body (a POST)."""
    args = shlex.split(command.replace("\\\n", " "))
    assert args[0] == "curl"
    url, headers, body, i = None, {}, None, 1
    while i < len(args):
        if args[i] in ("-H", "--header"):
            name, _, value = args[i + 1].partition(":")
            headers[name.strip()] = value.strip()
            i += 2
        elif args[i] in ("-d", "--data"):
            body, i = args[i + 1], i + 2
        else:
            assert args[i].startswith(ADDRESS), f"an unexpected curl argument: {args[i]}"
            url, i = args[i].replace(ADDRESS, base_url), i + 1
    return httpx.post(url, content=body, headers=headers, timeout=120)


def test_the_readmes_server_quickstart_works_as_printed():
    argv, curl, python = _quickstart()
    args = build_parser(argv).parse_args(argv)
    assert args.command == "serve" and args.port == 8000 and args.host == "127.0.0.1"  # the address the examples use
    config = pool_recipe(args).parse()  # every check before a model loads
    model_id = served_model_name(args, config)
    scheduler = Scheduler(tiny_engine(), max_batch=2)
    getattr(scheduler, "start", lambda: None)()
    try:
        with ServerThread(create_app(scheduler, model_id)) as srv:
            answer = _run_curl(curl, srv.url)
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["model"] == model_id and body["object"] == "chat.completion"
            text = body["choices"][0]["message"]["content"]
            assert text
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(python.replace(ADDRESS, srv.url), "README.md", "exec"), {})
            assert out.getvalue() == text + "\n"  # the same greedy request: the same text
    finally:
        scheduler.close()


def test_the_readme_installs_from_pypi_or_pytorchs_index_and_keeps_the_test_command():
    commands = [line for b in _blocks(README, "bash") for line in b.splitlines() if line.startswith("pip install")]
    assert commands and not [c for c in commands if "--index-url" in c]  # PyTorch's index only: fails on PyPI alone
    assert "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest tests -q -n 2 --dist worksteal" in ci
    assert "pip install -e '.[models,dev,ray,serve]' && python -m pytest tests -q -n 2 --dist worksteal" in README
