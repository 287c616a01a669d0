"""``metasd serve --ray``: the same app on Ray Serve, ``--replicas`` copies behind one HTTP entry
(docs/serving.md#beyond-one-machine-ray-serve).

Each replica is a Ray actor that builds its own engine (from a picklable ``PoolEngine`` recipe, so no model
crosses the network) and its own scheduler, and serves ``create_app`` through Ray Serve's ASGI ingress; Ray Serve's
proxy routes each request to a replica (fewest ongoing requests of two picked at random). Where the cluster has
GPUs, each replica reserves one (``ray_actor_options={"num_gpus": 1}``) and its engine runs there. Needs
``pip install 'ray[serve]'``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

APP_NAME = "metasd"


class MetasdReplica:
    """One replica: an engine built from ``recipe``, a running scheduler, and the app over them. Its responses carry
    ``x-metasd-server`` (the replica's id), so a client can tell which replica answered."""

    def __init__(self, recipe, settings, model_name: str, options):
        self.scheduler = settings.make(recipe())
        self.model_name, self.options = model_name, options
        self.replica_id = _replica_id()

    def __serve_build_asgi_app__(self):  # Ray Serve calls it after __init__ (serve.ingress() without an app)
        from metasd.serve.app import create_app

        options = self.options.kwargs() if self.options is not None else {}
        return create_app(self.scheduler, self.model_name, server_id=self.replica_id, **options)

    def __del__(self):  # Ray Serve stops a replica after its graceful_shutdown_timeout_s
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # outside a replica
        return f"pid{os.getpid()}"


def build_app(recipe, settings, model_name: str, options=None, replicas: int = 1,
              num_gpus: float | None = None, drain_timeout: float = 30.0):
    """The Ray Serve application (``serve.run`` it): ``replicas`` replicas, each with ``num_gpus`` (default: 1 where
    the cluster has a GPU for every replica, else none); ``options``: ``metasd.serve.cli.AppOptions`` (the API key,
    ...; None: none set)."""
    import ray
    from ray import serve

    if num_gpus is None:
        num_gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= replicas else 0
    deployment = serve.deployment(
        serve.ingress()(MetasdReplica), name="MetasdReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": 1, "num_gpus": num_gpus},
        max_ongoing_requests=settings.max_batch + settings.max_queue, graceful_shutdown_timeout_s=drain_timeout)
    return deployment.bind(recipe, settings, model_name, options)


def serve_with_ray(recipe, settings, model_name: str, options, replicas: int, host: str, port: int,
                   address: str | None, drain_timeout: float = 30.0) -> int:
    """Start (or join) Ray, run the application, serve until SIGTERM / SIGINT, then shut Ray Serve down."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        print(f"metasd serve --ray: needs Ray Serve ({e}): pip install 'ray[serve]'", file=sys.stderr)
        return 2
    ray.init(address=address, include_dashboard=False) if address else ray.init(include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(recipe, settings, model_name, options, replicas, drain_timeout=drain_timeout),
              name=APP_NAME, route_prefix="/")
    print(f"[metasd serve] {replicas} Ray Serve replica(s) serving {model_name!r} on http://{host}:{port}",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("[metasd serve] draining the replicas", file=sys.stderr, flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
