"""``metasd bench --executor ray``: an experiment's requests answered by Ray actors, logged by this process alone.

Sharding keeps every comparison honest. A shard is a set of questions of one (pool, dataset); its worker
answers every turn of each with every baseline and method, interleaved per request as the in-process runner
does (or method by method with ``order: sequential``), so each speedup is a ratio of two timings taken on
one machine. A later turn is prompted with the run's own earlier answers, which is why a question's turns
are never split between workers.

Workers (``BenchWorker``, Ray actors) load each pool once and serve many shards; each reserves
``cpus_per_worker`` CPUs and runs that many torch threads, and ``gpus_per_worker`` GPUs (Ray's ``num_gpus``,
fractions allowed) if set: Ray then shows the worker its GPU (``CUDA_VISIBLE_DEVICES``) and the worker builds its
pools with ``device: cuda`` unless a pool names its device (``worker_device``); with none set, the devices are
left as they were. Each request record names the worker's device, and the progress line its GPUs.

Workers only compute: a shard comes back as its request records (``metasd.bench.requests.answer_request``,
tagged with the worker's id), and the driver (``RayRunner``) logs them into the nested runs with the in-process
runner's own methods. One writer, so a SQLite store stays safe, and resume and de-duplication live in one place:
a record whose (run, question, turn) is already logged is dropped. Only finished shards are logged, so Ctrl-C loses the shards in flight
and ``--resume`` answers them again. A worker that dies (``RayActorError``) is replaced by a fresh actor and
its shard queued again (at most ``max_retries`` times per shard).

A persistent policy (``persistent: true``: state carried across requests) keeps one state per worker; the
parent run's tag ``metasd.policy_state`` and the results table say so, and ``policy_state.json`` holds
``{"scope": "per-worker", "workers": {id: state}}``. A replacement worker, or a worker of a resumed experiment,
starts its persistent policies afresh (the in-process runner resumes from the last logged state).
"""
from __future__ import annotations

import builtins
import os
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .requests import MethodRequests, PoolEngine, answer_request, compare_with_plain
from .schema import ExecutorSpec
from .runner import ExperimentRunner

EXTRA = "pip install -e '.[ray]'"


class RayNotInstalledError(ValueError):
    """``--executor ray`` without the ``ray`` extra installed."""


def import_ray():
    """The ``ray`` module, or ``RayNotInstalledError`` naming the extra that provides it."""
    try:
        import ray
    except ImportError as e:
        raise RayNotInstalledError(f"--executor ray (executor: ray) needs the 'ray' extra: {EXTRA} ({e})") from None
    return ray


@dataclass
class Shard:
    """Questions of one (pool, dataset) for one worker, with what is already logged for them."""

    sid: int
    block: str
    pool: str
    dataset: str
    questions: list[tuple[int, int]]  # (position in the dataset's questions, index of its first request)
    jobs: list[tuple[str, str, str, int | None]]  # (nested key, kind, baseline label or method name, seed); plain first
    done: dict[str, dict[tuple[str, int], dict]] = field(default_factory=dict)  # key -> (question, turn) -> record
    n_requests: int = 0  # requests in the shard, logged ones included


def worker_device(pool_device: str | None, gpus: float | None) -> str | None:
    """The device a worker builds a pool on: the pool's own when the worker reserved no GPU or the pool names one
    (``cpu``, ``cuda:0``...); else, a GPU reserved (Ray shows the worker that GPU alone), ``cuda``. Refused when
    torch in the worker sees no CUDA device: the run would silently go to the CPU."""
    if not gpus or pool_device not in (None, "auto"):
        return pool_device
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"this Ray worker reserved {gpus:g} GPU (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}) but torch sees no CUDA device (a CPU-only torch "
                         "build, or no driver): name the pool's verifier.device, or drop executor.gpus_per_worker")
    return "cuda"


def on_worker_device(pool, gpus: float | None):
    """``pool`` (a ``ResolvedPool``) with its verifier's device as ``worker_device`` resolves it for this worker."""
    device = worker_device(pool.config.verifier.device, gpus)
    if device == pool.config.verifier.device:
        return pool
    verifier = pool.config.verifier.model_copy(update={"device": device})
    return replace(pool, config=pool.config.model_copy(update={"verifier": verifier}))


