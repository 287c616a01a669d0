"""Weight-only quantization of a loaded model's linear layers (int8 per channel, int4 per group).

A drafter's output only has to be good, not exact - the verifier decides every token - so drafters may
run on quantized weights at no cost to losslessness. A quantized *verifier* changes the target: the
output is then exactly the quantized model's (what ``metasd`` reproduces is whatever the verifier
computes).

``quantize_model(model, "int8" | "int4", name=...)`` swaps every ``nn.Linear`` inside the decoder layers
and the LM head for a ``QuantizedLinear`` holding the quantized weight, once, in place, after loading.
Embedding tables stay as they are (a tied LM head gets its own quantized copy; the embedding lookup
keeps the original weight). A model quantized once records it (``model.metasd_quantize``) and refuses a
second, different quantization, so a model shared by two arms is never quantized twice or behind the
other arm's back.

Kernels (chosen by the device of the weight, not by a flag):

* CPU: torch's own ``aten._weight_int8pack_mm`` (int8 weight, per-output-channel bf16/fp32 scale) and
  ``aten._weight_int4pack_mm_for_cpu`` (int4 weight, groups of ``group_size`` along the input with a
  scale and a zero each). Measured on a 2-core AVX512-BF16 CPU with Qwen2.5-0.5B (BENCHMARKS.md): the
  one-token forward is 2.1x cheaper in int8 than in bf16, while torchao 0.18's
  ``Int8WeightOnlyConfig`` made it 2.6x *slower* (its CPU path dequantizes in Python-level ops), so
  the library path is not used on CPU. These kernels are built for matrix-vector work: for many rows
  (a prompt prefill) they lose to a bf16 GEMM, so above ``gemm_rows`` input rows an int8 layer
  dequantizes its weight and uses the dense matmul instead (the same weights, faster). A verifier's int4
  layer runs its kernel on every input (its output must be one model's). A drafter's quantized layer
  (``prefill_copy=True``) keeps its original dense weight beside the codes and uses it above a crossover
  measured on the machine at load (``dense_crossover``): on a 2-core CPU with AMX, one thread, the int4
  0.5B's forward grows 13 ms a token (49 ms at 1 token, 454 ms at 32, 1.7 s at 128) while the bf16 one
  stays near flat (131 ms at 1, 157 ms at 32, 319 ms at 128), so batched drafting rounds of many rows and
  prompt catch-ups run dense, single-row drafting on the codes. The int8 copy it kept before had to be
  dequantized on every forward (1.15 s at 128 tokens there).
  Both kernels are fast for bf16 activations only: with fp32 or fp16 ones they run 15-90x slower (896 x
  4864 layer, 8 rows: int4 31 ms fp32 / 40 ms fp16 against 0.5 ms bf16; int8 16 / 18 ms against 0.5 ms),
  so on CPU a quantized layer of an fp32 or fp16 model casts its input to bf16 for the kernel (its scales
  are stored in bf16) and its output back to the model's dtype. What such a layer computes is fixed (the
  same every call), so a quantized fp32 verifier is still one model that metasd reproduces exactly.
* CUDA: int4 through ``aten._weight_int4pack_mm`` (the tensor-core "tinygemm" kernel that torchao's
  int4 weight-only config itself dispatches to), int8 as ``linear(x, W_int8.to(x.dtype)) * scale``
  (gpt-fast's weight-only int8 form, which ``torch.compile`` fuses). Not measured in this project yet.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZE_MODES", "QuantizedLinear", "check_quantize", "dense_weight", "quantize_model"]

QUANTIZE_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: int4 group size: 32 input columns per scale/zero. On Qwen2.5-Coder-0.5B (teacher-forced, 600 ShareGPT
#: tokens) top-1 agreement with the bf16 model is 0.857 / 0.893 / 0.912 at groups of 128 / 64 / 32 (int8: 0.990),
#: for the same one-token forward time (27-29 ms), so the smallest group the kernel takes is the default
INT4_GROUP_SIZE = 32
#: int4 CPU kernel: inner K tiles of the packed layout (torch's tests and torchao use 8 on CPU)
_INNER_K_TILES = 8
#: int8 on CPU: above this many input rows (prompt prefills) a dense matmul over the weight dequantized
#: on the fly is faster than the matrix-vector kernel, whose cost grows linearly with the rows (0.5B,
#: 700-token prefill: 1.95 s against 3.83 s). Verify-sized inputs stay on the kernel: dequantizing every
#: layer per forward costs more than the kernel there (1.5B, 16 rows: 2.08 s dense against 0.47 s kernel;
#: BENCHMARKS.md, forward cost), so the switch sits above any draft tree this project verifies.
DEFAULT_GEMM_ROWS = 64
#: input rows at which ``dense_crossover`` times a drafter layer's two paths (it stops once the dense one has won
#: twice in a row); where the dense path never wins, it takes inputs above the largest count (long prefills)
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: rows of a weight quantized at a time (bounds the fp32 temporaries: peak memory stays near the model's)
_CHUNK_ROWS = 4096
#: weights above this many elements (an LM head) cost more to dequantize (200 ms for 151936 x 896):
#: their crossover is at 4x as many rows
_LARGE_WEIGHT = 1 << 25


def check_quantize(mode: str | None, *, name: str, field: str = "quantize", dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> str:
    """Validate a ``quantize`` value for model ``name`` before any long work; return the mode.

    Errors name the model and the field: an unknown value, or a kernel the device/dtype lacks
    (int4 on CPU needs bf16/fp16/fp32 activations; on CUDA it needs bf16).
    """
    mode = "none" if mode is None else mode
    if not isinstance(mode, str) or mode not in QUANTIZE_MODES:
        raise ValueError(f"{name}: {field} must be one of {', '.join(map(repr, QUANTIZE_MODES))}, got {mode!r}")
    if mode == "none":
        return mode
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: {field}={mode!r} has no kernel on device {dev.type!r} (cpu and cuda have)")
    if dtype is not None:
        if mode == "int4" and dev is not None and dev.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError(f"{name}: {field}='int4' on CUDA needs dtype bf16 (the int4 kernel's activations), got {dtype}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name}: {field}={mode!r} needs a bf16, fp16 or fp32 model, got {dtype}")
    return mode


# ------------------------------------------------------------------------------------------------ int8


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: W ~= q * s.

    weight: [out, in] float. Returns q [out, in] int8 and s [out] float32 (max |W| of the row / 127).
    """
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _CHUNK_ROWS):  # fp32 temporaries of a few MB, not of the whole matrix
        w = weight[start:start + _CHUNK_ROWS].detach().float()
        s = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [rows]
        q[start:start + _CHUNK_ROWS] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[start:start + _CHUNK_ROWS] = s
    return q, scale


