"""What KV memory costs and how much there is: a model's cache geometry, its bytes per cached token, the default KV
budget of a device, and the two errors of admission (docs/architecture.md#the-kv-memory-model).

A model holding KV rows costs ``2 x layers x kv_heads x head_dim x dtype bytes`` per cached token (keys and values of
every layer). A scheduler's KV budget is counted in bytes; a request reserves, at admission, room for its prompt, its
``max_new_tokens`` and the widest draft a forward may verify, rounded up to a bucket, and the cache allocates it then
or not at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

#: a reservation is rounded up to a multiple of this many positions (fewer distinct shapes, fewer reallocations)
RESERVATION_BUCKET = 256
#: fraction of the free memory the default budget takes: on a GPU what weights, activations and graphs leave; on a
#: CPU the memory available to new processes, shared with everything else the machine runs
DEFAULT_FRACTION = {"cuda": 0.9, "cpu": 0.5}


class KVBudgetError(ValueError):
    """A request whose reservation the KV budget can never hold (alone, with nothing else running): refused at once.
    Its message names the field at fault first (``max_new_tokens``), as the scheduler's other refusals do."""


class KVAllocationError(RuntimeError):
    """Allocating KV memory failed (out of memory): nothing was changed, the request that asked gets this error."""


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache: per layer, keys and values of [rows, kv_heads, positions, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: torch.nn.Module) -> "KVGeometry":
        """The geometry of a transformers causal LM, from its config (its text config for a multimodal one)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        param = next(model.parameters())
        return cls(int(cfg.num_hidden_layers), kv_heads, head_dim, param.dtype, param.device)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position costs in every layer, keys and values."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def bucketed(tokens: int, bucket: int = RESERVATION_BUCKET) -> int:
    """``tokens`` rounded up to a multiple of ``bucket``."""
    return -(-int(tokens) // bucket) * bucket


def buffer_keys(tensors) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """What a captured graph reads and writes, as it is keyed: each buffer's address and shape. A graph must be
    recaptured when they change - the shape too: a new buffer may reuse a freed one's address at another shape."""
    return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for new allocations: CUDA's free memory on ``device``; on a CPU, the kernel's ``MemAvailable``
    (Linux), else the physical memory reported by ``sysconf``."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def default_budget_bytes(device: torch.device) -> int:
    """The default KV budget of ``device``: ``DEFAULT_FRACTION`` of its free memory now (call it after the models
    are loaded)."""
    kind = torch.device(device).type
    return int(free_memory_bytes(device) * DEFAULT_FRACTION.get(kind, DEFAULT_FRACTION["cpu"]))


def draft_headroom(max_draft_nodes: int) -> int:
    """The positions a request's KV reservation holds beyond its prompt and new tokens: a step's draft (at most
    ``max_draft_nodes`` nodes) and the token the verifier adds after it."""
    return max_draft_nodes + 1


def tokens_alone(cache, context: int | None, headroom: int) -> int | None:
    """The most tokens (prompt + new) one request may have in ``cache`` (a ``BatchCache`` or any cache with
    ``check_admissible``) with nothing else running, where its budget holds fewer than ``context``; None where it holds
    a whole context, has no ``check_admissible`` or the context is unbounded. A reservation adds ``headroom`` (the
    scheduler's ``draft_headroom``) and rounds up to the cache's bucket."""
    check = getattr(cache, "check_admissible", None)

    def holds(tokens: int) -> bool:
        try:
            check(tokens + headroom)
            return True
        except KVBudgetError:
            return False

    if check is None or not context or holds(context):
        return None
    lo, hi = 0, context  # holds(hi) is false: bisect for the largest that holds (0: not even one token)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo
