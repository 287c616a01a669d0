"""``metasd serve``: its options, and running the server on one machine or, with ``--ray``, as Ray Serve replicas.

Importing this module needs neither FastAPI nor uvicorn (``metasd --help`` lists ``serve`` on any install); running
the command without them exits 2 naming the extra to install.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from metasd.serve import SERVE_EXTRA
from metasd.serve.response_store import DEFAULT_MAX_STORED_RESPONSES
from metasd.serve.reasoning import PARSERS as REASONING_PARSERS
from metasd.serve.tools import PARSERS

_NEEDS = ("fastapi", "uvicorn", "prometheus_client")


def add_serve_parser(sub) -> None:
    from metasd.config.cli_options import HelpFormatter, add_pool_options

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server that batches concurrent requests (docs/serving.md)",
        formatter_class=HelpFormatter,
        description="Serve a model or a pool over HTTP with OpenAI's routes (/v1/chat/completions, /v1/completions, "
                    "/v1/models), /tokenize, /detokenize, /version, /health and /metrics; the drafts of concurrent "
                    "requests are verified in one batched forward per step. Without max_tokens a chat request may use "
                    "what the context leaves and a completion 16 tokens (OpenAI's defaults; metasd generate and "
                    f"Engine.generate: 128). Needs the serve extra: {SERVE_EXTRA}.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="the verifier: bundled:<name>, a local HF directory or .gguf file, or a hub id; drafted for by "
                        "the serving pool's drafters unless --drafter or --speculative-config says otherwise (default: "
                        "the serving pool's verifier, bundled:qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--pool", help="pool config YAML, the full form instead of MODEL (default: the embedded serving "
                                  "pool, configs/pools/serve_adaptive.yaml: the default cascade with adaptive "
                                  "speculation)")
    add_pool_options(p)
    p.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's speculative config: {\"method\": \"ngram\" | \"suffix\" | \"draft_model\", \"model\", "
                        "\"num_speculative_tokens\", \"prompt_lookup_max\", ...}: the pool's drafters replaced by that "
                        "one drafter, drafting as configured (no adaptive sizing); not with --drafter or --k")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: one the OS chooses, printed)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics "
                        "(default: $METASD_API_KEY; none: no authentication)")
    p.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", action="append", metavar="NAME",
                   help="the model id clients name in 'model' (default: MODEL as given, else the pool's verifier); "
                        "repeated: each is accepted and listed, the first is the one answers name")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="the context served: prompt + max_tokens at most this many tokens (default: the model's)")
    p.add_argument("--max-batch", type=int, default=8, help="requests verified together in one step")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    p.add_argument("--kv-budget", type=int, metavar="TOKENS",
                   help="KV memory for running requests, in positions of the verifier's cache (the drafters' caches "
                        "are charged to it too); a request reserves prompt + max_tokens + its widest draft when it "
                        "starts, waits while the budget is full, and gets 400 if it could never fit (default: half "
                        "the available RAM, or 90%% of a GPU's free memory, after the models load; on the llama.cpp "
                        "backend the verifier's context, which --kv-budget may not exceed)")
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   default=None, help="keep finished requests' KV (inside --kv-budget) to start requests that continue "
                                      "them, e.g. the next turn of a chat (default: on, unless a drafter reads the "
                                      "verifier's hidden states or the verifier runs on llama.cpp)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                   help="the largest request body read; a larger one gets 413 (default: 8 MiB)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="seconds a client has to send its whole request body; a slower one gets 408 (default: 60)")
    p.add_argument("--share-suffix-cache", action="store_true",
                   help="let the suffix drafter draft from every request's text (faster on repeated text, but a "
                        "request's timings and acceptance can then reveal what others asked; docs/serving.md#security)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before cancelling them")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log a line of throughput, running and waiting requests and acceptance this often while "
                        "there is work (0: never)")
    p.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: a request that leaves temperature, top_p, top_k, min_p, repetition_penalty or "
                        "max_tokens unset "
                        "gets the model's generation_config value, as vLLM does; none: OpenAI's defaults")
    p.add_argument("--tool-call-parser", choices=["auto", "none", *PARSERS], default="auto",
                   help="the format the model's tool calls are read in (auto: from its chat template, e.g. hermes for "
                        "Qwen's <tool_call>; none: tools are shown to the model but its calls not read)")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="read a reasoning model's thinking (<think>...</think>) out of chat answers into "
                        "message.reasoning (default: none, the answer is all content)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="render chats through this Jinja template instead of the model's: a file, or the template's "
                        "text (checked before the model loads)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request send a chat template of its own (chat_template): a template is code the server "
                        "runs (sandboxed); off by default, as in vLLM")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                   help="Responses API: keep the N most recent responses (store: true, the default) in memory for "
                        "previous_response_id and GET /v1/responses/{id}; 0: keep none (default: %(default)s)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log a line per HTTP request")
    p.add_argument("--cost-profile", metavar="FILE",
                   help="a saved ForwardProfile (JSON of to_dict) for a pool with serving.adaptive: skips profiling "
                        "the verifier at start")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--ray", action="store_true", help="serve with Ray Serve: --replicas copies of the pool behind one "
                                                      "HTTP entry (needs: pip install 'ray[serve]')")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: replicas, one engine and scheduler each")
    p.add_argument("--ray-address", help="with --ray: the cluster to join ('auto', HOST:PORT; default: start one)")
    p.set_defaults(func=serve_command)


def _check_address(host: str, port: int) -> None:
    """The address the server will listen on, tried before any model loads: a host that does not resolve or is not
    this machine's, or a port another process listens on, is named now, not after minutes of loading."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:  # a name that does not resolve, or is no host name at all
        raise ValueError(f"--host {host}: {getattr(e, 'strerror', None) or 'not a valid host name'}") from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def _check_args(args) -> None:
    for name in ("max_batch", "replicas"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(args, name)}")
    for name in ("max_queue", "max_stored_responses"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 0, got {getattr(args, name)}")
    for name in ("kv_budget", "max_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
    if not (math.isfinite(args.body_timeout) and args.body_timeout > 0):
        raise ValueError(f"--body-timeout must be a number of seconds > 0, got {args.body_timeout}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {args.threads}")
    if (args.replicas != 1 or args.ray_address) and not args.ray:
        raise ValueError("--replicas and --ray-address need --ray")
    if args.model and args.pool:
        raise ValueError(f"give MODEL ({args.model}) or --pool ({args.pool}), not both: a pool file names its verifier "
                         f"(verifier.model); to serve another model with it, edit that field")
    if args.speculative_config is not None and (args.drafter or args.k is not None):
        raise ValueError("--speculative-config sets the drafter and its num_speculative_tokens: give it without "
                         "--drafter and --k")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be an integer >= 2, got {args.max_model_len}")
    if args.log_stats_interval < 0:
        raise ValueError(f"--log-stats-interval must be >= 0 (0: off), got {args.log_stats_interval}")


@dataclass(frozen=True)
class PoolEngine:
    """A picklable recipe for an engine: the pool's mapping (a pool file's with the command line's overrides),
    where it came from (named in errors), the pool file's folder (relative checkpoints) and torch's CPU threads.
    Ray replicas build their engine from it, each in its own process."""

    config: dict
    source: str = "default pool"
    base_dir: str | None = None
    threads: int | None = None

    def __call__(self):
        import torch

        from metasd.config import build_engine

        if self.threads:
            torch.set_num_threads(self.threads)
        return build_engine(self.parse(), Path(self.base_dir) if self.base_dir else None)

    @classmethod
    def from_file(cls, pool: str | None = None, threads: int | None = None) -> "PoolEngine":
        """The recipe of a pool file as it is (None: the embedded serving pool)."""
        from metasd.config import default_serve_pool_path, read_yaml_mapping

        path = pool or default_serve_pool_path()
        return cls(read_yaml_mapping(path, "pool config"), pool or "the serving pool",
                   str(Path(pool).resolve().parent) if pool else None, threads)

    def parse(self):
        from metasd.config import parse_pool_config

        return parse_pool_config(self.config, source=self.source)

    def check(self):
        """The pool and its model references, before any model loads: ``ConfigError`` naming the bad field."""
        from metasd.config import ConfigError, check_model_references, check_quantization

        config = self.parse()
        check_model_references(config, self.source, Path(self.base_dir) if self.base_dir else None)
        try:
            check_quantization(config)
        except ValueError as e:
            raise ConfigError(f"{self.source}: {e}") from None
        return config


def pool_recipe(args) -> PoolEngine:
    """The engine ``args`` ask for: the pool file (default: the embedded serving pool) with MODEL as its verifier and
    the drafter options (--drafter, --k, --param, --policy, ..., --speculative-config) applied; everything checked
    that can be without loading a model (``ValueError`` / ``ConfigError`` naming the option or field)."""
    from metasd.config import default_serve_pool_path
    from metasd.config.cli_options import check_pool_options, pool_overrides

    from .speculative import speculative_drafters

    args.verifier = args.model
    default = default_serve_pool_path()
    check_pool_options(args, default, verifier_option="MODEL")
    drafters = speculative_drafters(args.speculative_config) if args.speculative_config is not None else None
    extra = [f"MODEL {args.model}"] if args.model else []
    extra += ["--speculative-config"] if drafters is not None else []
    extra += [f"--drafter {d}" for d in args.drafter or []] + [f"--param {p}" for p in args.param or []]
    source = (args.pool or "the serving pool") + (" with " + ", ".join(extra) if extra else "")
    base_dir = str(Path(args.pool).resolve().parent) if args.pool else None
    recipe = PoolEngine(pool_overrides(args, default, drafters), source, base_dir, args.threads)
    config = recipe.check()
    if args.max_model_len is not None:
        from metasd.models import context_length

        limit = context_length(config.verifier.model)
        if limit is not None and args.max_model_len > limit:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the context of {config.verifier.model} "
                             f"({limit} tokens)")
    return recipe


@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler's options from the command line (picklable: Ray replicas make their scheduler with them);
    ``make(engine)`` returns a running scheduler."""

    max_batch: int = 8
    max_queue: int = 64
    share_suffix_cache: bool = False
    #: the pool's ``serving`` section as a dict when it asks for adaptive speculation (None: off)
    adaptive: dict | None = None
    #: a saved ``ForwardProfile.to_dict()`` (--cost-profile): used instead of profiling the verifier at start
    cost_profile: dict | None = None
    #: --kv-budget: KV positions of the verifier's cache (None: from the free memory)
    kv_budget: int | None = None
    #: --[no-]enable-prefix-caching (None: on where the pool allows it: no drafter reading the verifier's hidden
    #: states)
    prefix_caching: bool | None = None

    def make(self, engine):
        from metasd.core.batching.scheduler import Scheduler

        prefix = self.prefix_caching if self.prefix_caching is not None else not engine.hidden_layers
        scheduler = Scheduler(engine, max_batch=self.max_batch, max_queue=self.max_queue,
                              share_suffix_cache=self.share_suffix_cache, adaptive=self._adaptive(engine),
                              kv_budget=self.kv_budget, prefix_caching=prefix)
        start = getattr(scheduler, "start", None)  # a scheduler that does not start its thread when made
        if start is not None:
            start()
        return scheduler

    def _adaptive(self, engine):
        """The pool's ``AdaptiveSpeculation``: the forward cost from --cost-profile, else profiled on this machine
        (logged: the profile's ``describe()``). None without ``serving.adaptive``."""
        if not self.adaptive:
            return None
        from metasd.core.batching.adaptive import AdaptiveSpeculation
        from metasd.core.pricing.forward_profile import ForwardProfile, profile_forward, profile_llama_cpp

        if self.cost_profile is not None:
            profile = ForwardProfile.from_dict(self.cost_profile)
        else:
            opts = self.adaptive["profile"]
            counts = {"token_counts": opts["token_counts"]} if opts.get("token_counts") else {}
            if getattr(engine.verifier, "backend", "torch") == "llama.cpp":
                profile = profile_llama_cpp(engine.verifier, **counts, max_seconds=opts["max_seconds"])
            else:
                profile = profile_forward(engine.verifier.model, **counts, max_seconds=opts["max_seconds"])
        print(f"[metasd serve] adaptive speculation, max_width {self.adaptive['max_width']}; {profile.describe()}",
              file=sys.stderr, flush=True)
        measured = self.adaptive["draft_cost"] == "measured"
        return AdaptiveSpeculation(profile.cost, max_width=self.adaptive["max_width"],
                                   price_drafting=self.adaptive["price_drafting"],
                                   unit_seconds=profile.seconds_for(1) if measured else None,
                                   min_gain=self.adaptive["min_gain"],
                                   defer_catch_up=self.adaptive["defer_catch_up"],
                                   probe_stall=self.adaptive["probe_stall"])


def read_cost_profile(path: str | None, config) -> dict | None:
    """--cost-profile's ``ForwardProfile`` as a dict, checked before any model loads: ``ConfigError`` naming the file
    and the bad field (or that the pool does not ask for adaptive speculation)."""
    if path is None:
        return None
    from metasd.config import ConfigError
    from metasd.core.pricing.forward_profile import ForwardProfile, ProfileError

    if not config.serving.adaptive:
        raise ConfigError(f"--cost-profile {path}: the pool does not set serving.adaptive: true")
    try:
        data = json.loads(Path(path).read_text())
        ForwardProfile.from_dict(data)
    except OSError as e:
        raise ConfigError(f"--cost-profile {path}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--cost-profile {path}: not JSON: {e}") from None
    except (ProfileError, ValueError, TypeError) as e:
        raise ConfigError(f"--cost-profile {path}: {e}") from None
    return data


def serve_command(args) -> int:
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"metasd serve: needs {', '.join(missing)}: {SERVE_EXTRA}", file=sys.stderr)
        return 2
    _check_args(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("METASD_API_KEY") or None
    recipe = pool_recipe(args)
    config = recipe.parse()
    model_name = served_model_name(args, config)
    serving = config.serving.model_dump() if config.serving.adaptive else None
    settings = SchedulerSettings(args.max_batch, args.max_queue, args.share_suffix_cache, serving,
                                 read_cost_profile(args.cost_profile, config), args.kv_budget, args.prefix_caching)
    from metasd.serve.chat_template import read_chat_template

    template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    app_options = AppOptions(api_key, args.max_model_len, args.metrics_require_key, args.access_log,
                             args.generation_config, args.tool_call_parser, args.max_stored_responses, template,
                             args.trust_request_chat_template, args.reasoning_parser)
    if args.ray:
        from metasd.serve.ray_serve import serve_with_ray

        return serve_with_ray(recipe, settings, model_name, app_options, args.replicas, args.host, args.port,
                              args.ray_address, args.drain_timeout)
    return _serve_here(recipe, settings, model_name, app_options, args)


def served_model_name(args, config) -> str | list[str]:
    """The id clients send in ``model``: --served-model-name (several: a list, the first the one answers name), else
    MODEL as given, else the pool's verifier."""
    if args.model_name:
        return args.model_name[0] if len(args.model_name) == 1 else list(args.model_name)
    return args.model or config.verifier.model


@dataclass(frozen=True)
class AppOptions:
    """``create_app``'s options from the command line (picklable, for Ray replicas)."""

    api_key: str | None = None
    max_model_len: int | None = None
    metrics_require_key: bool = False
    access_log: bool = True
    generation_config: str = "auto"
    tool_call_parser: str = "auto"
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    chat_template: str | None = None  # the template's text (``read_chat_template``)
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None

    def kwargs(self) -> dict:
        return {"api_key": self.api_key, "max_model_len": self.max_model_len,
                "metrics_require_key": self.metrics_require_key, "access_log": self.access_log,
                "generation_config": self.generation_config, "tool_call_parser": self.tool_call_parser,
                "max_stored_responses": self.max_stored_responses, "chat_template": self.chat_template,
                "trust_request_chat_template": self.trust_request_chat_template,
                "reasoning_parser": self.reasoning_parser}


def _serve_here(recipe: PoolEngine, settings: SchedulerSettings, model_name: str, options: AppOptions, args) -> int:
    import uvicorn

    from metasd.serve.app import create_app
    from metasd.serve.server import DrainingServer
    from metasd.serve.stats_log import StatsLogger, log_to_stderr

    _check_address(args.host, args.port)  # every option and the pool checked; before the models load
    log_to_stderr()
    print(f"[metasd serve] loading {recipe.source}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine = recipe()
    scheduler = settings.make(engine)
    cache = scheduler.verifier.cache
    describe = getattr(engine.verifier, "describe", None)
    if describe is not None:
        print(f"[metasd serve] verifier: {describe()}", file=sys.stderr, flush=True)
    print(f"[metasd serve] loaded in {time.perf_counter() - t0:.1f} s; serving {model_name!r} (batch "
          f"{settings.max_batch}, queue {settings.max_queue}, KV budget {cache.budget_bytes / 2**20:.0f} MiB = "
          f"{cache.budget_bytes // cache.geometry.bytes_per_token} positions, prefix caching "
          f"{'on' if scheduler.prefix_cache is not None else 'off'}, auth "
          f"{'on' if options.api_key else 'off'})", file=sys.stderr, flush=True)
    app = create_app(scheduler, model_name, max_body_bytes=args.max_body_bytes,
                     body_timeout_s=args.body_timeout, **options.kwargs())
    parser = app.state.serve.tool_parser
    reasoning = app.state.serve.reasoning
    print(f"[metasd serve] tool calls: {f'read in the {parser.name} format' if parser else 'not read'}; thinking: "
          f"{f'read ({reasoning.name})' if reasoning else 'not read (all content)'}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10,
                            lifespan="off", access_log=False)
    server = DrainingServer(config, app.state.serve, scheduler, args.drain_timeout)
    stats = StatsLogger(app.state.serve.metrics, scheduler, args.log_stats_interval).start()
    try:
        server.run()
    finally:
        stats.stop()
        scheduler.close()
    print("[metasd serve] stopped", file=sys.stderr, flush=True)
    return 0
