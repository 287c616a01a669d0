"""A second torch device for tests on a CPU-only machine: tensors on it live in CPU memory, but an op that mixes
them with (non-scalar) CPU tensors fails as it would on CUDA, so tests catch device bugs without a GPU.

    from second_device import capturing, count_host_reads, enable
    dev = enable()                          # torch.device("metasd_dev", 0); idempotent
    model = tiny_qwen().to(dev)
    x = torch.tensor([[1, 2, 3]], device=dev)
    model(x)                                # runs; equals the CPU result (within 1e-6: see "numerics")
    x + torch.ones(3)                       # RuntimeError: ... found at least two devices, metasd_dev:0 and cpu!
    with count_host_reads() as reads:       # every host-device synchronisation while it is open
        x.sum().item()                      # a read of device data by the host
        torch.tensor([4], device=dev)       # a blocking copy to the device
    assert reads.total == 2 and reads.reads == 1
    with capturing():                       # what CUDA refuses while it captures a graph raises CaptureError
        x.sum().item()                      # CaptureError: ... (item) while a CUDA graph is captured, at <line>

How it works. torch's PrivateUse1 backend is renamed ``metasd_dev`` and driven from Python:

- A tensor on the device is a ``DeviceTensor``: a wrapper subclass (``torch.Tensor._make_wrapper_subclass``,
  device ``metasd_dev:0``, no storage of its own) that holds its data in a CPU tensor (``.elem``, same sizes,
  strides and offset; views of a device tensor hold views of its CPU tensor, so they alias as on a GPU). Every
  aten op that touches one reaches ``DeviceTensor.__torch_dispatch__``; an op that names the device but touches
  none (``torch.zeros(..., device=dev)``, the first half of ``.to(dev)``) reaches the PrivateUse1 kernel that
  ``enable`` registers for every aten op. Both go to ``_run``: check the op's devices (CUDA's rule, below) and
  generators, count it if it is a host read, run it on the CPU tensors and wrap the results (an op that returns
  one of its arguments, in-place or ``out=``, gives that argument back, its sizes updated if the op resized it).
- CUDA's device rule: every tensor of an op is on the device, except (1) copies between devices (``copy_``,
  ``_to_copy``: ``.to``, ``.cpu()``), (2) 0-dim CPU tensors read as scalars: inputs of pointwise ops
  (TensorIterator; not ``masked_fill``'s mask), the value of ``masked_fill``/``fill_``/``index_put_``, (3) the
  indices of advanced indexing (``t[cpu_index]``, ``t[cpu_index] = v``), which CUDA moves to the device itself.
  Anything else raises a ``RuntimeError`` naming both devices (CUDA's "Expected all tensors to be on the same
  device"), the op and the argument.
- Random numbers: the device has its own default generator (seeded by ``torch.manual_seed``; CPU draws do not
  move it, as on CUDA), and ``torch.Generator(device=dev)`` makes a generator of the device (``torch.Generator``
  becomes a subclass that builds one; ``isinstance(g, torch.Generator)`` still holds for every generator). A
  random op on device tensors given a generator of another device raises, as on CUDA ("Expected a 'metasd_dev'
  device type for generator but found 'cpu'"), and so does a generator of the device given to a random op on
  the CPU ("Expected a 'cpu' device type for generator but found 'metasd_dev'": below Python that generator is a
  CPU one, so ``enable`` wraps torch's random functions and ``Tensor`` methods that take a generator,
  ``_GENERATOR_FUNCTIONS``, with that check). Unlike CUDA, a generator of the device seeded with s draws the
  numbers a CPU generator seeded with s draws, so a seeded computation on the device equals it on the CPU.
- Numerics: every op runs on the CPU, except that ``scaled_dot_product_attention`` takes its math path (torch
  gives a PrivateUse1 device no fused kernel): attention agrees with the CPU's to ~1e-7 in fp32, not bit for bit.
- ``CompositeImplicitAutograd`` ops (``linear``, ``item``, ``to``...) decompose before they reach a backend,
  except under ``torch.inference_mode()``, where they arrive whole; ``_run`` decomposes them then too, so the
  checks and the host-read count see the same ops in both modes.

Host-device synchronisations (``count_host_reads``, alias ``count_syncs``) are counted in the same dispatch layer:
one per op that hands device data to the host, one per blocking copy of host data to the device, and one per
``torch.metasd_dev.synchronize`` (what ``metasd.core.execution.clock`` calls); see ``count_host_reads`` for what is
counted and what cannot be seen.

Known gaps:
- A generator of the device given to a CPU op other than through the wrapped functions (``torch.ops.aten.*``
  called directly, a C++ extension) is used as a CPU generator, where CUDA raises.
- ``t.numpy()`` raises (as on CUDA); ``t.untyped_storage()`` and so ``torch.save`` of a device tensor raise;
  ``t.data_ptr()`` is 0 for every device tensor (a storage-less wrapper's, which torch's deepcopy relies on), so
  what keys on addresses (a graph runner's recapture check, ``buffer_keys``) sees only shapes change here; ``pin_memory()`` raises (the Python backend API gives no pinned allocator); ``non_blocking=True``
  copies are synchronous (nothing is asynchronous here, so missing synchronisations go unnoticed). A
  ``non_blocking=True`` copy to the device is not counted whatever its source; on CUDA it blocks unless the host
  memory is pinned, which ``metasd.core.execution.staging`` does there and which cannot be modelled here.
- One device (index 0); no streams, events, memory statistics or autocast. Autograd and optimizers work (a
  backward and an AdamW step are tested), nothing more of training is.
- ``enable`` is for the whole process and cannot be undone: torch then reports ``metasd_dev`` as its current
  accelerator (``torch.accelerator.current_accelerator()``), ``torch.Generator`` is the subclass above and the
  random functions are wrapped (a check of their generator argument, nothing else).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import traceback
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAME = "metasd_dev"
DEVICE: torch.device | None = None  # torch.device(NAME, 0), once enable() has renamed the backend
aten = torch.ops.aten

_lock = threading.RLock()
_enabled = False
_libraries: list = []  # the torch.library.Library objects holding the PrivateUse1 kernels (kept alive)


# ---------------------------------------------------------------------------------------------- the device tensor

class DeviceTensor(torch.Tensor):
    """A tensor on the second device: its data is the CPU tensor ``elem`` (same sizes, strides, offset, dtype)."""

    elem: torch.Tensor
    __slots__ = ["elem"]

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        if isinstance(elem, DeviceTensor) or elem.device.type != "cpu":
            raise TypeError(f"a DeviceTensor holds a CPU tensor, got a {type(elem).__name__} on {elem.device}")
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=DEVICE, requires_grad=False,
        )
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None):
        _record_host_read("print", "repr")
        text = repr(self.elem)
        return f"{text[:-1]}, device='{DEVICE}')" if text.endswith(")") else f"{text} (device='{DEVICE}')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:  # as torch.Tensor.__format__ does for a 0-dim tensor: its item (one host read)
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def tolist(self):
        """As on CUDA: a copy to the host (one host read, ``to_cpu``), then its list."""
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return self.cpu().numpy()
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")


def _is_fake_device(d) -> bool:
    if isinstance(d, str):
        return d.split(":")[0] == NAME
    return isinstance(d, torch.device) and d.type == NAME


# ------------------------------------------------------------------------------------------------ random numbers

_ORIG_GENERATOR = torch._C.Generator
_device_default_generator = None  # the device's default generator, a DeviceGenerator made by enable()


class _GeneratorMeta(type(_ORIG_GENERATOR)):
    def __call__(cls, device="cpu"):
        if cls is Generator and not _is_fake_device(device):
            return _ORIG_GENERATOR(device)
        return type.__call__(DeviceGenerator)

    def __instancecheck__(cls, obj):
        return isinstance(obj, _ORIG_GENERATOR) if cls is Generator else type.__instancecheck__(cls, obj)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _ORIG_GENERATOR) if cls is Generator else type.__subclasscheck__(cls, sub)


class Generator(_ORIG_GENERATOR, metaclass=_GeneratorMeta):
    """``torch.Generator`` once ``enable`` ran: ``Generator(device=dev)`` gives a ``DeviceGenerator``, any other
    device torch's own generator; ``isinstance(g, torch.Generator)`` holds for both."""


