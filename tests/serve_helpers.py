"""Shared by the ``metasd serve`` tests: a tiny-model engine whose drafter reads markers in a request's prompt to make
that request fail, run slowly or wait at a gate; a server in a background thread on a free 127.0.0.1 port; a tiny
pool on disk for a ``metasd serve`` subprocess (which imports this module for its drafter type)."""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from metasd.drafters import NGramDrafter, PretrainedDrafter

# prompt tokens "w59", "w58", "w57", "w56" (not "w6x": tiny_tokenizer splits a word that begins with "w6", its unknown
# token)
FAIL, SLOW, GATED, FILE_GATED = 59, 58, 57, 56
SLOW_S = 0.05  # seconds a SLOW request's step sleeps
GATE = threading.Event()  # what a GATED request waits for at each step (set by the test)
#: the environment variable naming the file a FILE_GATED request waits for at each step: the gate of a server in
#: another process, opened by creating the file
GATE_FILE_ENV = "METASD_TEST_GATE_FILE"


class _Markers:
    """Before drafting as its base class does: a request whose prompt holds "w59" fails here, one with "w58"
    sleeps ``SLOW_S`` a step, one with "w57" waits at ``GATE`` (at most 30 s) each step, one with "w56", once it has two
    new tokens, until the file named by ``$METASD_TEST_GATE_FILE`` exists (at most 60 s). Other requests are not
    affected."""

    def propose(self, ctx):
        prompt = set(ctx.tokens[: ctx.prompt_len].tolist())
        if FAIL in prompt:
            raise RuntimeError("the marker drafter failed on purpose")
        if SLOW in prompt:
            time.sleep(SLOW_S)
        if GATED in prompt:
            GATE.wait(30)
        if FILE_GATED in prompt and len(ctx.tokens) - ctx.prompt_len >= 2:  # once its first tokens are streamed
            gate, deadline = Path(os.environ[GATE_FILE_ENV]), time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().propose(ctx)


class MarkerDrafter(_Markers, PretrainedDrafter):
    """A pretrained drafter (here: the verifier's own weights, so every draft is accepted) with the prompt markers."""

    kind = "serve_marker"


class MarkerNGram(_Markers, NGramDrafter):
    """N-gram lookup with the prompt markers (for a pool file: ``type: serve_helpers:MarkerNGram``)."""

    kind = "serve_marker_ngram"


def tiny_engine():
    """The tiny verifier (fp32) and one arm, "twin": a drafter with the verifier's weights (its chains of 3 are
    accepted) and the prompt markers."""
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from tiny import tiny_qwen, tiny_tokenizer

    tok = tiny_tokenizer()
    twin = MarkerDrafter(tiny_qwen(seed=0), tok, k=3, name="twin")
    return Engine(Verifier(tiny_qwen(seed=0), tok, name="tiny"), [twin])


def tiny_chain_engine(tok, name: str, context: int = 256):
    """A tiny fp32 verifier over ``tok`` (a byte-level BPE of tests/test_constraints.py, EOS id 0) and a chain
    drafter of k=4 from a blunter copy of it: drafts that are accepted often, not always."""
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from test_constraints import EOS
    from tiny import tiny_qwen

    drafter = PretrainedDrafter(tiny_qwen(seed=3, vocab=len(tok), logit_scale=2.0, eos=EOS, context=context), k=4,
                                name="chain")
    verifier = Verifier(tiny_qwen(seed=3, vocab=len(tok), logit_scale=3.0, eos=EOS, context=context), tok, name=name)
    return Engine(verifier, drafter, check_tokenizers=False)


class ServerThread:
    """uvicorn serving ``app`` in a daemon thread on a free 127.0.0.1 port (the OS picks it: port 0)."""

    def __init__(self, app, drain_timeout: float = 10.0):
        import uvicorn

        from metasd.serve.server import DrainingServer

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = DrainingServer(config, app.state.serve, app.state.serve.scheduler, drain_timeout,
                                     announce=False)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def write_tiny_pool(root: Path) -> Path:
    """A tiny verifier saved as an HF directory and a pool file over it (n-gram lookup with the prompt markers); the
    pool file's path."""
    from tiny import tiny_qwen, tiny_tokenizer

    tiny_qwen(seed=0).save_pretrained(root / "verifier")
    tiny_tokenizer().save_pretrained(root / "verifier")
    pool = {"verifier": {"model": str(root / "verifier"), "dtype": "fp32"},
            "drafters": [{"name": "ngram", "type": "serve_helpers:MarkerNGram", "params": {"k": 3}}]}
    path = root / "pool.yaml"
    path.write_text(yaml.safe_dump(pool))
    return path


def openai_client(server):
    """The official client against a test server (a running ``ServerThread``): no retries, so a failure shows."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@contextmanager
def serving(engine, model: str, max_batch: int = 4, **app_kwargs):
    """A running ``ServerThread`` over a new ``Scheduler`` on ``engine``, served as ``model``, with the official client
    as its ``client``; the scheduler is closed afterwards."""
    from metasd.core.batching.scheduler import Scheduler
    from metasd.serve.app import create_app

    scheduler = Scheduler(engine, max_batch=max_batch)
    try:
        with ServerThread(create_app(scheduler, model, **app_kwargs)) as srv:
            srv.client = openai_client(srv)
            yield srv
    finally:
        scheduler.close()
