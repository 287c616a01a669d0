"""``metasd serve --ray``: two Ray Serve replicas of a tiny pool (each builds its engine and scheduler from a picklable
recipe) behind one HTTP entry on a local 2-CPU Ray; concurrent requests from the official openai client are answered
by both replicas.

Skipped when Ray Serve does not import (``pip install 'ray[serve]'``); with METASD_REQUIRE_RAY=1 (CI) a missing Ray
Serve is a failure instead, as in test_ray_executor.py.
"""
from __future__ import annotations

import builtins
import os
import random
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serve_helpers import SLOW, write_tiny_pool

pytest.importorskip("fastapi")

try:
    import ray
    from ray import serve
except ImportError:
    ray = serve = None
    if os.environ.get("METASD_REQUIRE_RAY") == "1":
        raise ImportError("METASD_REQUIRE_RAY=1 but Ray Serve does not import: pip install 'ray[serve]'") from None

needs_ray_serve = pytest.mark.skipif(serve is None, reason="Ray Serve not installed (pip install 'ray[serve]')")
TESTS = Path(__file__).resolve().parent


def _free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999), which Ray's own outgoing connections draw from."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _start_serve(attempts: int = 3) -> int:
    """``serve.start`` on a free port, again on another one when something took the port between the pick and the
    proxy's bind (another xdist worker's server did once: ``Failed to bind to address``)."""
    for attempt in range(attempts):
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as error:  # a RayTaskError wrapping the proxy's RuntimeError
            if "Failed to bind" not in str(error) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


@needs_ray_serve
def test_two_replicas_behind_one_entry_both_answer_concurrent_requests(tmp_path, monkeypatch):
    import openai

    from metasd.serve.cli import PoolEngine, SchedulerSettings
    from metasd.serve.ray_serve import APP_NAME, build_app

    pool = write_tiny_pool(tmp_path)
    print_before = builtins.print
    # Ray's processes inherit it: on a crowded machine the proxy answered its health check later than the default
    # 10 s three times, and the controller killed it
    monkeypatch.setenv("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}})  # the pool's drafter type
    try:
        port = _start_serve()
        recipe = PoolEngine.from_file(str(pool), threads=1)
        # a replica takes max_batch + max_queue = 5 requests at once (max_ongoing_requests): of 8 sent together the
        # router must hand the other one at least 3 (with the default queue of 64 it once gave one replica all 8); a
        # queue of 1, not 0, so that a request arriving as another's answer leaves is not refused
        serve.run(build_app(recipe, SchedulerSettings(max_batch=4, max_queue=1), "tiny", replicas=2),
                  name=APP_NAME, route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i):  # a slow request (0.05 s a step), so that they overlap and the proxy spreads them
            return client.completions.with_raw_response.create(model="tiny", prompt=[10 + i, SLOW, 11], max_tokens=8,
                                                                temperature=0)

        with ThreadPoolExecutor(8) as threads:
            raw = list(threads.map(ask, range(8)))
        assert len({r.headers["x-metasd-server"] for r in raw}) == 2  # both replicas answered
        for r in raw:
            answer = r.parse()
            assert answer.usage.completion_tokens == 8 and answer.choices[0].finish_reason == "length"
        again = ask(0).parse()
        assert again.choices[0].text == raw[0].parse().choices[0].text  # greedy: the same text from either replica
    finally:
        serve.shutdown()
        ray.shutdown()
        builtins.print = print_before  # Ray Serve replaces it with a thread-safe wrapper and leaves it