class DeviceGenerator(Generator):
    """A generator of the second device: a CPU generator underneath (same numbers for the same seed), whose
    ``device`` is the second device.

    An op does not get this object back: torch hands ``__torch_dispatch__`` its own Python object for the same C++
    generator (made at the first hand-over, then kept by torch and reused). That object, the generator's *twin*,
    is made here at once and remembered, so ``_run`` knows it for a generator of the device."""

    def __init__(self, device=None):
        super().__init__()
        self._twin = _twin_of(self)
        _device_twins.add(id(self._twin))
        weakref.finalize(self, _device_twins.discard, id(self._twin))

    @property
    def device(self) -> torch.device:
        return DEVICE

    def __repr__(self) -> str:
        return f"<DeviceGenerator on {DEVICE}>"


_device_twins: set = set()  # ids of the torch-made Python objects of the C++ generators of the device
_GENERATOR_TYPES = (_ORIG_GENERATOR, DeviceGenerator)


class _CaptureGenerators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += [x for x in _leaves(args, kwargs or {}) if isinstance(x, _ORIG_GENERATOR)]
        return args[0]  # nothing runs: the generator's state is untouched


def _twin_of(g: torch.Generator) -> torch.Generator:
    """The object an op's ``__torch_dispatch__`` gets for ``g`` (one op on an empty CPU tensor, not run)."""
    empty = torch.empty(0)
    with _CaptureGenerators() as capture:
        aten.exponential_.default(empty, generator=g)  # not Tensor.exponential_, which enable() wraps
    (twin,) = capture.seen
    return twin


