"""A deterministic cost model of a step, so that the throughput reward does not read the wall clock.

The bandit's throughput reward is committed tokens per unit of cost. Measured in seconds, the cost
carries the machine's timing noise into the policy: two runs of one greedy command pick different
drafters, verify different trees, and bf16 near-ties then flip different tokens. Here the cost of a
step is *modeled* from the work it did instead (docs/algorithms.md#rewards):

    cost(linear forward over r rows) = weight_bytes + row_cost[format] * in_features * out_features * r

summed over every linear layer of the verifier and the drafters that ran during the step, in units of one decode step
of the verifier (its linears over one row), so that plain decoding costs 1.0 per token and the reward reads as a
modeled speedup over it. Nothing runs per linear layer while decoding: a transformers model is priced per forward
from its shape (a pre-hook on its decoder body: rows = input tokens, times the body's summed per-row price, plus its
weights; one on the causal LM for its head: the rows ``logits_to_keep`` keeps), as the counterfactual prices are
(``ForwardCost``). Only linear layers outside such a model (a drafter's own small networks) are counted by a
pre-hook each.

The first term is the weights a memory-bound forward streams; the second the per-row multiply work,
whose price depends on the kernel the weight format runs on. Attention over the context, embeddings
lookups and Python overhead are not modeled. Every term depends only on the models and on the shapes
of the step, so the same command gives the same costs, choices and tokens on every run.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

#: CPU calibration (benchmarks/forward_cost.py, BENCHMARKS.md "Forward cost per model and weight
#: quantization"): a bf16 verify costs ~0.02-0.03 of a one-token forward per extra row, the int4 and int8
#: weight-only kernels ~0.2-0.3 (they are matrix-vector kernels: every row re-reads its weights).
#: In bytes-equivalent per multiply-accumulate per row.
CPU_ROW_COST = {"dense": 0.06, "int8": 0.3, "int4": 0.2}
#: On CUDA a forward of a few dozen rows is bound by the weights it reads, whatever their format. A guess, not a
#: measurement: no GPU has calibrated it yet (benchmarks/gpu_check.py times forwards of 1-32 rows on one; until then
#: every CUDA reward that weighs rows against weights rests on these numbers).
CUDA_ROW_COST = {"dense": 0.004, "int8": 0.01, "int4": 0.01}


@dataclass(frozen=True)
class CostModel:
    """Prices of the two terms of a linear layer's forward (see the module docstring).

    row_cost: bytes-equivalent per multiply-accumulate per row, by weight format ("dense" for an
    ``nn.Linear`` in any float dtype, "int8" / "int4" for ``metasd.models.quantize.QuantizedLinear``).
    """

    row_cost: Mapping[str, float] = field(default_factory=lambda: dict(CPU_ROW_COST))

    @classmethod
    def for_device(cls, device: torch.device | str) -> "CostModel":
        """The calibrated default for a device type (CUDA or anything else)."""
        return cls(dict(CUDA_ROW_COST if torch.device(device).type == "cuda" else CPU_ROW_COST))

    def linear_cost(self, weight_bytes: float, macs_per_row: float, fmt: str, rows: int) -> float:
        return weight_bytes + self.row_cost[fmt] * macs_per_row * rows


@dataclass(frozen=True)
class _LinearShape:
    weight_bytes: int
    in_features: int
    macs_per_row: int  # in_features * out_features
    fmt: str
    dense_rows: int | None = None  # inputs of more rows run on a dense copy of the weight (a drafter's layer)
    dense_bytes: int = 0  # that copy's bytes


def _linear_shape(module: nn.Module) -> _LinearShape | None:
    """The costed shape of a linear layer, or None for any other module.

    A layer with its own weight format says so through two attributes (``metasd.models.quantize.QuantizedLinear``
    does): ``weight_format`` (a key of ``CostModel.row_cost``) and ``kernel_bytes`` (the bytes its kernel reads),
    beside ``in_features`` and ``out_features``; one that keeps a dense copy for many-row inputs also
    ``has_dense_copy``, ``dense_rows`` and ``gemm_weight()`` - rows above ``dense_rows`` are costed as that copy's.
    """
    fmt = getattr(module, "weight_format", None)
    if isinstance(fmt, str):
        macs = module.in_features * module.out_features
        if getattr(module, "has_dense_copy", False):
            return _LinearShape(int(module.kernel_bytes), module.in_features, macs, fmt, int(module.dense_rows),
                                _nbytes(module.gemm_weight()))
        return _LinearShape(int(module.kernel_bytes), module.in_features, macs, fmt)
    if isinstance(module, nn.Linear):
        nbytes = _nbytes(module.weight, module.bias)
        return _LinearShape(nbytes, module.in_features, module.in_features * module.out_features, "dense")
    return None


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _OpenMeter(threading.local):
    meter: "StepMeter | None" = None


_OPEN = _OpenMeter()
_SHAPE_ATTR = "_metasd_cost_shape"  # a hooked layer's costed shape (a plain attribute, refreshed by attach)


def _count(module: nn.Module, args: tuple) -> None:
    meter = _OPEN.meter
    if meter is None or not args or not isinstance(args[0], torch.Tensor):
        return
    shape: _LinearShape = getattr(module, _SHAPE_ATTR)
    rows = args[0].numel() // shape.in_features  # x: [..., in_features]; numel is shape metadata, no device sync
    if shape.dense_rows is not None and rows > shape.dense_rows:  # the layer's dense copy computes these
        meter.total += meter.model.linear_cost(shape.dense_bytes, shape.macs_per_row, "dense", rows)
    else:
        meter.total += meter.model.linear_cost(shape.weight_bytes, shape.macs_per_row, shape.fmt, rows)


def counted_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that an open step meter counts, for networks that keep raw weight tensors instead of
    ``nn.Linear`` layers (a drafter's reduced LM head, stacked block heads). weight: [out, in]."""
    meter = _OPEN.meter
    if meter is not None:
        rows = x.numel() // weight.shape[1]
        meter.total += meter.model.linear_cost(_nbytes(weight, bias), weight.numel(), "dense", rows)
    return F.linear(x, weight, bias)