# ------------------------------------------------------------------------------------------------ int4


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group_size`` input columns: W ~= q * s + min, q in 0..15.

    weight: [out, in] float, ``in`` divisible by ``group_size``. Returns q [out, in] int32 and
    scales_and_zeros [in / group_size, out, 2] float32 in the layout of torch's int4 kernels, whose
    dequantization is ``(q - 8) * scale + zero``, so zero = min + 8 * scale.
    """
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"int4: input size {in_f} is not a multiple of the group size {group_size}")
    q = torch.empty(weight.shape, dtype=torch.int32, device=weight.device)
    sz = torch.empty(out_f, in_f // group_size, 2, dtype=torch.float32, device=weight.device)  # [out, groups, 2]
    for start in range(0, out_f, _CHUNK_ROWS):  # fp32 temporaries of a few MB, not of the whole matrix
        w = weight[start:start + _CHUNK_ROWS].detach().float().reshape(-1, in_f // group_size, group_size)
        lo = w.amin(dim=-1, keepdim=True)
        scale = (w.amax(dim=-1, keepdim=True) - lo).clamp(min=1e-6) / 15.0
        q[start:start + _CHUNK_ROWS] = torch.round((w - lo) / scale).clamp_(0, 15).to(torch.int32).reshape(-1, in_f)
        sz[start:start + _CHUNK_ROWS] = torch.cat([scale, lo + 8.0 * scale], dim=-1)  # zero = min + 8 * scale
    return q, sz.transpose(0, 1).contiguous()  # [groups, out, 2]


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of ``quantize_int4`` (q [out, in] int32) -> [out, in] float32."""
    out_f, in_f = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
    w = (q.float().reshape(out_f, in_f // group_size, group_size) - 8.0) * sz[..., :1] + sz[..., 1:]
    return w.reshape(out_f, in_f)


def _pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q [out, in] int32 in 0..15 -> the kernel's packed layout on ``device``."""
    if device.type == "cuda":
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)  # two nibbles per byte
        return torch.ops.aten._convert_weight_to_int4pack(packed, _INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), _INNER_K_TILES)