def _is_device_generator(g) -> bool:
    return isinstance(g, DeviceGenerator) or id(g) in _device_twins


class _DeviceRNG:
    """Runs a random op given no generator on the device's default generator (CUDA's has its own stream)."""

    def __enter__(self):
        self.cpu_state = torch.default_generator.get_state()
        torch.default_generator.set_state(_device_default_generator.get_state())

    def __exit__(self, *exc):
        _device_default_generator.set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(self.cpu_state)


#: the Python functions and methods that take a ``generator``: enable() wraps them to refuse a generator of the
#: device for an op on the CPU (CUDA raises there; below the Python layer the generator is a CPU one and would be
#: used silently, as ops on CPU tensors never reach this module)
_GENERATOR_FUNCTIONS = ("multinomial", "normal", "poisson", "rand", "rand_like", "randint", "randint_like", "randn",
                        "randn_like", "randperm", "bernoulli", "binomial")
_GENERATOR_METHODS = ("bernoulli", "bernoulli_", "cauchy_", "exponential_", "geometric_", "log_normal_",
                      "multinomial", "normal_", "random_", "uniform_")


def _check_generator_placement(fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        flat = _leaves(args, kwargs)
        if any(isinstance(g, DeviceGenerator) for g in flat):
            device = kwargs.get("device")
            if device is None:
                tensors = [t for t in flat if isinstance(t, torch.Tensor)]
                on_device = bool(tensors) and isinstance(tensors[0], DeviceTensor)
            else:
                on_device = _is_fake_device(device)
            if not on_device:
                raise RuntimeError(f"Expected a 'cpu' device type for generator but found '{NAME}' (in {fn.__name__} "
                                   "on the CPU)")
        return fn(*args, **kwargs)

    checked.__wrapped_by_second_device__ = True
    return checked


def _wrap_generator_functions() -> None:
    for owner, names in ((torch, _GENERATOR_FUNCTIONS), (torch.Tensor, _GENERATOR_METHODS)):
        for name in names:
            fn = getattr(owner, name, None)
            if fn is not None and not getattr(fn, "__wrapped_by_second_device__", False):
                setattr(owner, name, _check_generator_placement(fn))


class _DeviceModule:
    """``torch.metasd_dev``: what torch asks of a backend's module (availability, seeding, RNG state)."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def _lazy_init(self) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"{NAME} has one device (index 0), got {device!r}")

    def synchronize(self, device=None) -> None:
        _record_host_read("sync", "synchronize")  # a host-device synchronisation (nothing is queued here)

    def manual_seed(self, seed: int) -> None:
        _device_default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:  # torch.manual_seed calls this
        _device_default_generator.manual_seed(int(seed))

    def seed(self) -> None:
        _device_default_generator.seed()

    def seed_all(self) -> None:
        _device_default_generator.seed()

    def initial_seed(self) -> int:
        return _device_default_generator.initial_seed()

    def get_rng_state(self, device=None) -> torch.Tensor:
        return _device_default_generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        _device_default_generator.set_state(state)

    @property
    def default_generators(self) -> tuple:
        return (_device_default_generator,)


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


# -------------------------------------------------------------------------------------------------- host reads

READ_KINDS = ("item", "to_cpu", "data_dependent", "print")  # the host reads device data
SYNC_KINDS = READ_KINDS + ("h2d", "sync")  # + blocking copies to the device, device synchronisations


class HostReads(Counter):
    """Host-device synchronisations by kind (the reads ``item``, ``to_cpu``, ``data_dependent``, ``print``; ``h2d``,
    blocking copies to the device; ``sync``, device synchronisations: see ``count_host_reads``), with ``events``: for
    each, (kind, op, the innermost stack frame outside torch, this module and ``metasd/core/execution/clock.py``)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, str]] = []

    @property
    def total(self) -> int:
        """Every synchronisation counted."""
        return sum(self.values())

    @property
    def reads(self) -> int:
        """The host's reads of device data alone."""
        return sum(self[k] for k in READ_KINDS)

    def report(self) -> str:
        """One line per read: kind, op, where (for a failing budget's message)."""
        return "\n".join(f"{kind:15s} {op:32s} {where}" for kind, op, where in self.events)


