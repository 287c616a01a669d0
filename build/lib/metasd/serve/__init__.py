"""The HTTP layer: ``metasd serve``, an OpenAI-compatible server over the batch scheduler
(``metasd.core.batching.scheduler``), which verifies the drafts of many concurrent requests in one forward per step (docs/serving.md).

Importing this package needs nothing beyond metasd's own dependencies; the app (``metasd.serve.app.create_app``)
needs the ``serve`` extra (fastapi, uvicorn, prometheus-client): ``pip install 'metasd[serve]'``.
"""

SERVE_EXTRA = "pip install 'metasd[serve]'"


def __getattr__(name: str):
    if name == "create_app":  # lazily: importing metasd.serve must not import fastapi
        from metasd.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'metasd.serve' has no attribute {name!r}")