# ------------------------------------------------------------------------------------------------ kernels
# Each takes the layer and x2 [rows, in] (model dtype) and returns [rows, out].


def _int8_cpu(layer: "QuantizedLinear", x2: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x2, layer.qweight, layer.scales)


def _int8_cuda(layer: "QuantizedLinear", x2: torch.Tensor) -> torch.Tensor:
    return F.linear(x2, layer.qweight.to(x2.dtype)) * layer.scales  # y = (x W_q^T) * s, per output channel


def _int4_cpu(layer: "QuantizedLinear", x2: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.qweight, layer.group_size, layer.scales_and_zeros)


def _int4_cuda(layer: "QuantizedLinear", x2: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x2, layer.qweight, layer.group_size, layer.scales_and_zeros)


KERNELS = {("cpu", "int8"): _int8_cpu, ("cuda", "int8"): _int8_cuda,
           ("cpu", "int4"): _int4_cpu, ("cuda", "int4"): _int4_cuda}


def kernel_for(device: torch.device, mode: str):
    """The matmul kernel for weights of ``mode`` on ``device`` (chosen by the device type, never by a flag)."""
    try:
        return KERNELS[(torch.device(device).type, mode)]
    except KeyError:
        raise ValueError(f"no {mode} kernel for device {torch.device(device).type!r} (cpu and cuda have one)") from None


# ------------------------------------------------------------------------------------------------ module