_counters: list[HostReads] = []  # the open counters (every thread's reads count)


@contextlib.contextmanager
def count_host_reads():
    """Count every host-device synchronisation while open (from any thread; nested counters each count): reads of
    device data by the host, blocking copies of host data to the device, device synchronisations. Counted in the
    dispatch layer, one per op, however it is spelled. Reads:

    - ``item``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``if t:``, ``f"{t:.2f}"`` of a 0-dim tensor
      (all ``aten._local_scalar_dense``), ``torch.equal``, ``torch.allclose`` (a Python bool);
    - ``to_cpu``: ``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``cpu_t.copy_(t)``,
      ``torch.tensor(t, device="cpu")`` (``aten._to_copy``/``aten.copy_`` with a CPU result);
    - ``data_dependent``: ops whose output size depends on device data, which CUDA must read before it can
      allocate: ``nonzero`` (and ``torch.where(cond)``, ``argwhere``), ``masked_select``, ``t[mask]`` and
      ``t[mask] = v`` with a device bool mask, ``unique*``, ``repeat_interleave`` without ``output_size``,
      ``bincount``;
    - ``print``: ``repr``/``str``/``print``/``f"{t}"`` of a device tensor.

    The host waits too for:

    - ``h2d``: a copy of host data to the device without ``non_blocking=True`` (``torch.tensor(data, device=dev)``,
      ``torch.as_tensor``, ``cpu_t.to(dev)``, ``dev_t.copy_(cpu_t)``; not an empty one), and CPU indices of advanced
      indexing on the device (``t[cpu_index]``, ``t[cpu_mask] = v``), which CUDA copies to the device that way;
    - ``sync``: ``torch.metasd_dev.synchronize()`` (``metasd.core.execution.clock.synchronize`` of the device).

    Not seen: ``t.numpy()`` (it raises, as on CUDA), reads of ``DeviceTensor.elem`` (private), and reads of a
    CPU copy made earlier (counted once, at the copy). Not counted: ops that stay on the device, shapes and other
    metadata (``t.shape``, ``len(t)``, ``t.dtype``), reads of CPU tensors, ``non_blocking=True`` copies to the device,
    device factories (``torch.zeros(..., device=dev)``), 0-dim CPU tensors read as scalars by pointwise ops.
    """
    counter = HostReads()
    with _lock:
        _counters.append(counter)
    try:
        yield counter
    finally:
        with _lock:  # by identity: two counters that counted the same are equal Counters
            del _counters[next(i for i, c in enumerate(_counters) if c is counter)]


