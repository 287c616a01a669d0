"""The KV cache of one sequence - the single-request verifier, every model-backed drafter, the forward profile: per
layer, keys and values preallocated as [rows, kv_heads, capacity, head_dim] and written by index at the committed
length, so that a step allocates nothing and moves nothing it keeps.

- a forward of n new tokens writes positions length..length+n-1 of every layer and reads ``[:, :, :length+n]``
  (the attended width follows the length, never the capacity);
- crop = set the length (``crop_to``): what lies beyond is garbage the next forward overwrites;
- a tree's accepted path = one index copy inside the buffer (``keep_positions`` gathers the kept nodes next to the
  prefix, then crops);
- the capacity is reserved ahead (``reserve``: the prompt plus the tokens the request may add, rounded up to a
  bucket); a forward past it grows the buffers to twice the need, so an eager caller that did not reserve still runs
  (the graph runner reserves, and a captured forward never grows).

Sliding-window layers (Gemma 3) keep every position too: transformers' sliding-window mask hides what lies outside the
window, so a crop can reach any position (a window-sized ring buffer could not) at the price of holding the whole
sequence. Layer types other than full and sliding attention (linear attention, state-space layers) are refused by
name when the cache is built.

Every ``keys`` / ``values`` a caller reads is a view ``[:, :, :length]`` of the buffer, the shape a transformers
``DynamicCache`` layer holds, so code written against that (copying a prefilled row into the batched cache, the
tests) reads the same positions.
"""
from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .kv_memory import RESERVATION_BUCKET, KVGeometry, buffer_keys, bucketed

#: layer types whose keys and values this cache holds
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class LengthLayer(CacheLayerMixin):
    """A cache layer holding ``length`` positions of one sequence: what transformers asks of its size."""

    length: int = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class StaticLayer(LengthLayer):
    """One layer's preallocated keys and values, [rows, kv_heads, capacity, head_dim] each, and its length."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: "StaticKVCache", sliding_window: int | None = None):
        super().__init__()
        self.owner = owner
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.length = 0
        self.k_buf: torch.Tensor | None = None  # [rows, kv_heads, capacity, head_dim]
        self.v_buf: torch.Tensor | None = None

    # what readers see: the committed positions only (a DynamicCache layer's shape)
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.k_buf is None else self.k_buf[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("StaticLayer.keys is a view of its buffer; write into it, do not replace it")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.v_buf is None else self.v_buf[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("StaticLayer.values is a view of its buffer; write into it, do not replace it")

    @property
    def capacity(self) -> int:
        return 0 if self.k_buf is None else self.k_buf.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states, value_states, max(self.owner.reserved, 1))

    def allocate(self, key_like: torch.Tensor, value_like: torch.Tensor, capacity: int) -> None:
        """(Re)allocate the buffers with room for ``capacity`` positions, keeping the committed ones."""
        rows, heads, _, k_dim = key_like.shape
        with torch.inference_mode(False):  # ordinary tensors: a forward outside inference mode may write them too
            k = torch.zeros(rows, heads, capacity, k_dim, dtype=key_like.dtype, device=key_like.device)
            v = torch.zeros(rows, heads, capacity, value_like.shape[-1], dtype=value_like.dtype,
                            device=value_like.device)
        if self.k_buf is not None and self.length:
            k[:, :, : self.length] = self.k_buf[:, :, : self.length]
            v[:, :, : self.length] = self.v_buf[:, :, : self.length]
        self.k_buf, self.v_buf = k, v
        self.device = k.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [rows, kv_heads, n, head_dim], written at positions length..length+n-1; returns
        the keys and values of positions 0..length+n-1."""
        fixed = self.owner.fixed
        if fixed is not None:  # a fixed-shape forward (graph_runner.py): positions and width from its static buffers
            write, width = fixed  # [n] device int64, W
            self.k_buf.index_copy_(2, write, key_states)
            self.v_buf.index_copy_(2, write, value_states)
            return self.k_buf[:, :, :width], self.v_buf[:, :, :width]
        n = key_states.shape[-2]
        end = self.length + n
        if self.k_buf is None:
            self.allocate(key_states, value_states, bucketed(max(end, self.owner.reserved), self.owner.bucket))
        elif end > self.capacity:  # not reserved: grow to twice the need (amortised; never inside a captured forward)
            self.allocate(key_states, value_states, bucketed(2 * end, self.owner.bucket))
        self.k_buf[:, :, self.length: end] = key_states
        self.v_buf[:, :, self.length: end] = value_states
        self.length = end
        return self.k_buf[:, :, :end], self.v_buf[:, :, :end]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"StaticLayer.crop takes a negative count of positions to remove, not {tokens_to_remove}")
        self.length = max(self.length + tokens_to_remove, 0)

    def reset(self) -> None:
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.k_buf is not None:
            self.k_buf = self.k_buf.repeat_interleave(repeats, dim=0)
            self.v_buf = self.v_buf.repeat_interleave(repeats, dim=0)


