"""``metasd serve`` as a command: refused without the serve extra or with bad options (exit 2, before any model
loads), and a real process on a tiny pool file: its API key from ``METASD_API_KEY``, and SIGTERM draining it - new
requests get 503 while the running one finishes, then the process exits 0."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from metasd.cli import main
from serve_helpers import FILE_GATED, GATE_FILE_ENV, write_tiny_pool

pytest.importorskip("fastapi")

TESTS = Path(__file__).resolve().parent


def test_serve_without_the_extra_exits_2_naming_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert main(["serve", "--pool", "missing.yaml"]) == 2  # refused before the pool is read
    err = capsys.readouterr().err
    assert "pip install 'metasd[serve]'" in err and "missing.yaml" not in err


@pytest.mark.parametrize("args,message", [(["--max-batch", "0"], "--max-batch must be an integer >= 1"),
                                          (["--max-queue", "-1"], "--max-queue must be an integer >= 0"),
                                          (["--max-stored-responses", "-1"],
                                           "--max-stored-responses must be an integer >= 0"),
                                          (["--body-timeout", "0"], "--body-timeout must be a number of seconds > 0"),
                                          (["--replicas", "2"], "--replicas and --ray-address need --ray"),
                                          (["--pool", "missing.yaml"], "missing.yaml")])
def test_bad_options_exit_2_before_any_model_loads(args, message, capsys):
    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_an_address_it_cannot_listen_on_is_named_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import socket

    from metasd.serve.cli import PoolEngine

    def no_load(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(PoolEngine, "__call__", no_load)
    pool = str(write_tiny_pool(tmp_path))
    for host in ("not.a.real.host..", "no-such-host.invalid"):
        assert main(["serve", "--pool", pool, "--host", host, "--port", "0"]) == 2
        assert f"--host {host}:" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--pool", pool, "--port", str(port)]) == 2
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in capsys.readouterr().err


def test_sigterm_drains_a_running_request_refuses_new_ones_and_exits_0(tmp_path):
    pool = write_tiny_pool(tmp_path)
    gate = tmp_path / "gate"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", "METASD_API_KEY": "k3y",
           "PYTHONUNBUFFERED": "1", GATE_FILE_ENV: str(gate)}
    log = tmp_path / "serve.log"
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<s>{% endfor %}")  # (the saved tokenizer encodes only <s> and </s>)
    cmd = [sys.executable, "-m", "metasd.cli", "serve", "--pool", str(pool), "--port", "0", "--model-name", "tiny",
           "--drain-timeout", "60", "--max-stored-responses", "1", "--chat-template", str(template),
           "--trust-request-chat-template", "--reasoning-parser", "qwen3"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = _listening(proc, log)
        key = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from METASD_API_KEY
        assert httpx.get(url + "/health").status_code == 200
        # --chat-template: the file's template (one <s> a message); --trust-request-chat-template: a request's own
        chat = {"messages": [{"role": "user", "content": "w10"}] * 2}
        assert httpx.post(url + "/tokenize", headers=key, json=chat).json()["tokens"] == [0, 0]
        theirs = {**chat, "chat_template": "</s>{{ messages | length }}"}
        assert httpx.post(url + "/tokenize", headers=key, json=theirs).json()["tokens"][0] == 1
        # --max-stored-responses 1: the second response stored gives the first up
        made = [httpx.post(url + "/v1/responses", headers=key, json={"model": "tiny", "input": f"w{10 + i}",
                                                                     "max_output_tokens": 2}).json() for i in range(2)]
        assert [httpx.get(f"{url}/v1/responses/{m['id']}", headers=key).status_code for m in made] == [404, 200]
        # FILE_GATED: each step waits for the gate file, created once the checks below are done: the request is
        # running through all of them however slow the machine
        body = {"model": "tiny", "prompt": [10, FILE_GATED, 11], "max_tokens": 200, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=key, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # running
            proc.send_signal(signal.SIGTERM)
            _until(lambda: httpx.get(url + "/health").status_code == 503, proc, log)
            refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [10]}, headers=key)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            gate.write_text("")  # the running request may go on now
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 200
        assert proc.wait(60) == 0, log.read_text()
        assert "draining" in log.read_text() and "thinking: read (qwen3)" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _until(cond, proc, log, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"metasd serve exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()}"
        time.sleep(0.05)


def _listening(proc, log) -> str:
    found = []

    def ready():
        found[:] = [line.split("listening on ")[1].strip() for line in log.read_text().splitlines()
                    if "listening on " in line]
        return bool(found)

    _until(ready, proc, log, timeout=120)
    return found[0]