count_syncs = count_host_reads  # the same counter, by what it counts now


_HERE = str(Path(__file__).resolve())
_CLOCK = str(Path("metasd", "core", "execution", "clock.py"))  # its syncs are named by the line that read the clock
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _caller() -> str:
    """The innermost stack frame outside torch, this module and the clock: the line that asked for the op."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename if frame.filename.startswith("<") else str(Path(frame.filename).resolve())
        if path != _HERE and not path.startswith(_TORCH_DIR) and not path.endswith(_CLOCK):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


class CaptureError(RuntimeError):
    """What CUDA refuses while a graph is captured (``capturing``)."""


_capture = threading.local()  # .depth: the ``capturing`` blocks open in this thread


@contextlib.contextmanager
def capturing():
    """While open, in this thread, what CUDA refuses while it captures a graph raises ``CaptureError`` naming the op
    and the line: every host-device synchronisation ``count_host_reads`` counts (a host read of device data, a
    blocking copy to the device, CPU indices, a device synchronisation) and any other copy between the host and the
    device - a non-blocking one too (mid-capture CUDA refuses a copy from pageable memory; one from pinned memory
    would be baked into the graph, each replay reading whatever that host memory holds then). Device factories,
    copies within the device and 0-dim CPU scalars stay allowed, as under CUDA capture (a scalar is baked in)."""
    depth = getattr(_capture, "depth", 0)
    _capture.depth = depth + 1
    try:
        yield
    finally:
        _capture.depth = depth


def _refuse_in_capture(what: str, op: str) -> None:
    if getattr(_capture, "depth", 0):
        raise CaptureError(f"{op}: {what} while a CUDA graph is captured, at {_caller()}")


def _record_host_read(kind: str, op: str) -> None:
    _refuse_in_capture(f"a host-device synchronisation ({kind})", op)
    if not _counters:
        return
    where = _caller()
    with _lock:
        for c in _counters:
            c[kind] += 1
            c.events.append((kind, op, where))


_HOST_READ_OPS: dict = {}  # OpOverloadPacket -> kind (filled by enable)


def _host_read_kind(info: "_OpInfo", args, kwargs, leaves, on_device: bool) -> str | None:
    if on_device and any(isinstance(x, torch.Tensor) and type(x) is not DeviceTensor and x.numel() for x in leaves):
        if info.transfer:  # a copy from the host: blocking unless non_blocking (an empty one copies nothing)
            blocking = not ("non_blocking" in info.names and info.argument(args, kwargs, "non_blocking"))
            return "h2d" if blocking else None
        if info.indexing:  # CPU indices: CUDA copies them to the device (a blocking copy) before indexing
            indices = info.argument(args, kwargs, "indices") or []
            if any(isinstance(i, torch.Tensor) and type(i) is not DeviceTensor for i in indices):
                return "h2d"
    kind = info.read_kind
    if kind is None or not any(type(x) is DeviceTensor for x in leaves):
        return None
    if kind == "to_cpu":
        return None if on_device else kind
    if info.indexing:  # data-dependent only through a bool mask on the device
        indices = info.argument(args, kwargs, "indices") or []
        if not any(type(i) is DeviceTensor and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return None
    if info.packet is aten.repeat_interleave and kwargs.get("output_size") is not None:
        return None
    return kind


# ------------------------------------------------------------------------------------------------- the device rule

_TRANSFER_OPS: set = set()  # copies between devices (filled by enable)
_INDEX_OPS: set = set()  # advanced indexing: CPU indices allowed
_SCALAR_VALUE_ARGS: dict = {}  # op packet -> names of the arguments that may be 0-dim CPU tensors
_NEVER_SCALAR_ARGS: dict = {}  # pointwise op packet -> names of arguments CUDA wants on the device all the same
_COPY_DESTINATION: dict = {}  # transfer op packet -> index of the argument whose device the result has


def _is_pointwise(func) -> bool:
    """A TensorIterator op (CUDA takes CPU scalars there): tagged pointwise, or the in-place or out= variant of an
    op tagged pointwise (torch leaves some of those untagged, e.g. ``eq_.Tensor``, ``where.self_out``)."""
    packet, overload = func.overloadpacket, func._overloadname
    base = getattr(aten, packet.__name__.rstrip("_"), packet) if packet.__name__.endswith("_") else packet
    names = {overload, overload.removesuffix("_out"), "default" if overload == "out" else overload}
    candidates = [func] + [getattr(base, n) for n in names if n in base.overloads()]
    return any(torch.Tag.pointwise in c.tags for c in candidates)


_decomposing = threading.local()  # the CompositeImplicitAutograd ops being decomposed by _run (for messages)


def _mix_error(func, name: str, other: torch.Tensor, written: bool) -> RuntimeError:
    outer = getattr(_decomposing, "stack", [])
    inside = f", inside {outer[-1]}" if outer else ""
    role = "the written argument" if written else "argument"
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} and "
        f"{other.device}! (when checking {role} '{name}' of {func}{inside}: a {other.device} tensor, "
        f"{other.dtype}, shape {tuple(other.shape)})"
    )


def _check_devices(func, info: "_OpInfo", args, kwargs) -> None:
    """CUDA's rule for an op that touches the device and has CPU tensors (see the module docstring)."""
    for i, (name, value) in enumerate(info.bound(args, kwargs)):
        if isinstance(value, torch.Tensor):
            tensors = (value,)
        elif isinstance(value, (list, tuple)):
            tensors = [v for v in value if isinstance(v, torch.Tensor)]
        else:
            continue
        written = info.written[i]
        for t in tensors:
            if type(t) is DeviceTensor:
                continue
            if info.indexing and name == "indices":
                continue  # CUDA moves CPU indices of advanced indexing to the device itself
            if t.dim() == 0 and t.device.type == "cpu" and not written and name not in info.never_scalar and (
                    info.pointwise or name in info.scalar_values):
                continue  # a CPU scalar
            raise _mix_error(func, name, t, written)


