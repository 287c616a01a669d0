"""Shared by the ``metasd serve`` tests: a tiny-model engine, a drafter whose prompt markers make a request fail, run
slowly or wait at a gate, a server in a background thread on a free 127.0.0.1 port, and a tiny pool on disk for a
``metasd serve`` subprocess (which imports this module for the drafter: ``type: serve_helpers:MarkerDrafter``)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from metasd.core.drafter import Drafter
from metasd.core.tree import Draft

FAIL, SLOW, GATED = 63, 62, 61  # prompt tokens "w63", "w62", "w61"
GATE = threading.Event()  # what a GATED request waits for at each step (set by the test)


class MarkerDrafter(Drafter):
    """Drafts nothing; a request whose prompt holds "w63" fails inside it, one with "w62" sleeps ``slow_s`` per step,
    one with "w61" waits at ``GATE`` (at most 30 s) each step. Other requests are not affected."""

    kind = "serve_marker"

    def __init__(self, slow_s: float = 0.05, name: str | None = None):
        super().__init__(name or "marker")
        self.slow_s = slow_s

    def propose(self, ctx):
        prompt = set(ctx.tokens[: ctx.prompt_len].tolist())
        if FAIL in prompt:
            raise RuntimeError("the marker drafter failed on purpose")
        if SLOW in prompt:
            time.sleep(self.slow_s)
        if GATED in prompt:
            GATE.wait(30)
        return Draft.empty()


def tiny_engine(marker_slow_s: float = 0.05):
    """The tiny verifier (fp32) and a pool of three arms: a drafter with the verifier's weights (drafts accepted),
    n-gram lookup, the marker drafter; UCB picks among them."""
    from metasd.core.engine import Engine
    from metasd.core.verifier import Verifier
    from metasd.drafters import NGramDrafter, PretrainedDrafter
    from metasd.policies import UCB1
    from tiny import tiny_qwen, tiny_tokenizer

    tok = tiny_tokenizer()
    drafters = [PretrainedDrafter(tiny_qwen(seed=0), tok, k=3, name="twin"), NGramDrafter(k=3, name="ngram"),
                MarkerDrafter(marker_slow_s)]
    return Engine(Verifier(tiny_qwen(seed=0), tok, name="tiny"), drafters, UCB1(len(drafters), c=1.0, normalize=True),
                  reward="block_efficiency")


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
    """A tiny verifier saved as an HF directory and a pool file over it (n-gram + marker drafters); the pool's path."""
    from tiny import tiny_qwen, tiny_tokenizer

    tiny_qwen(seed=0).save_pretrained(root / "verifier")
    tiny_tokenizer().save_pretrained(root / "verifier")
    pool = {"verifier": {"model": str(root / "verifier"), "dtype": "fp32"},
            "drafters": [{"name": "ngram", "type": "ngram", "params": {"k": 3}},
                         {"name": "marker", "type": "serve_helpers:MarkerDrafter", "params": {"slow_s": 0.05}}],
            "policy": {"name": "ucb", "params": {"c": 1.0}}, "reward": "block_efficiency"}
    path = root / "pool.yaml"
    path.write_text(yaml.safe_dump(pool))
    return path
