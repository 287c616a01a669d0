"""Recording a pool arm's trace (``record_arm``, greedy only; the format and its replay: drafters/trace.py): at every
position of the verifier's greedy continuation of a prompt, the arm drafts as it would in a step, unbounded, and the
draft's shape, the nodes on the continuation's path and the model forwards it ran are kept - no token id."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from metasd.core.decoding.drafter import Drafter, StepContext, drafting_loop
from metasd.core.decoding.sampling import SamplingParams
from metasd.core.execution.draft_batch import Drafting, Feed, HostRead, drive
from metasd.core.execution.kv_cache import cache_length
from metasd.core.execution.tree import Draft, depths_of

from .trace import TraceStep


def record_arm(drafter: Drafter, prompt_ids: Sequence[int], continuation: Sequence[int], positions: int
               ) -> list[TraceStep]:
    """``drafter``'s drafts and forwards at positions 0 .. positions - 1 of ``continuation`` (the verifier's greedy
    tokens after ``prompt_ids``, longer than ``positions`` by the deepest draft the arm may make)."""
    if positions > len(continuation):
        raise ValueError(f"{drafter.name}: {positions} positions asked, the continuation has {len(continuation)}")
    prompt, R, greedy, steps = list(prompt_ids), list(continuation), SamplingParams(temperature=0.0), []
    drafter.begin(StepContext(torch.tensor(prompt), len(prompt), len(R), greedy))
    try:
        for p in range(positions):
            tokens = prompt + R[:p]
            ctx = StepContext(torch.tensor(tokens), len(prompt), len(R) - p, greedy, step=p,
                              request={"max_new_tokens": len(R)})
            feeds: list[dict] = []
            draft = _drive_recording(drafting_loop(drafter, ctx), len(tokens), feeds, drafter.name)
            steps.append(_step_of(draft, R[p:], feeds))
    finally:
        drafter.end()
    return steps


def _drive_recording(loop: Drafting, base: int, out: list[dict], name: str) -> Draft:
    """Run a drafting loop alone, describing each forward in ``out``: its rows mapped onto the draft's nodes by
    their paths (a row's path: its token after its parent rows')."""
    models: list[nn.Module] = []
    fed: dict[tuple[int, int], tuple[int, int]] = {}  # (model, slot - base) -> (token, parent row)

    def record(feed) -> None:  # each feed before it runs: its rows, described
        if isinstance(feed, HostRead):  # the drafter reading its values: no forward to record
            return
        if not isinstance(feed, Feed) or feed.head is not None or feed.steer is not None:
            raise ValueError(f"{name}: a trace records plain model forwards (Feed without a draft head or "
                             f"steering); this arm runs {type(feed).__name__}")
        if feed.model not in models:
            models.append(feed.model)
        m = models.index(feed.model)
        L, q = cache_length(feed.cache), feed.length
        ids = feed.ids.tolist() if isinstance(feed.ids, torch.Tensor) else list(feed.ids)
        if L + q <= base:
            if L + q != base:
                raise ValueError(f"{name}: a catch-up forward that stops short of the pending token")
            out.append({"catch_up": True, "model": m})
        else:
            if L < base:
                raise ValueError(f"{name}: a forward that feeds committed and draft tokens together")
            rows = []
            for j in range(q):
                row = L - base + j
                if feed.mask is None:
                    parent = row - 1
                else:
                    seen = [c - base for c in range(base, L + j) if bool(feed.mask[j, c])]
                    parent = max(seen) if seen else -1
                fed[(m, row)] = (ids[j], parent)
                rows.append([row, parent])
            out.append({"model": m, "masked": feed.mask is not None, "rows": rows})

    draft = drive(loop, record)
    paths = {_path(fed, m, r): (m, r) for m, r in fed}
    node_of_row = {}
    for i in range(len(draft)):
        at = paths.get(_draft_path(draft, i))
        if at is not None:
            node_of_row.setdefault(at, i)
    for f in out:
        if "rows" in f:
            f["rows"] = [[node_of_row.get((f["model"], row), -1), parent] for row, parent in f["rows"]]
    return draft


def _path(fed: dict[tuple[int, int], tuple[int, int]], m: int, row: int) -> tuple[int, ...]:
    path = []
    while row >= 0:
        token, row = fed[(m, row)]
        path.append(token)
    return tuple(reversed(path))
def _draft_path(draft: Draft, i: int) -> tuple[int, ...]:
    path, parents, tokens = [], draft.parents.tolist(), draft.tokens.tolist()
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return tuple(reversed(path))


def _step_of(draft: Draft, rest: list[int], feeds: list[dict]) -> TraceStep:
    parents, tokens = draft.parents.tolist(), draft.tokens.tolist()
    on: list[bool] = []
    for p, t, d in zip(parents, tokens, depths_of(parents)):
        on.append((p < 0 or on[p]) and d <= len(rest) and t == rest[d - 1])
    return TraceStep(parents, on, feeds)