def _check_generators(func, generators) -> None:
    """A random op on the device takes a generator of the device only."""
    for g in generators:
        if not _is_device_generator(g):
            raise RuntimeError(
                f"Expected a '{NAME}' device type for generator but found '{g.device.type}' (in {func})")


# ------------------------------------------------------------------------------------------------------ running ops

class _OpInfo:
    """What ``_run`` needs to know of one op overload (worked out once)."""

    def __init__(self, func):
        schema = func._schema
        self.packet = packet = func.overloadpacket
        self.composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
        self.names = [a.name for a in schema.arguments]
        self.written = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        self.mutable = schema.is_mutable
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.pointwise = _is_pointwise(func)
        self.transfer = packet in _TRANSFER_OPS
        self.copy_destination = _COPY_DESTINATION.get(packet)
        self.indexing = packet in _INDEX_OPS
        self.scalar_values = _SCALAR_VALUE_ARGS.get(packet, ())
        self.never_scalar = _NEVER_SCALAR_ARGS.get(packet, ())
        self.read_kind = _HOST_READ_OPS.get(packet)

    def bound(self, args, kwargs):
        """(argument name, value) in schema order, None for an argument not given."""
        return [(n, args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(self.names)]

    def argument(self, args, kwargs, name: str):
        i = self.names.index(name)
        return args[i] if i < len(args) else kwargs.get(name)


_infos: dict = {}


def _info(func) -> _OpInfo:
    info = _infos.get(func)
    if info is None:
        info = _infos[func] = _OpInfo(func)
    return info


def _leaves(args, kwargs) -> list:
    """The arguments, with lists and tuples (aten's only nesting: Tensor[], Tensor?[], int[]) opened."""
    out = []
    for v in (*args, *kwargs.values()):
        if type(v) in (list, tuple):
            out.extend(v)
        else:
            out.append(v)
    return out


_CPU = torch.device("cpu")


def _unwrap(x):
    t = type(x)
    if t is DeviceTensor:
        return x.elem
    if t in (list, tuple):
        return t(_unwrap(v) for v in x)
    if t is torch.device and x.type == NAME:
        return _CPU
    return x


def _result_on_device(info: _OpInfo, args, kwargs, leaves) -> bool:
    """Whether the op's results are on the device: a copy's destination's, else its ``device`` argument if
    given, else whether any input is on the device."""
    where = info.copy_destination
    if where is not None and len(args) > where:
        return type(args[where]) is DeviceTensor
    d = kwargs.get("device")
    if d is not None:
        return _is_fake_device(d)
    return any(type(x) is DeviceTensor or (type(x) is torch.device and x.type == NAME) for x in leaves)


def _sync_metadata(t: DeviceTensor) -> None:
    """Give the wrapper its CPU tensor's sizes, strides and offset again after an op changed them in place."""
    e = t.elem
    if t.shape != e.shape or t.stride() != e.stride() or t.storage_offset() != e.storage_offset():
        t.data = DeviceTensor(e)  # copies the new wrapper's TensorImpl metadata into t's; t.elem stays e


def _run(func, args, kwargs):
    """Run one aten op that touches the device (see the module docstring)."""
    info = _info(func)
    if info.composite:
        stack = _decomposing.__dict__.setdefault("stack", [])
        stack.append(func)
        try:
            out = func.decompose(*args, **kwargs)  # its ops come back here one by one
        finally:
            stack.pop()
        if out is not NotImplemented:
            return out
    leaves = _leaves(args, kwargs)
    on_device = _result_on_device(info, args, kwargs, leaves)
    device_inputs = {id(x.elem): x for x in leaves if type(x) is DeviceTensor}
    if not on_device and not device_inputs:
        raise RuntimeError(f"{func} reached the {NAME} backend with neither a {NAME} tensor nor device")
    cpu_inputs = {id(x) for x in leaves if isinstance(x, torch.Tensor) and type(x) is not DeviceTensor}
    if cpu_inputs and not info.transfer:
        _check_devices(func, info, args, kwargs)
    generators = [g for g in leaves if type(g) in _GENERATOR_TYPES]
    if on_device:
        _check_generators(func, generators)
    kind = _host_read_kind(info, args, kwargs, leaves, on_device)
    if kind is not None:
        _record_host_read(kind, str(func))
    elif info.transfer and (cpu_inputs or not on_device):
        _refuse_in_capture("a copy between the host and the device", str(func))

    uargs = tuple(_unwrap(a) for a in args)
    ukwargs = {k: _unwrap(v) for k, v in kwargs.items()}
    if on_device and info.random and not generators:
        with _DeviceRNG():
            out = func(*uargs, **ukwargs)
    else:
        out = func(*uargs, **ukwargs)

    if info.mutable:  # an in-place or out= op may have resized or restrided a device argument
        for x in device_inputs.values():
            _sync_metadata(x)

    def wrap(t):
        if type(t) in (list, tuple):
            return type(t)(wrap(v) for v in t)
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in device_inputs:  # the op returned one of its arguments (in-place, out=)
            return device_inputs[id(t)] if on_device else t.clone()  # a CPU result must not alias device data
        if id(t) in cpu_inputs or not on_device:
            return t
        if torch.is_inference_mode_enabled() and not t.is_inference():
            # a view of a normal tensor made under inference mode is a normal tensor (autograd sets its version
            # counter): its wrapper must be one too, as on CUDA
            with torch.inference_mode(False):
                return DeviceTensor(t)
        return DeviceTensor(t)

    return wrap(out)


def _kernel(qualname: str):
    """The PrivateUse1 kernel of one aten op (``aten::name.overload``). An op reaches the backend key with no
    DeviceTensor (factories: ``torch.zeros(..., device=dev)``), or with one while torch has the Python key
    excluded (``torch.tensor(..., device=dev)`` copies into its result that way): a per-op Python kernel
    handles both, a Python fallback only the first (torch asserts on the second)."""
    op = None

    def kernel(*args, **kwargs):
        nonlocal op
        if op is None:
            name, _, overload = qualname.split("::")[1].partition(".")
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
        return _run(op, args, kwargs)

    return kernel


def _fallback(op, *args, **kwargs):
    """The PrivateUse1 fallback, for ops outside aten (given no DeviceTensor; see ``_kernel``)."""
    return _run(op, args, kwargs)


def _register_kernels() -> None:
    """A PrivateUse1 kernel for every aten op that is not CompositeImplicitAutograd (those decompose into the
    others before they reach a backend), and the fallback for the ops of other namespaces."""
    aten_lib = torch.library.Library("aten", "IMPL")
    for qualname in torch._C._dispatch_get_all_op_names():
        if not qualname.startswith("aten::"):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeImplicitAutograd"):
            continue
        aten_lib.impl(qualname[len("aten::"):], _kernel(qualname), "PrivateUse1")
    fallback_lib = torch.library.Library("_", "IMPL")
    fallback_lib.fallback(_fallback, "PrivateUse1")
    _libraries.extend([aten_lib, fallback_lib])


def _fill_tables() -> None:
    _TRANSFER_OPS.update({aten._to_copy, aten.copy_, aten.copy, aten._copy_from, aten._copy_from_and_resize})
    _COPY_DESTINATION.update({aten.copy_: 0, aten.copy: 0, aten._copy_from: 1, aten._copy_from_and_resize: 1})
    _INDEX_OPS.update({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index,
                       aten._unsafe_index_put})
    _SCALAR_VALUE_ARGS.update({
        aten.masked_fill: ("value",), aten.masked_fill_: ("value",), aten.fill: ("value",), aten.fill_: ("value",),
        aten.index_fill: ("value",), aten.index_fill_: ("value",),
        aten.index_put: ("values",), aten.index_put_: ("values",), aten._index_put_impl_: ("values",),
    })
    # masked_fill's CUDA kernel checks "expected self and mask to be on the same device" (a 0-dim mask too)
    _NEVER_SCALAR_ARGS.update({aten.masked_fill: ("mask",), aten.masked_fill_: ("mask",)})
    for packet in (aten._local_scalar_dense, aten.equal, aten.allclose):
        _HOST_READ_OPS[packet] = "item"
    for packet in (aten._to_copy, aten.copy_, aten.copy, aten._copy_from, aten._copy_from_and_resize):
        _HOST_READ_OPS[packet] = "to_cpu"
    for packet in (aten.nonzero, aten.masked_select, aten.unique_consecutive, aten.unique_dim, aten._unique,
                   aten._unique2, aten.unique_dim_consecutive, aten.repeat_interleave, aten.bincount, aten.index,
                   aten.index_put, aten.index_put_, aten._index_put_impl_):
        _HOST_READ_OPS[packet] = "data_dependent"


# ---------------------------------------------------------------------------------------------------- enable

def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of the second device (set up by ``enable``)."""
    return isinstance(t, DeviceTensor) and DEVICE is not None and t.device == DEVICE


def enable() -> torch.device:
    """Set up the second device (once per process; later calls only return it) and return it."""
    global _enabled, _device_default_generator, DEVICE
    with _lock:
        if _enabled:
            return DEVICE
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise RuntimeError(f"PrivateUse1 is already the backend {current!r} in this process")
        if current != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
            torch.utils.generate_methods_for_privateuse1_backend()
        DEVICE = torch.device(NAME, 0)
        torch._register_device_module(NAME, _DeviceModule())
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
        _fill_tables()
        _register_kernels()
        _device_default_generator = type.__call__(DeviceGenerator)
        _device_default_generator.manual_seed(torch.initial_seed())
        torch.Generator = Generator
        _wrap_generator_functions()
        _enabled = True
        return DEVICE