class BenchWorker:
    """A Ray actor's state: each pool's engine (loaded on first use), one request function per run.

    A method's ``MethodRequests`` lives as long as the worker, so a persistent policy carries its state
    across the requests this worker answers, and only those.
    """

    def __init__(self, exp, worker_id: str, threads: int, setup: Callable[[], None] | None = None,
                 gpus: float | None = None):
        import torch

        torch.set_num_threads(threads)
        if setup is not None:
            setup()
        import socket

        self.exp, self.id, self.threads, self.host, self.gpus = exp, worker_id, threads, socket.gethostname(), gpus
        self.pools = {p.name: p for p in exp.pools}
        self.datasets = {d.name: d for d in exp.datasets}
        self.engines: dict[str, PoolEngine] = {}
        self.fns: dict[str, Callable] = {}  # nested key -> request function
        self.info: dict[str, str] = {}
        self.states: dict[str, Any] = {}  # final policy states of runs whose pool was released

    def ping(self) -> dict[str, Any]:
        import ray
        import torch

        return {"worker": self.id, "host": self.host, "pid": os.getpid(), "threads": torch.get_num_threads(),
                "gpus": [str(g) for g in ray.get_gpu_ids()] if self.gpus else []}

    def _engines(self, pool: str) -> PoolEngine:
        if pool not in self.engines:
            if self.engines:  # shards come pool by pool: hold one pool in memory, as the in-process runner does
                self.states.update(self.policy_states())
                self.engines.clear()
                self.fns.clear()
            def loaded(engine) -> None:
                v = engine.verifier
                self.info = {"device": str(v.device), "dtype": str(v.dtype).removeprefix("torch.")}

            log = lambda s: print(f"{s} (worker {self.id}, pid {os.getpid()})", file=sys.stderr, flush=True)  # noqa: E731
            self.engines[pool] = PoolEngine(self.exp, on_worker_device(self.pools[pool], self.gpus), log, loaded)
        return self.engines[pool]

    def _fn(self, engines: PoolEngine, key: str, kind: str, name: str, seed: int | None, ds) -> Callable:
        if key not in self.fns:
            if kind == "baseline":
                spec = next(b for b in self.exp.config.baselines if b.label == name)
                self.fns[key] = engines.baseline_fn(spec)
            else:
                m = next(m for m in engines.pool.methods if m.name == name)
                self.fns[key] = MethodRequests(engines, m, ds, seed, [])
        return self.fns[key]

    def run_shard(self, shard: Shard) -> dict[str, Any]:
        """Answer the shard's requests that are not logged yet: ``{"worker", "info", "records": [(key, rec)]}``."""
        engines = self._engines(shard.pool)
        ds = self.datasets[shard.dataset]
        out: list[tuple[str, dict]] = []
        for pos, first in shard.questions:
            q = ds.questions[pos]
            turns = q.turns[:1] if ds.turns == "first" else q.turns
            history: dict[str, list[dict[str, str]]] = {job[0]: [] for job in shard.jobs}
            plain: dict[int, dict] = {}  # turn -> plain's record
            n = len(shard.jobs)
            if self.exp.config.order == "interleaved":  # every run answers turn t, in an order rotated by one per
                # request (the in-process runner's), plain (j = 0) included
                order = [(t, (j + first + t) % n) for t in range(len(turns)) for j in range(n)]
            else:
                order = [(t, j) for j in range(n) for t in range(len(turns))]
            waiting: dict[int, list[dict]] = {}  # turn -> records answered before plain's record of that turn
            for t, j in order:  # sequential: plain (j = 0) answers turn t before any other run does
                key, kind, name, seed = shard.jobs[j]
                messages = history[key] + [{"role": "user", "content": turns[t]}]
                rec = shard.done.get(key, {}).get((q.question_id, t))
                if rec is None:
                    fn = self._fn(engines, key, kind, name, seed, ds)
                    rec = answer_request(engines, fn, messages, q, t, first + t, seed, name, kind,
                                         None if j == 0 else plain.get(t))
                    rec["worker"], rec["host"], rec["device"] = self.id, self.host, self.info.get("device")
                    out.append((key, rec))
                    if j != 0 and t not in plain:
                        waiting.setdefault(t, []).append((kind, rec))
                if j == 0:
                    plain[t] = rec
                    for w_kind, w in waiting.pop(t, []):
                        compare_with_plain(w, rec, self.exp.config.temperature, w_kind)
                history[key] = messages + [{"role": "assistant", "content": rec["text"]}]
        return {"worker": self.id, "info": self.info, "records": out}

    def policy_states(self) -> dict[str, Any]:
        """Nested key -> this worker's final policy state, for the multi-drafter methods it ran."""
        live = {k: fn.engine.policy.state_dict() for k, fn in self.fns.items()
                if isinstance(fn, MethodRequests) and fn.engine is not None and len(fn.m.drafters) > 1}
        return {**self.states, **live}


class RayRunner(ExperimentRunner):
    """``ExperimentRunner`` with requests answered by Ray actors (module docstring); MLflow writes stay here."""

    executor_name = "ray"

    def __init__(self, *args, spec: ExecutorSpec, setup: Callable[[], None] | None = None, **kw):
        super().__init__(*args, **kw)
        self.spec, self.setup = spec, setup
        self.blocks: list[tuple] = []  # (block, pool, ds, runs, jobs) for every (pool, dataset)
        self.restarts = 0  # workers replaced after dying
        self.duplicates = 0  # records dropped because their request was already logged

    # ---- plan
    def _loop(self) -> None:
        from tqdm import tqdm

        ray = import_ray()
        exp = self.exp
        self.nested = {}
        for pool in exp.pools:
            for ds in exp.datasets:
                block, runs, jobs = self._open_block(pool, ds)
                self.blocks.append((block, pool, ds, runs, jobs))
                self.nested.update({n.key: n for n, _, _ in jobs})
        total = sum(ds.n_requests * len(jobs) for _, _, ds, _, jobs in self.blocks)
        self.pbar = tqdm(total=total, desc=exp.name, unit="req", disable=not self.progress, dynamic_ncols=True)
        shards = self._shards()
        self.touched: set[str] = set()  # nested runs that got a request in this call
        self.actors: dict[int, Any] = {}
        states: dict[str, dict[str, Any]] = {}
        if shards:  # else every request is logged already: no Ray needed
            original_print = builtins.print
            started = self._init_ray(ray)
            try:
                self._start_workers(ray)
                self._dispatch(ray, deque(shards))
                states = self._policy_states(ray)
            finally:
                for actor in self.actors.values():
                    ray.kill(actor)
                if started:
                    ray.shutdown()
                    builtins.print = original_print  # Ray's driver replaces it once it prints a worker's log line
        self.pbar.close()
        self.pbar = None
        self._finalize(states)

    def _shards(self) -> list[Shard]:
        """Questions with a request not logged in some run, ``questions_per_shard`` to a shard."""
        shards: list[Shard] = []
        for block, pool, ds, runs, jobs in self.blocks:
            spec = [(n.key, n.kind, n.method, seed) for n, _, seed in jobs]
            first, todo = 0, []
            for pos, q in enumerate(ds.questions):
                n_turns = 1 if ds.turns == "first" else len(q.turns)
                done = {n.key: {(q.question_id, t): n.done[(q.question_id, t)] for t in range(n_turns)
                                if (q.question_id, t) in n.done} for n, _, _ in jobs}
                logged = sum(len(d) for d in done.values())
                self.skipped += logged
                self.pbar.update(logged)
                if logged < n_turns * len(jobs):
                    todo.append(((pos, first), done, n_turns * len(jobs)))
                first += n_turns
            size = self.spec.questions_per_shard
            for i in range(0, len(todo), size):
                part = todo[i:i + size]
                done = {k: {kt: r for _, d, _ in part for kt, r in d[k].items()} for k, *_ in spec}
                shards.append(Shard(len(shards), block, pool.name, ds.name, [p for p, _, _ in part], spec,
                                    {k: v for k, v in done.items() if v}, sum(n for _, _, n in part)))
        return shards

    # ---- workers
    def _init_ray(self, ray) -> bool:
        """Connect to (``address``) or start a local Ray unless one is up; True when this call started it."""
        if ray.is_initialized():
            return False
        kw = dict(include_dashboard=False, ignore_reinit_error=True, logging_level="WARNING")
        ray.init(address=self.spec.address, **kw)
        return True

    def _start_workers(self, ray) -> None:
        import torch

        resources = ray.cluster_resources()
        total, total_gpus = int(resources.get("CPU", 1)), float(resources.get("GPU", 0))
        s = self.spec
        gpus = s.gpus_per_worker or None  # 0: none, as unset
        cpus = s.cpus_per_worker or (max(1, total // s.workers) if s.workers else (self.threads or 1))
        n = s.workers or max(1, min(total // cpus, int(total_gpus / gpus + 1e-9) if gpus else total))
        if n * cpus > total:
            raise ValueError(f"executor: {n} workers x {cpus} CPUs each need {n * cpus} CPUs; the Ray cluster has "
                             f"{total} (lower --workers or executor.cpus_per_worker)")
        if gpus and n * gpus > total_gpus + 1e-9:
            raise ValueError(f"executor: {n} workers x {gpus:g} GPUs each need {n * gpus:g} GPUs; the Ray cluster has "
                             f"{total_gpus:g} (lower --workers or executor.gpus_per_worker)")
        self.cpus, self.gpus, self.n_workers = cpus, gpus, n
        options = dict(num_cpus=cpus, max_restarts=0, max_task_retries=0, **({"num_gpus": gpus} if gpus else {}))
        self._actor_cls = ray.remote(BenchWorker).options(**options)
        self.generation: dict[int, int] = {}
        self.live: set[int] = set()  # slots whose current worker has answered
        self.pings: dict[Any, tuple[int, int]] = {}  # ping ref -> (slot, generation)
        for slot in range(n):
            self._new_actor(slot)
        persistent = sorted({m.name for _, pool, _, _, _ in self.blocks for m in pool.methods if m.persistent})
        tags = {"metasd.workers": str(n), "threads": str(cpus), "metasd.cpus_per_worker": str(cpus),
                "metasd.gpus_per_worker": f"{gpus:g}" if gpus else "0",
                "metasd.driver_threads": str(torch.get_num_threads()),
                "metasd.policy_state": "per-worker" if persistent else "n/a (no persistent policy)"}
        for k, v in tags.items():
            self.client.set_tag(self.parent_id, k, v)
        each = f"{cpus} CPUs (torch threads)" + (f" and {gpus:g} GPU" if gpus else "")
        self.notes.append(f"executor: ray, {n} workers x {each} each; every method of a question ran on the same worker")
        if persistent:
            self.notes.append(f"persistent policies ({', '.join(persistent)}) kept one state per worker ({n} workers), "
                              "not one across the whole experiment")

    def _new_actor(self, slot: int) -> None:
        """Start the worker of ``slot`` (again): ids ``"0"``, ``"1"``..., a replacement ``"<slot>.<n>"``."""
        gen = self.generation.get(slot, -1) + 1
        self.generation[slot] = gen
        wid = str(slot) if gen == 0 else f"{slot}.{gen}"
        self.actors[slot] = self._actor_cls.remote(self.exp, wid, self.cpus, self.setup, self.gpus)
        self.live.discard(slot)
        self.pings[self.actors[slot].ping.remote()] = (slot, gen)  # live once it answers

    def _dispatch(self, ray, pending: deque) -> None:
        """Keep one shard on every worker; log each as it finishes; requeue the shard of a worker that dies."""
        from ray.exceptions import RayActorError, WorkerCrashedError

        inflight: dict[Any, tuple[int, Shard]] = {}
        tries: dict[int, int] = {}

        def submit(slot: int) -> None:
            if pending:
                shard = pending.popleft()
                inflight[self.actors[slot].run_shard.remote(shard)] = (slot, shard)

        for slot in list(self.actors):
            submit(slot)
        self._postfix()
        while inflight:
            ready, _ = ray.wait(list(inflight) + list(self.pings), num_returns=1)
            if ready[0] in self.pings:
                slot, gen = self.pings.pop(ready[0])
                try:
                    info = ray.get(ready[0])
                except (RayActorError, WorkerCrashedError):
                    continue  # its shard fails too, and is retried there
                if gen != self.generation[slot]:
                    continue  # a worker replaced since
                self.live.add(slot)
                gpus = f", GPU {','.join(info['gpus'])}" if info.get("gpus") else ""
                self.pbar.write(f"[metasd bench] worker {info['worker']} up on {info['host']} (pid {info['pid']}, "
                                f"{info['threads']} threads{gpus})", file=sys.stderr)
                self._postfix()
                continue
            slot, shard = inflight.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except (RayActorError, WorkerCrashedError) as e:
                tries[shard.sid] = tries.get(shard.sid, 0) + 1
                if tries[shard.sid] > self.spec.max_retries:
                    raise RuntimeError(f"shard {shard.sid} ({shard.block}) lost its worker {tries[shard.sid]} times; "
                                       f"giving up (executor.max_retries = {self.spec.max_retries})") from e
                self.restarts += 1
                self.client.set_tag(self.parent_id, "metasd.worker_restarts", str(self.restarts))
                self.pbar.write(f"[metasd bench] worker {slot} died ({type(e).__name__}); shard {shard.sid} goes to a "
                                "fresh worker", file=sys.stderr)
                ray.kill(self.actors[slot])
                self._new_actor(slot)
                pending.appendleft(shard)
            else:
                self.live.add(slot)
                self._take(shard, result)
            submit(slot)
            self._postfix()

    def _postfix(self) -> None:
        self.pbar.set_postfix_str(f"{len(self.live)}/{len(self.actors)} workers live, {self.restarts} restarted",
                                  refresh=True)

    def _take(self, shard: Shard, result: dict[str, Any]) -> None:
        """Log a finished shard's records; drop any whose request is already logged."""
        if result["info"] and not getattr(self, "_tagged", False):
            for k, v in result["info"].items():
                self.client.set_tag(self.parent_id, k, v)
            self._tagged = True
        plain = self.nested[shard.jobs[0][0]]
        # plain's records first (stable otherwise): the running speedup of a record needs plain's of its request
        for key, rec in sorted(result["records"], key=lambda kr: kr[0] != plain.key):
            nested = self.nested[key]
            if (rec["question_id"], rec["turn"]) in nested.done:
                self.duplicates += 1
                continue
            if key not in self.touched:
                nested.start()
                self.touched.add(key)
            p = plain.done.get((rec["question_id"], rec["turn"]))
            self._log_request(nested, rec, p)
            self.pbar.update(1)

    def _policy_states(self, ray) -> dict[str, dict[str, Any]]:
        states: dict[str, dict[str, Any]] = {}
        for slot, actor in self.actors.items():
            wid = str(slot) if self.generation[slot] == 0 else f"{slot}.{self.generation[slot]}"
            for key, state in ray.get(actor.policy_states.remote()).items():
                states.setdefault(key, {})[wid] = state
        return states

    # ---- end
    def _finalize(self, states: dict[str, dict[str, Any]]) -> None:
        """End the runs that got requests (records in index order), then summarize every (pool, dataset)."""
        for block, pool, ds, runs, jobs in self.blocks:
            plain = jobs[0][0]
            for nested, spec, seed in jobs:
                if nested.key not in self.touched and nested.finished:
                    continue
                missing = ds.n_requests - len(nested.records)
                if missing > 0:
                    raise RuntimeError(f"{nested.key}: {missing} requests missing after every shard finished")
                self._sort_records(nested)
                if seed is not None:
                    s = states.get(nested.key)
                    state = {"scope": "per-worker", "workers": s} if s and len(spec.drafters) > 1 else None
                    self._finalize_method(nested, spec, state)
                self._end_run(nested, plain.records)
            self._summarize(block, pool, ds, runs, plain.records)
            self.summaries[block]["executor"] = {"type": "ray", "workers": getattr(self, "n_workers", 0),
                                                 "cpus_per_worker": getattr(self, "cpus", 0),
                                                 "gpus_per_worker": getattr(self, "gpus", None) or 0, "restarts": self.restarts,
                                                 "duplicates_dropped": self.duplicates,
                                                 "policy_state": "per-worker"}
        if self.duplicates:
            self.notes.append(f"{self.duplicates} duplicate records (a request answered twice) were dropped")

    def _sort_records(self, nested) -> None:
        """Shards finish in any order: rewrite ``requests.jsonl`` in request order, as the in-process runner has it."""
        import json

        if [r["index"] for r in nested.records] == sorted(r["index"] for r in nested.records):
            return
        nested.records.sort(key=lambda r: r["index"])
        with open(nested.path, "w") as f:
            for r in nested.records:
                f.write(json.dumps(r) + "\n")
        self.client.log_artifact(nested.run_id, str(nested.path))

    def _partial_table(self) -> str:
        """The results table over every (pool, dataset), finished requests only (printed on Ctrl-C)."""
        from .report import results_table

        parts = []
        for block, pool, ds, runs, jobs in self.blocks:
            summary = self._block_summary(pool, ds, runs, jobs[0][0].records)[0]
            parts.append(results_table(summary, title=f"pool `{pool.name}`, dataset `{ds.name}` (partial)"))
        return "\n".join(parts)