class StaticKVCache(Cache):
    """A transformers ``Cache`` of preallocated per-layer buffers for one sequence (or several rows of the same
    length: the forward profile); module docstring. ``reserve(positions)`` sizes the buffers ahead of the forwards;
    ``bucket``: capacities are multiples of it."""

    def __init__(self, config, *, reserve: int = 0, bucket: int = RESERVATION_BUCKET, name: str | None = None):
        super().__init__(layers=[])
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * int(cfg.num_hidden_layers))
        unsupported = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            model = name or getattr(config, "_name_or_path", None) or type(config).__name__
            raise NotImplementedError(f"{model}: metasd's KV cache holds {list(SUPPORTED_LAYER_TYPES)} layers; this "
                                      f"model has {unsupported}")
        window = getattr(cfg, "sliding_window", None)
        self.layers = [StaticLayer(self, window if t == "sliding_attention" else None) for t in types]
        self.bucket = bucket
        self.reserved = 0
        #: set by a fixed-shape forward (``graph_runner.py``) while it runs: (write positions [n] on the device, the
        #: attended width W); each layer then writes there and returns ``[:, :, :W]``, leaving the lengths to the runner
        self.fixed: tuple[torch.Tensor, int] | None = None
        if reserve:
            self.reserve(reserve)

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` positions (rounded up to the bucket) in every layer allocated so far; layers not
        allocated yet are allocated that wide at their first forward."""
        self.reserved = max(self.reserved, bucketed(positions, self.bucket))
        for layer in self.layers:
            if layer.k_buf is not None and layer.capacity < self.reserved:
                layer.allocate(layer.k_buf, layer.v_buf, self.reserved)

    @property
    def capacity(self) -> int:
        return min((layer.capacity for layer in self.layers), default=0)

    @property
    def allocated(self) -> bool:
        return all(layer.k_buf is not None for layer in self.layers)

    def allocate(self, geometry: KVGeometry, rows: int = 1) -> None:
        """Allocate the layers not allocated yet, ``reserved`` positions wide (a fixed-shape forward's cache is never
        allocated inside the forward)."""
        like = torch.empty(rows, geometry.kv_heads, 0, geometry.head_dim, dtype=geometry.dtype, device=geometry.device)
        for layer in self.layers:
            if layer.k_buf is None:
                layer.allocate(like, like, max(self.reserved, self.bucket))

    def set_length(self, length: int) -> None:
        """Every layer holds ``length`` positions (after a fixed-shape forward wrote them; or 0: reuse the buffers for
        a new sequence)."""
        if length > self.capacity:
            raise ValueError(f"StaticKVCache: a length of {length} positions; the buffers hold {self.capacity}")
        for layer in self.layers:
            layer.length = length

    def buffers(self) -> tuple:
        """The buffers' addresses and shapes (``buffer_keys``): a captured graph is recaptured when they change."""
        return buffer_keys(t for layer in self.layers for t in (layer.k_buf, layer.v_buf))

    def copy_prefix(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Positions 0..length-1 of every layer (of row 0) copied out: keys and values [kv_heads, length, head_dim]."""
        if length > self.get_seq_length():
            raise ValueError(f"StaticKVCache: {length} positions asked for; it holds {self.get_seq_length()}")
        return ([layer.k_buf[0, :, :length].clone() for layer in self.layers],
                [layer.v_buf[0, :, :length].clone() for layer in self.layers])

    def load_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Start the sequence with the first ``length`` positions of ``copy_prefix``'s keys and values (of a cache of
        the same model): written at 0..length-1 of every layer, the length set to ``length``."""
        self.reserve(length)
        for layer, k, v in zip(self.layers, keys, values):
            if layer.k_buf is None:
                layer.allocate(k[None], v[None], max(self.reserved, self.bucket))
            layer.k_buf[0, :, :length] = k[:, :length]
            layer.v_buf[0, :, :length] = v[:, :length]
        self.set_length(length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    @property
    def is_compileable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"StaticKVCache(layers={len(self.layers)}, length={self.get_seq_length()}, capacity={self.capacity})"


def new_cache(model: torch.nn.Module, reserve: int = 0, name: str | None = None) -> StaticKVCache:
    """The KV cache every single-sequence forward of ``model`` runs with (the verifier's, a drafter's, a profile's)."""
    return StaticKVCache(model.config, reserve=reserve, name=name)