class QuantizedLinear(nn.Module):
    """A weight-only quantized ``nn.Linear``: y = x W^T + b with W stored in int8 or int4.

    Activations and the output keep the model's dtype. ``dense_weight()`` returns the dequantized W
    (what the layer computes with), for code that needs the matrix itself (reduced-vocabulary heads).
    ``prefill_copy`` (a drafter's layer, CPU): keep the original weight too and compute inputs of more than
    ``dense_rows`` rows with it (None: the crossover timed on this machine, ``dense_crossover``).
    """

    def __init__(self, linear: nn.Linear, mode: str, group_size: int = INT4_GROUP_SIZE,
                 gemm_rows: int = DEFAULT_GEMM_ROWS, prefill_copy: bool = False, dense_rows: int | None = None):
        super().__init__()
        if mode not in ("int8", "int4"):
            raise ValueError(f"QuantizedLinear: mode must be 'int8' or 'int4', got {mode!r}")
        weight = linear.weight.detach()
        self.mode = mode
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = weight.dtype
        device = weight.device
        # the dtype of the kernel's activations and scales: bf16 on CPU, where the kernels are only fast for bf16
        self.kernel_dtype = torch.bfloat16 if device.type == "cpu" else self.dtype
        self.group_size = group_size
        self.gemm_rows = gemm_rows
        self._dense_rows = gemm_rows * (4 if linear.weight.numel() > _LARGE_WEIGHT else 1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        if mode == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("qweight", q.to(device))  # [out, in] int8
            self.register_buffer("scales", scale.to(device=device, dtype=self.kernel_dtype))  # [out]
        else:
            if self.in_features % group_size:
                raise ValueError(f"int4: input size {self.in_features} is not a multiple of group size {group_size}")
            q, sz = quantize_int4(weight, group_size)
            self.register_buffer("qweight", _pack_int4(q, device))  # kernel layout
            self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=self.kernel_dtype))  # [groups, out, 2]
            # The packed layout is the kernel's own; dense_weight() recovers W through the kernel itself.
        if prefill_copy and device.type == "cpu":
            # Drafters only: the original weight for inputs of many rows (batched drafting rounds, catch-ups),
            # above the rows where it beats the kernel on this machine. A verifier never keeps one: its output
            # must be one model's.
            self.register_buffer("gemm_dense", weight)  # [out, in], the model's dtype
            self._dense_rows = int(dense_rows) if dense_rows is not None else dense_crossover(self)

    @property
    def weight_format(self) -> str:
        """"int8" or "int4": the format the step cost model prices this layer's rows at (``metasd.core.pricing.cost``)."""
        return self.mode

    @property
    def kernel_bytes(self) -> int:
        """Bytes the quantized kernel reads per forward: codes and scales, not the many-row path's dense copy."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if not n.startswith("gemm_"))

    @property
    def weight_bytes(self) -> int:
        """Bytes of every stored weight tensor (codes, scales, a drafter layer's dense copy)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def has_gemm_path(self) -> bool:
        """Whether inputs of more than ``dense_rows`` rows use a dense matmul (CPU only): a drafter's kept weight, or
        an int8 layer's weight dequantized."""
        return self.qweight.device.type == "cpu" and (self.mode == "int8" or self.has_dense_copy)

    @property
    def has_dense_copy(self) -> bool:
        """Whether the layer keeps its original dense weight for many-row inputs (a drafter's, ``prefill_copy``)."""
        return hasattr(self, "gemm_dense")

    @property
    def dense_rows(self) -> int:
        """Inputs of more rows than this take the dense matmul (where ``has_gemm_path``)."""
        return self._dense_rows

    def gemm_weight(self) -> torch.Tensor:
        """The dense weight [out, in] of the many-row path: the kept original weight, else the int8 codes
        dequantized (a new tensor)."""
        if self.has_dense_copy:
            return self.gemm_dense
        return self.qweight.to(self.dtype) * self.scales.to(self.dtype)[:, None]

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [rows, in] in the model dtype -> [rows, out] in the model dtype, through the quantized kernel of
        its device (activations cast to ``kernel_dtype`` and back where the two differ)."""
        y = kernel_for(x2.device, self.mode)(self, x2.to(self.kernel_dtype))
        return y.to(self.dtype)

    def dense_weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] of the kernel path, in the model dtype (a new tensor)."""
        if self.mode == "int8":
            return self.gemm_weight()
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.qweight.device)
        return self._kernel(eye).t().contiguous()  # rows of I W^T are columns of W^T

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if len(x2) > self._dense_rows and self.has_gemm_path and x2.device.type == "cpu":
            # many rows: a dense GEMM beats the matrix-vector kernel (an int8 layer without a dense copy
            # dequantizes first: one pass over W)
            y = F.linear(x2, self.gemm_weight())
        else:
            y = self._kernel(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{extra}"


_crossovers: dict[tuple, int] = {}


def dense_crossover(layer: QuantizedLinear, reps: int = 3) -> int:
    """The input rows above which ``layer``'s dense copy beats its quantized kernel on this machine. Both paths are
    timed (best of ``reps`` after a warm-up) at each of ``CROSSOVER_ROWS`` until the dense one has won at two
    counts in a row; the answer is the last count the kernel won (0: the dense path from one row). Timed once per (device, mode, group size, shape, dtype, threads) in a
    process: every layer of one shape shares it."""
    key = (layer.qweight.device.type, layer.mode, layer.group_size, layer.in_features, layer.out_features,
           layer.dtype, torch.get_num_threads())
    if key not in _crossovers:
        kernel_won, streak = 0, 0
        with torch.no_grad():
            for rows in CROSSOVER_ROWS:
                x = torch.randn(rows, layer.in_features, dtype=layer.dtype, device=layer.qweight.device)
                kernel = _best_seconds(lambda: layer._kernel(x), reps)
                dense = _best_seconds(lambda: F.linear(x, layer.gemm_dense), reps)
                streak, kernel_won = (streak + 1, kernel_won) if dense < kernel else (0, rows)
                if streak == 2:
                    break
        _crossovers[key] = kernel_won
        logger.info("%s %d -> %d (%s, %d threads): dense above %d rows", layer.mode, layer.in_features,
                    layer.out_features, layer.dtype, torch.get_num_threads(), kernel_won)
    return _crossovers[key]


def _best_seconds(fn, reps: int) -> float:
    fn()  # warm-up: first-call allocations and packing
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The weight matrix [out, in] of an ``nn.Linear`` or a ``QuantizedLinear`` (dequantized)."""
    if isinstance(module, QuantizedLinear):
        return module.dense_weight()
    return module.weight


# ------------------------------------------------------------------------------------------------ models


def _targets(model: nn.Module) -> Iterable[tuple[nn.Module, str, str, nn.Linear]]:
    """(parent, attribute, qualified name, linear) for every plain nn.Linear of the model (LM head included)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                yield module, child_name, f"{name}.{child_name}" if name else child_name, child


def int4_group_size(in_features: int, preferred: int = INT4_GROUP_SIZE) -> int | None:
    """The largest group size <= ``preferred`` from ``INT4_GROUP_SIZES`` dividing ``in_features`` (None: none does)."""
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= preferred and in_features % g == 0:
            return g
    return None


def _int4_problem(linear: nn.Linear, device: torch.device, preferred: int) -> str | None:
    """Why the int4 kernel of ``device`` cannot take this layer, or None."""
    if int4_group_size(linear.in_features, preferred) is None:
        return f"input size {linear.in_features} is not a multiple of 32"
    if device.type == "cpu" and linear.out_features % 16:
        return f"output size {linear.out_features} is not a multiple of 16 (CPU int4 kernel)"
    if device.type == "cuda" and (linear.in_features % (_INNER_K_TILES * 16) or linear.out_features % 8):
        return (f"sizes {linear.in_features} -> {linear.out_features}: the CUDA int4 kernel needs the input size to be "
                f"a multiple of {_INNER_K_TILES * 16} and the output size of 8")
    return None


def _own_memory(model: nn.Module) -> None:
    """Copy the tensors left unquantized (embeddings, norms, biases) into memory of their own.

    transformers may load safetensors weights as views of one memory-mapped file; while any of them
    (the embedding table) still points into it, the whole mapping - the replaced bf16 weights included -
    stays resident. Owning the survivors lets the file go, so quantizing lowers the process's memory.
    Tensors that are one (a tied LM head's dense copy and the embedding table) stay one copy.
    """
    copies: dict[tuple, torch.Tensor] = {}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
                if key not in copies:
                    copies[key] = t.data.clone()
                t.data = copies[key]


def quantize_model(model: nn.Module, mode: str, *, name: str = "model", group_size: int = INT4_GROUP_SIZE,
                   gemm_rows: int = DEFAULT_GEMM_ROWS, prefill_copy: bool = False,
                   dense_rows: int | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (LM head included) by a ``QuantizedLinear``, in place.

    ``mode`` "none" returns the model untouched. Quantizing a model already quantized the same way is
    a no-op (models are shared between arms); a different mode is an error naming ``name``. The model's
    ``metasd_quantize`` attribute records the mode. int4 uses groups of ``group_size`` input columns
    (smaller, down to 32, where a layer's input size needs it); a layer the kernel cannot take is an
    error naming it, raised before any layer is changed. ``prefill_copy`` (drafters only): every layer keeps its
    dense weight for inputs of more rows than a crossover timed on this machine (``dense_crossover``), or than
    ``dense_rows`` where given.
    """
    param = next(model.parameters(), None)
    mode = check_quantize(mode, name=name, dtype=None if param is None else param.dtype,
                          device=None if param is None else param.device)
    done = getattr(model, "metasd_quantize", "none")
    if mode == "none" or mode == done:
        return model
    if done != "none":
        raise ValueError(f"{name}: already quantized as {done!r}; it cannot also be {mode!r} "
                         "(load a second copy for the other setting)")
    targets = list(_targets(model))
    if mode == "int4":
        for _, _, qualified, linear in targets:
            problem = _int4_problem(linear, linear.weight.device, group_size)
            if problem:
                raise ValueError(f"{name}: quantize='int4' cannot take layer {qualified!r}: {problem}; use 'int8'")
    for parent, attr, _, linear in targets:
        g = int4_group_size(linear.in_features, group_size) if mode == "int4" else group_size
        setattr(parent, attr, QuantizedLinear(linear, mode, group_size=g, gemm_rows=gemm_rows, prefill_copy=prefill_copy,
                                              dense_rows=dense_rows))
    _own_memory(model)
    model.metasd_quantize = mode
    logger.info("%s: %d linear layers quantized to %s", name, len(targets), mode)
    return model