def _shaped_layers(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, _LinearShape]]:
    """Every distinct linear layer inside ``modules`` with its costed shape, shared layers once."""
    seen: dict[int, tuple[nn.Module, _LinearShape]] = {}
    for root in modules:
        for m in root.modules():
            if id(m) not in seen and (shape := _linear_shape(m)) is not None:
                seen[id(m)] = (m, shape)
    return list(seen.values())


def linear_layers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every distinct linear layer (dense or quantized) inside ``modules``, shared layers once."""
    return [layer for layer, _ in _shaped_layers(modules)]


_UNIT_ATTR = "_metasd_cost_unit"  # a priced body's or causal LM's ForwardCost (refreshed by attach)


def _input_rows(args: tuple, kwargs: dict) -> int:
    """Token positions of a transformers forward: ``input_ids`` [batch, seq] or ``inputs_embeds`` [batch, seq, d]
    (shape metadata: no device sync)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    return embeds.numel() // embeds.shape[-1] if isinstance(embeds, torch.Tensor) else 0


def _count_body(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A decoder body's forward: every linear layer in it runs over each input position."""
    meter = _OPEN.meter
    if meter is not None:
        meter.total += getattr(module, _UNIT_ATTR)(_input_rows(args, kwargs))


def _count_head(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A causal LM's forward: its head runs over the positions ``logits_to_keep`` keeps (0: all; n: the last n; a
    tensor: the positions it lists); its body is counted by ``_count_body``."""
    meter = _OPEN.meter
    if meter is None:
        return
    rows = _input_rows(args, kwargs)
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor):
        rows = keep.numel() if keep.dtype != torch.bool else rows  # a boolean mask: priced as every row
    elif keep:
        rows = min(int(keep), rows)
    meter.total += getattr(module, _UNIT_ATTR)(rows)


def _priced_units(modules: Iterable[nn.Module]) -> tuple[dict, dict]:
    """The transformers models inside ``modules`` priced per forward: {id: decoder body} and {id: (causal LM, its
    head)}."""
    bodies: dict[int, nn.Module] = {}
    heads: dict[int, tuple[nn.Module, nn.Module]] = {}
    for root in modules:
        for m in root.modules():
            if not isinstance(m, PreTrainedModel) or id(m) in bodies or id(m) in heads:
                continue
            if m.base_model is m:
                bodies[id(m)] = m
            else:
                head = m.get_output_embeddings()
                if head is not None and _linear_shape(head) is not None and not _inside(head, m.base_model):
                    heads[id(m)] = (m, head)
    return bodies, heads


def _inside(module: nn.Module, root: nn.Module) -> bool:
    return any(m is module for m in root.modules())


def attach(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Price the forwards of ``modules`` for an open ``StepMeter`` (once per module, for its lifetime): a transformers
    decoder body and a causal LM's head per forward, from their shapes (one pre-hook each), every other linear layer
    by a pre-hook of its own. Returns every linear layer so priced.

    The hooks do nothing unless a ``StepMeter`` is open on this thread, so models shared by several engines
    (``Engine.derive``) or called outside a step (prefill) cost nothing to the meter. Each call re-reads the layers'
    shapes (a layer whose weights changed since is priced as it is now), priced by the open meter's ``CostModel``."""
    modules = list(modules)
    bodies, heads = _priced_units(modules)
    covered: set[int] = set()
    for body in bodies.values():
        covered |= {id(layer) for layer, _ in _shaped_layers([body])}
        _unit(body, _count_body, [body])
    for lm, head in heads.values():
        covered.add(id(head))
        _unit(lm, _count_head, [head])
    shaped = _shaped_layers(modules)
    for layer, shape in shaped:
        if id(layer) in covered:
            continue
        object.__setattr__(layer, _SHAPE_ATTR, shape)  # not a submodule or buffer
        if not any(hook is _count for hook in layer._forward_pre_hooks.values()):  # a deep copy keeps its hook
            layer.register_forward_pre_hook(_count)
    return [layer for layer, _ in shaped]


def _unit(owner: nn.Module, hook, priced: list[nn.Module]) -> None:
    """Hook ``owner`` (once) with ``hook``, pricing its forwards by the linear layers of ``priced``."""
    object.__setattr__(owner, _UNIT_ATTR, _PricedUnit(priced))
    if not any(h is hook for h in owner._forward_pre_hooks.values()):  # a deep copy keeps its hook
        owner.register_forward_pre_hook(hook, with_kwargs=True)


class _PricedUnit:
    """The linear layers of a priced unit; their ``ForwardCost`` under the open meter's prices (cached per model)."""

    def __init__(self, modules: list[nn.Module]):
        self.shapes = [s for _, s in _shaped_layers(modules)]
        self._costs: dict[int, tuple[CostModel, ForwardCost]] = {}

    def __call__(self, rows: int) -> float:
        meter = _OPEN.meter
        cached = self._costs.get(id(meter.model))
        if cached is None or cached[0] is not meter.model:
            cached = self._costs[id(meter.model)] = (meter.model, ForwardCost.of_shapes(self.shapes, meter.model))
        return cached[1](rows)


@dataclass(frozen=True)
class ForwardCost:
    """The modeled cost of one forward of a network, from its linear layers' shapes alone: ``fixed + per_row * rows``
    (the weights it streams, and the per-row work of each weight format), plus, for inputs of more rows than a
    layer's ``dense_rows`` (a drafter's quantized layer computing them on its dense copy), that layer's change of
    price: ``switches`` [(dense_rows, fixed, per_row)]. No hook runs: the price of a forward that did not happen (a
    counterfactual draft) or of a graph-captured one."""

    fixed: float
    per_row: float
    switches: tuple[tuple[int, float, float], ...] = ()

    @classmethod
    def of(cls, module: nn.Module, model: CostModel) -> "ForwardCost":
        return cls.of_shapes([s for _, s in _shaped_layers([module])], model)

    @classmethod
    def of_shapes(cls, shapes: Iterable[_LinearShape], model: CostModel) -> "ForwardCost":
        shapes = list(shapes)
        switches: dict[int, tuple[float, float]] = {}
        for s in shapes:
            if s.dense_rows is not None:
                fixed, per_row = switches.get(s.dense_rows, (0.0, 0.0))
                switches[s.dense_rows] = (fixed + s.dense_bytes - s.weight_bytes,
                                          per_row + (model.row_cost["dense"] - model.row_cost[s.fmt]) * s.macs_per_row)
        return cls(sum(s.weight_bytes for s in shapes), sum(model.row_cost[s.fmt] * s.macs_per_row for s in shapes),
                   tuple((rows, f, r) for rows, (f, r) in sorted(switches.items())))

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows + sum(f + r * rows for above, f, r in self.switches if rows > above)


def decode_step_cost(verifier_model: nn.Module, model: CostModel) -> float:
    """Modeled cost of one verifier forward over one row: the unit every step cost is expressed in."""
    total = sum(model.linear_cost(s.weight_bytes, s.macs_per_row, s.fmt, 1) for _, s in _shaped_layers([verifier_model]))
    if total <= 0:
        raise ValueError("the verifier has no linear layers to model the cost of a step with")
    return total


@contextmanager
def unmetered():
    """Nothing that runs inside is counted by the step meter open on this thread (if any): work a drafter does that
    is not part of the step it models (a replay drafter recording the verifier's continuation)."""
    meter, _OPEN.meter = _OPEN.meter, None
    try:
        yield
    finally:
        _OPEN.meter = meter


def open_meter() -> "StepMeter | None":
    """The step meter open on this thread (counting the forwards running now), or None."""
    return _OPEN.meter


class StepMeter:
    """Sums the modeled cost of the hooked linear forwards that run while it is open (``with meter:``); prices
    forwards that did not run from shapes (``price``)."""

    def __init__(self, model: CostModel, unit: float):
        self.model = model
        self.unit = unit  # cost of one verifier decode step
        self.total = 0.0
        self._forward_costs: dict[int, ForwardCost] = {}

    def price(self, module: nn.Module, rows: int) -> float:
        """Modeled cost of a forward of ``module`` over ``rows`` rows, in verifier decode steps (from shapes)."""
        cost = self._forward_costs.get(id(module))
        if cost is None:
            cost = self._forward_costs[id(module)] = ForwardCost.of(module, self.model)
        return cost(rows) / self.unit

    def add(self, module: nn.Module, rows: int) -> None:
        """Count a forward of ``module`` over ``rows`` positions that ran outside torch, where no hook sees it (the
        llama.cpp verifier backend, whose ``module`` is the model's shape on the meta device), as the hooks would."""
        self.total += self.price(module, rows) * self.unit

    def __enter__(self) -> "StepMeter":
        if _OPEN.meter is self:  # entered through ``resumed()``: keep counting
            return self
        if _OPEN.meter is not None:
            raise RuntimeError("a step meter is already open on this thread (nested engine steps?)")
        self.total = 0.0
        _OPEN.meter = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPEN.meter = None

    def resumed(self) -> "StepMeter":
        """Open again without resetting what was counted (``with meter.resumed():``): one step's cost counted in
        two parts (the drafting, then the verification) sums exactly as in one."""
        if _OPEN.meter is not None:
            raise RuntimeError("a step meter is already open on this thread (nested engine steps?)")
        _OPEN.meter = self
        return self

    @property
    def steps(self) -> float:
        """What was counted, in verifier decode steps."""
        return self.total / self.unit
