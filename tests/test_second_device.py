"""The second device of ``second_device.py`` (a non-CPU torch device on a CPU-only machine): it works (tensors,
modules, factories, views, in-place ops, a tiny Qwen2 with a KV cache, ``generate``), it refuses what CUDA refuses
(CPU/device mixes, CPU generators for device sampling), and it counts host reads exactly. Last, metasd's engine
on it, per drafter type: today's crashes are listed in ``KNOWN_CRASHES`` (see ``test_engine_on_the_device``)."""
from __future__ import annotations

import copy
import os
import threading
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import second_device
from metasd.core.execution import clock
from metasd.core.execution.staging import to_device
from second_device import count_host_reads, enable, on_device as on_dev
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

pytestmark = pytest.mark.second_device

NAME = second_device.NAME
DEV: torch.device = None  # set by _enable: not at import, so collecting this file leaves torch as it is


@pytest.fixture(autouse=True, scope="module")
def _enable():
    global DEV
    DEV = enable()



# ------------------------------------------------------------------------------------------- the device works

def test_enable_is_idempotent_and_gives_a_device_torch_knows():
    assert enable() is enable() and enable() == DEV
    assert DEV.type == "metasd_dev" and DEV.index == 0 and DEV.type != "cpu"
    assert torch.device(NAME).type == NAME
    assert getattr(torch, NAME).device_count() == 1 and getattr(torch, NAME).is_available()
    x = torch.ones(2).to(NAME)
    assert on_dev(x) and x.device == DEV and not x.is_cpu and getattr(x, f"is_{NAME}")


@pytest.mark.parametrize("make, expected", [
    (lambda d: torch.zeros(2, 3, device=d), torch.zeros(2, 3)),
    (lambda d: torch.full((2,), 7, device=d), torch.full((2,), 7)),
    (lambda d: torch.arange(5, device=d), torch.arange(5)),  # an out= op that resizes its (device) output
    (lambda d: torch.arange(2, 9, 3, device=d), torch.arange(2, 9, 3)),
    (lambda d: torch.tensor([[1.5, 2], [3, 4]], device=d), torch.tensor([[1.5, 2], [3, 4]])),
    (lambda d: torch.tensor([], device=d), torch.tensor([])),  # DynamicCache.lazy_initialization makes these
    (lambda d: torch.tensor(3, device=d), torch.tensor(3)),
    (lambda d: torch.linspace(0, 1, 5, device=d), torch.linspace(0, 1, 5)),
    (lambda d: torch.eye(3, device=d, dtype=torch.bool), torch.eye(3, dtype=torch.bool)),
    (lambda d: torch.zeros_like(torch.ones(2, 2), device=d), torch.zeros(2, 2)),
    (lambda d: torch.ones(3).to(d, torch.float16), torch.ones(3, dtype=torch.float16)),
    (lambda d: torch.ones(3).to(d).new_full((2,), 5.0), torch.full((2,), 5.0)),
], ids=["zeros", "full", "arange", "arange_step", "tensor", "tensor_empty", "tensor_0d", "linspace", "eye",
        "zeros_like", "to_dtype", "new_full"])
def test_factories_and_to_make_device_tensors_with_the_cpu_values(make, expected):
    t = make(DEV)
    assert on_dev(t), f"{type(t).__name__} on {t.device}"
    assert t.shape == expected.shape and t.dtype == expected.dtype
    assert torch.equal(t.cpu(), expected)


def test_ops_give_device_tensors_equal_to_the_cpu_results():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    da, db = a.to(DEV), b.to(DEV)
    for got, want in [(da @ db, a @ b), (da.softmax(-1), a.softmax(-1)), (da.topk(2).values, a.topk(2).values),
                      (da.argmax(-1), a.argmax(-1)), (torch.cat([da, da], 0), torch.cat([a, a], 0)),
                      (da.masked_fill(da > 0, -1.0), a.masked_fill(a > 0, -1.0)),
                      (da.index_select(1, torch.tensor([3, 0], device=DEV)), a.index_select(1, torch.tensor([3, 0]))),
                      (torch.empty_like(da).copy_(da), a), (da.T.contiguous(), a.T.contiguous()),
                      (da.cumsum(0), a.cumsum(0)), (da.to(torch.bfloat16), a.to(torch.bfloat16))]:
        assert on_dev(got) and got.dtype == want.dtype and torch.equal(got.cpu(), want)


def test_in_place_ops_return_their_argument_and_views_alias():
    t = torch.zeros(4, 3, device=DEV)
    assert t.add_(1) is t and t.mul_(torch.tensor(2.0)) is t  # a 0-dim CPU tensor in a pointwise op
    torch.add(t, 1, out=t)
    view = t[1:3]
    view.fill_(9)  # writes through to t
    assert on_dev(view) and view.shape == (2, 3)
    assert t.cpu().tolist() == [[3.0] * 3, [9.0] * 3, [9.0] * 3, [3.0] * 3]
    t.unsqueeze_(0)  # in-place ops that change sizes or strides: the wrapper follows
    assert t.shape == (1, 4, 3) and t.cpu().shape == (1, 4, 3)
    t.squeeze_(0)
    t.t_()
    assert t.shape == (3, 4) and t.stride() == (1, 3) and torch.equal(t.cpu(), t.elem)
    r = torch.zeros(2, device=DEV)
    r.resize_(5)
    assert r.shape == (5,)


def test_copies_between_devices_are_copies():
    t = torch.arange(4.0, device=DEV)
    c = t.cpu()
    assert type(c) is torch.Tensor and c.device.type == "cpu"
    c.add_(100)  # the host copy does not alias the device data
    assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    with torch.inference_mode():  # .to("cpu") arrives whole there (CompositeImplicitAutograd): still a copy
        c = t.to("cpu")
        c.add_(100)
        assert type(c) is torch.Tensor and t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert t.to(DEV) is t  # as torch: .to its own device is a no-op
    host = torch.zeros(4)
    host.copy_(t)
    t.copy_(torch.full((4,), 5.0))
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0] and t.cpu().tolist() == [5.0] * 4


def test_modules_move_and_deepcopy():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    want = lin(x)
    dlin = copy.deepcopy(lin).to(DEV)
    assert all(on_dev(p) for p in dlin.parameters())
    assert isinstance(dlin.weight, torch.nn.Parameter)
    assert torch.allclose(dlin(x.to(DEV)).cpu(), want)
    again = copy.deepcopy(dlin)  # drafters/steered.py deep-copies a (device) model
    assert all(on_dev(p) for p in again.parameters()) and torch.allclose(again(x.to(DEV)).cpu(), want)
    assert all(p.device.type == "cpu" for p in again.cpu().parameters())


def test_backward_and_an_optimizer_step_on_the_device_equal_the_cpu():
    torch.manual_seed(0)
    cpu = torch.nn.Linear(4, 3)
    dev = copy.deepcopy(cpu).to(DEV)
    x = torch.randn(2, 4)
    for model, inp in ((cpu, x), (dev, x.to(DEV))):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(inp).pow(2).sum().backward()
        opt.step()
    assert on_dev(dev.weight) and on_dev(dev.weight.grad)
    assert torch.allclose(dev.weight.grad.cpu(), cpu.weight.grad) and torch.allclose(dev.weight.cpu(), cpu.weight)


def test_tolist_numpy_and_printing_behave_as_on_cuda():
    t = torch.tensor([1, 2, 3], device=DEV)
    assert t.tolist() == [1, 2, 3] and t[0].tolist() == 1 and t[1].item() == 2 and int(t[2]) == 3
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        t.numpy()
    assert repr(t) == "tensor([1, 2, 3], device='metasd_dev:0')" and str(t) == repr(t)
    assert f"{t[0].float():.1f}" == "1.0"


@pytest.fixture(scope="module")
def qwen_pair():
    return tiny_qwen(seed=0), tiny_qwen(seed=0).to(DEV)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_tiny_qwen_with_a_cache_on_the_device_equals_the_cpu(qwen_pair, mode):
    from transformers import DynamicCache

    from metasd.core.execution.kv_cache import cache_kwargs

    cpu_model, dev_model = qwen_pair
    assert all(on_dev(p) for p in dev_model.parameters()) and dev_model.device == DEV
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()

    def forward(model, cache, ids, **kw):
        device = model.device
        kw = {k: v.to(device) for k, v in kw.items()}
        out = model(ids.to(device), **cache_kwargs(model, cache), use_cache=True, **kw).logits
        assert out.device == device
        return out.cpu()

    with ctx:
        caches = {m: DynamicCache(config=m.config) for m in (cpu_model, dev_model)}
        prompt = torch.tensor([[0, 7, 12, 9, 33, 12]])
        logits = {m: forward(m, c, prompt) for m, c in caches.items()}
        torch.testing.assert_close(logits[dev_model], logits[cpu_model], rtol=0, atol=1e-5)
        assert all(on_dev(layer.keys) and on_dev(layer.values) for layer in caches[dev_model].layers)

        # a tree block: a 4-D bool mask over [cache + block] and explicit positions (two siblings at depth 1)
        past, n = prompt.shape[1], 3
        mask = torch.ones(1, 1, n, past + n, dtype=torch.bool)
        mask[0, 0, :, past:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        pos = torch.tensor([[past, past + 1, past + 1]])
        block = torch.tensor([[5, 8, 9]])
        logits = {m: forward(m, c, block, attention_mask=mask, position_ids=pos) for m, c in caches.items()}
        torch.testing.assert_close(logits[dev_model], logits[cpu_model], rtol=0, atol=1e-5)

        # keep the path [0, 2] of the block: index_select on the cache tensors, then crop
        for m, cache in caches.items():
            src = torch.tensor([past + 0, past + 2], device=m.device)
            for layer in cache.layers:
                layer.keys[..., past:past + 2, :] = layer.keys.index_select(-2, src)
                layer.values[..., past:past + 2, :] = layer.values.index_select(-2, src)
            cache.crop(-1)
            assert cache.get_seq_length() == past + 2
        logits = {m: forward(m, c, torch.tensor([[4]])) for m, c in caches.items()}
        torch.testing.assert_close(logits[dev_model], logits[cpu_model], rtol=0, atol=1e-5)


def test_generate_greedy_on_the_device_equals_the_cpu(qwen_pair):
    cpu_model, dev_model = qwen_pair
    prompt = torch.tensor([[0, 7, 12, 9, 33, 12]])
    want = cpu_model.generate(prompt, max_new_tokens=8, do_sample=False)
    got = dev_model.generate(prompt.to(DEV), max_new_tokens=8, do_sample=False)
    assert on_dev(got) and got.cpu().tolist() == want.tolist()


# ------------------------------------------------------------------------------------------- mixing fails

def _mixes():
    d4, c4 = torch.randn(4), torch.randn(4)
    dm, cm = torch.randn(4, 4), torch.randn(4, 4)
    return {
        "dev+cpu": lambda: d4.to(DEV) + c4,
        "cpu+dev": lambda: c4 + d4.to(DEV),
        "index_select(dev, cpu_index)": lambda: torch.index_select(dm.to(DEV), 0, torch.tensor([0, 2])),
        "index_select(cpu, dev_index)": lambda: torch.index_select(cm, 0, torch.tensor([0, 2], device=DEV)),
        "cat": lambda: torch.cat([d4.to(DEV), c4]),
        "matmul": lambda: dm.to(DEV) @ cm,
        "masked_fill(cpu_mask)": lambda: dm.to(DEV).masked_fill(cm > 0, 0.0),
        "where(cpu_other)": lambda: torch.where(d4.to(DEV) > 0, d4.to(DEV), c4),
        "embedding(cpu_weight)": lambda: F.embedding(torch.tensor([1, 2], device=DEV), cm),
        "cpu_linear(dev)": lambda: torch.nn.Linear(4, 4)(d4.to(DEV)),
        "dev.add_(cpu)": lambda: d4.to(DEV).add_(c4),
        "cpu.add_(dev)": lambda: c4.clone().add_(d4.to(DEV)),
        "cpu_scalar.add_(dev)": lambda: torch.tensor(1.0).add_(torch.tensor(2.0, device=DEV)),  # CPU output
        "gather(cpu_index)": lambda: dm.to(DEV).gather(1, torch.zeros(4, 1, dtype=torch.long)),
        "sdpa(cpu_key)": lambda: F.scaled_dot_product_attention(dm.to(DEV)[None], cm[None], cm[None]),
        "masked_fill(cpu_scalar_mask)": lambda: dm.to(DEV).masked_fill(torch.tensor(True), 0.0),
    }


BOTH_DEVICES = r"(?s)(?=.*metasd_dev:0)(?=.*\bcpu\b)"  # a message that names both devices


@pytest.mark.parametrize("case", list(_mixes()))
def test_mixing_device_and_cpu_tensors_fails_naming_both_devices(case):
    with pytest.raises(RuntimeError, match=BOTH_DEVICES):  # ours, or torch's own check (sdpa has one)
        _mixes()[case]()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_mixing_fails_under_inference_mode_too(mode):
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx, pytest.raises(RuntimeError, match="metasd_dev:0 and cpu!"):
        F.linear(torch.randn(2, 4, device=DEV), torch.randn(3, 4))  # CompositeImplicitAutograd: linear


def test_what_cuda_allows_is_allowed_with_cpu_results():
    a = torch.randn(3, 4)
    d = a.to(DEV)
    s = torch.tensor(2.0)  # 0-dim CPU tensors are scalars for pointwise ops and fill values
    idx = torch.tensor([2, 0])  # CUDA moves CPU indices of advanced indexing to the device
    checks = [
        (d + s, a + s), (s * d, s * a), (torch.where(d > 0, d, s), torch.where(a > 0, a, s)),
        (d.masked_fill(d > 0, s), a.masked_fill(a > 0, s)), (d.clone().fill_(s), a.clone().fill_(s)),
        (d[idx], a[idx]), (d[idx, 1:], a[idx, 1:]), (d[torch.tensor([True, False, True])], a[[0, 2]]),
        (d.clamp(min=torch.tensor(0.0)), a.clamp(min=torch.tensor(0.0))),
    ]
    for got, want in checks:
        assert on_dev(got) and torch.equal(got.cpu(), want)
    e, b = d.clone(), a.clone()
    e[idx] = s
    b[idx] = s
    e[torch.tensor([1])] = torch.ones(1, 4, device=DEV)
    b[torch.tensor([1])] = torch.ones(1, 4)
    e.add_(s)
    b.add_(s)
    assert torch.equal(e.cpu(), b)


# ------------------------------------------------------------------------------------------- random numbers

def test_a_cpu_generator_for_device_sampling_fails():
    probs = torch.softmax(torch.randn(2, 8), -1).to(DEV)
    cpu_gen = torch.Generator().manual_seed(0)
    match = "Expected a 'metasd_dev' device type for generator but found 'cpu'"
    with pytest.raises(RuntimeError, match=match):
        torch.multinomial(probs, 1, generator=cpu_gen)
    with pytest.raises(RuntimeError, match=match):
        torch.empty(3, device=DEV).exponential_(generator=cpu_gen)
    with pytest.raises(RuntimeError, match=match):
        torch.rand(3, device=DEV, generator=cpu_gen)
    with pytest.raises(RuntimeError, match=match):
        torch.bernoulli(probs, generator=cpu_gen)


def test_a_device_generator_for_cpu_sampling_fails():
    gen = torch.Generator(device=DEV).manual_seed(0)
    assert isinstance(gen, torch.Generator) and gen.device == DEV
    match = "Expected a 'cpu' device type for generator but found 'metasd_dev'"
    for draw in (lambda: torch.multinomial(torch.ones(2, 8), 1, generator=gen),
                 lambda: torch.empty(3).exponential_(generator=gen),
                 lambda: torch.rand(3, generator=gen),
                 lambda: torch.randperm(5, generator=gen),
                 lambda: torch.ones(3).bernoulli_(0.5, generator=gen)):
        with pytest.raises(RuntimeError, match=match):
            draw()
    torch.rand(3, device=DEV, generator=gen)  # on the device it is fine


def test_device_generators_draw_the_cpu_numbers_of_their_seed():
    gen = torch.Generator(device=DEV)
    assert isinstance(gen, torch.Generator) and gen.device == DEV
    assert isinstance(torch.Generator(), torch.Generator) and torch.Generator().device.type == "cpu"
    assert isinstance(torch.default_generator, torch.Generator)
    probs = torch.softmax(torch.randn(4, 16), -1)
    gen.manual_seed(123)
    got = torch.multinomial(probs.to(DEV), 2, generator=gen)
    got_exp = torch.empty(5, device=DEV).exponential_(generator=gen)
    cpu = torch.Generator().manual_seed(123)
    want = torch.multinomial(probs, 2, generator=cpu)
    want_exp = torch.empty(5).exponential_(generator=cpu)
    assert on_dev(got) and torch.equal(got.cpu(), want) and torch.equal(got_exp.cpu(), want_exp)
    state = gen.get_state()
    a = torch.rand(3, device=DEV, generator=gen)
    gen.set_state(state)
    assert torch.equal(torch.rand(3, device=DEV, generator=gen).cpu(), a.cpu())


def test_the_device_default_generator_is_its_own_stream_seeded_by_manual_seed():
    torch.manual_seed(7)
    cpu_first = torch.rand(4)  # CPU draws do not move the device's generator (as on CUDA)
    dev_first = torch.rand(4, device=DEV)
    assert torch.equal(dev_first.cpu(), cpu_first)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(4, device=DEV).cpu(), cpu_first)
    assert torch.equal(torch.rand(4), cpu_first)


def test_cpu_work_is_unchanged_once_the_device_is_enabled():
    """enable() is for the whole process (other test files may run after this one in the same worker)."""
    gen = torch.Generator()
    assert type(gen) is torch._C.Generator and gen.device.type == "cpu"
    torch.manual_seed(0)
    a = (torch.rand(3), torch.multinomial(torch.ones(8), 3), torch.empty(2).exponential_())
    g = torch.Generator().manual_seed(0)
    b = (torch.rand(3, generator=g), torch.multinomial(torch.ones(8), 3, generator=g),
         torch.empty(2).exponential_(generator=g))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    x = torch.randn(3, 4)
    assert type(x @ x.T) is torch.Tensor and (x + torch.ones(4)).device.type == "cpu"


# ------------------------------------------------------------------------------------------- host reads

def _dev_vector() -> torch.Tensor:
    return torch.tensor([1.5, -2.0, 0.0, 3.0], device=DEV)  # made before a counter opens


HOST_READS = {
    # reads: one per op that hands device data to the host
    "item": (lambda t: t[0].item(), {"item": 1}),
    "int": (lambda t: int(t[0]), {"item": 1}),
    "float": (lambda t: float(t[3]), {"item": 1}),
    "bool": (lambda t: bool(t[0] > 0), {"item": 1}),
    "if": (lambda t: 1 if t.sum() > 0 else 0, {"item": 1}),
    "format": (lambda t: f"{t[0]:.2f}", {"item": 1}),
    "equal": (lambda t: torch.equal(t, t), {"item": 1}),
    "allclose": (lambda t: torch.allclose(t, t), {"item": 1}),
    "two_items": (lambda t: (t[0].item(), t[1].item()), {"item": 2}),
    "tolist": (lambda t: t.tolist(), {"to_cpu": 1}),
    "tolist_0d": (lambda t: t[0].tolist(), {"to_cpu": 1}),
    "cpu": (lambda t: t.cpu(), {"to_cpu": 1}),
    "to_cpu": (lambda t: t.to("cpu"), {"to_cpu": 1}),
    "to_cpu_dtype": (lambda t: t.to("cpu", torch.float64), {"to_cpu": 1}),
    "copy_to_host": (lambda t: torch.empty(4).copy_(t), {"to_cpu": 1}),
    "as_tensor_cpu": (lambda t: torch.as_tensor(t, device="cpu"), {"to_cpu": 1}),
    "nonzero": (lambda t: torch.nonzero(t), {"data_dependent": 1}),
    "where_cond": (lambda t: torch.where(t > 0), {"data_dependent": 1}),
    "argwhere": (lambda t: torch.argwhere(t), {"data_dependent": 1}),
    "bool_mask_index": (lambda t: t[t > 0], {"data_dependent": 1}),
    "bool_mask_assign": (lambda t: t.__setitem__(t > 0, 0.0), {"data_dependent": 1}),
    "masked_select": (lambda t: torch.masked_select(t, t > 0), {"data_dependent": 1}),
    "unique": (lambda t: torch.unique(t), {"data_dependent": 1}),
    "repeat_interleave": (lambda t: torch.repeat_interleave(t, t.abs().long()), {"data_dependent": 1}),
    "bincount": (lambda t: torch.bincount(t.abs().long()), {"data_dependent": 1}),
    "repr": (lambda t: repr(t), {"print": 1}),
    "str": (lambda t: str(t), {"print": 1}),
    "fstring": (lambda t: f"{t}", {"print": 1}),
    "mixed": (lambda t: (t.argmax().item(), t.tolist(), t[t > 0]), {"item": 1, "to_cpu": 1, "data_dependent": 1}),
    # the host waits for these too: blocking copies to the device, device synchronisations (the clock's)
    "to_device": (lambda t: (t.to(DEV), torch.ones(2).to(DEV), torch.tensor([1, 2], device=DEV)), {"h2d": 2}),
    "as_tensor_device": (lambda t: torch.as_tensor([1, 2], device=DEV), {"h2d": 1}),
    "copy_from_host": (lambda t: t.copy_(torch.zeros(4)), {"h2d": 1}),
    "tensor_0d_device": (lambda t: torch.tensor(3, device=DEV), {"h2d": 1}),
    "cpu_index": (lambda t: (t[torch.tensor([0, 2])], t.index_select(0, torch.tensor([1], device=DEV))), {"h2d": 2}),
    "cpu_bool_mask": (lambda t: t[torch.tensor([True, False, True, False])], {"h2d": 1}),  # the mask is on the host
    "cpu_index_assign": (lambda t: t.__setitem__(torch.tensor([1]), 0.0), {"h2d": 1}),
    "synchronize": (lambda t: getattr(torch, NAME).synchronize(), {"sync": 1}),
    "clock": (lambda t: (clock.now(DEV), clock.now(None), clock.now(torch.device("cpu"))), {"sync": 1}),
    # none of these: work on the device, metadata, non-blocking uploads, CPU data
    "non_blocking_to_device": (lambda t: (torch.ones(2).to(DEV, non_blocking=True), to_device([1, 2], DEV),
                                          to_device(torch.ones(3), DEV)), {}),
    "device_ops": (lambda t: torch.multinomial((t + 3).softmax(-1), 2).sort().values.cumsum(0), {}),
    "device_copies": (lambda t: (t.clone(), t.repeat_interleave(2), torch.nonzero_static(t, size=2), t.topk(2)), {}),
    "metadata": (lambda t: (t.shape, len(t), t.dtype, t.device, t.numel(), t.dim(), t.stride()), {}),
    "device_index": (lambda t: t.index_select(0, torch.arange(2, device=DEV)), {}),
    "repeat_interleave_sized": (lambda t: torch.repeat_interleave(t, torch.ones(4, dtype=torch.long, device=DEV),
                                                                  output_size=4), {}),
    "cpu_reads": (lambda t: (torch.ones(2).tolist(), torch.ones(()).item(), repr(torch.ones(2))), {}),
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("case", list(HOST_READS))
def test_host_reads_are_counted_exactly(case, mode):
    fn, expected = HOST_READS[case]
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        t = _dev_vector()
        with count_host_reads() as reads:
            fn(t)
    assert dict(reads) == expected, reads.report()
    assert reads.total == sum(expected.values()) and len(reads.events) == reads.total


def test_host_reads_name_the_line_that_read(capsys):
    t = _dev_vector()
    with count_host_reads() as reads:
        print(t)
        t.sum().item()
    kinds = [kind for kind, _, _ in reads.events]
    assert kinds == ["print", "item"], reads.report()
    assert all(Path(__file__).name in where for _, _, where in reads.events), reads.report()
    assert "metasd_dev:0" in capsys.readouterr().out


def test_host_read_counters_nest_close_and_see_other_threads():
    t = _dev_vector()
    with count_host_reads() as outer:
        t[0].item()
        with count_host_reads() as inner:
            t.tolist()
        worker = threading.Thread(target=lambda: t[1].item())
        worker.start()
        worker.join()
    t.cpu()  # after both closed
    assert dict(inner) == {"to_cpu": 1}
    assert dict(outer) == {"item": 2, "to_cpu": 1}


# ------------------------------------------------------------------------------------------- metasd on the device

#: where metasd's engine crashes on the device today, per (drafter type, mode): (file, statement) of the innermost
#: frame in the repository, and why. Fixing one makes its test fail with "fixed": remove its line (it may then
#: crash further on: the test reports where).
KNOWN_CRASHES: dict[tuple[str, str], tuple[str, str, str]] = {}  # every drafter type runs on the device

REPO = Path(__file__).resolve().parents[1]


def _crash_site(exc: BaseException) -> tuple[str, str]:
    """(file, statement) of the innermost frame of the traceback in the repository, tests left out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if str(Path(f.filename).resolve()).startswith(str(REPO))
              and not str(Path(f.filename).resolve()).startswith(str(REPO / "tests"))]
    if not frames:
        return ("?", "?")
    f = frames[-1]
    return (os.path.relpath(Path(f.filename).resolve(), REPO), f"{(f.line or '').strip()}  [line {f.lineno}]")


@pytest.fixture(scope="module")
def pool_root(tmp_path_factory) -> Path:
    import test_conformance as tc

    root = tmp_path_factory.mktemp("second_device_pools")
    tok = tiny_tokenizer()
    for name, model in {"verifier": tiny_qwen(seed=0, layers=tc.LAYERS, logit_scale=tc.SHARPNESS),
                        "drafter": tiny_qwen(seed=0, layers=tc.LAYERS, logit_scale=tc.SHARPNESS / 3)}.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def _engine(root: Path, kind: str, device: str):
    import test_conformance as tc
    from metasd.config import load_pool

    entry = dict(tc.entry(kind)(root))
    before = entry.pop("before", [])  # entries the arm drafts with (a fused drafter's)
    pool = {"verifier": {"model": str(root / "verifier"), "dtype": "fp32", "device": device},
            "drafters": [*before, {"name": kind, "type": kind, **entry}]}
    path = root / f"pool_{kind}_{device}.yaml"
    path.write_text(yaml.safe_dump(pool))
    engine = load_pool(path)
    engine.tokenizer = tiny_tokenizer()
    return engine


def _kinds() -> list[str]:
    import test_conformance as tc

    return tc.KINDS


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("kind", _kinds())
def test_engine_on_the_device(pool_root, kind, mode):
    """metasd's engine with its verifier on the device and one drafter of ``kind`` gives the CPU's tokens (greedy:
    the verifier's greedy decoding; sampled: the CPU engine's tokens for the same seed, as a device generator
    draws the CPU's numbers). A combination listed in ``KNOWN_CRASHES`` is an expected failure while it crashes
    where listed; it fails if it crashes elsewhere (the message says where) or stops crashing (remove its line)."""
    import test_conformance as tc

    kwargs = {} if mode == "greedy" else {"temperature": 1.0, "seed": 0}
    known = KNOWN_CRASHES.get((kind, mode))
    try:
        result = _engine(pool_root, kind, NAME).generate(tc.PROMPT, max_new_tokens=10, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the crash is what is tested
        site = _crash_site(exc)
        message = f"{kind}/{mode} crashes at {site[0]}: {site[1]}\n  {type(exc).__name__}: {exc}"
        if known is not None and site[0] == known[0] and site[1].startswith(known[1]):
            pytest.xfail(f"known: {message}\n  why: {known[2]}")
        raise AssertionError(f"{message}\n  (KNOWN_CRASHES says {known[:2] if known else 'it runs'})") from exc
    if known is not None:
        pytest.fail(f"{kind}/{mode} no longer crashes at {known[0]} ({known[1]}): remove it from KNOWN_CRASHES")
    if mode == "greedy":
        want = plain_greedy(tiny_qwen(seed=0, layers=tc.LAYERS, logit_scale=tc.SHARPNESS), tc.PROMPT, 10)
    else:
        want = _engine(pool_root, kind, "cpu").generate(tc.PROMPT, max_new_tokens=10, **kwargs).token_ids
    assert result.token_ids == want
    assert result.stats.drafted > 0, f"{kind}: drafted nothing, so the device path of drafting went unchecked"



#: a request's processing of the verifier's rows, which model drafters apply to their own rows too
PROCESSING = dict(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={12: 1.5, 9: -2.0}, min_tokens=4,
                  bad_words=["w33 w12", "w41"], allowed_token_ids=[t for t in range(64) if t not in (7, 30)])


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["pretrained", "pretrained_tree"])
def test_processing_along_drafts_on_the_device(pool_root, kind, mode):
    """A request with processing (penalties, bias, min_tokens, bad words, allowed ids) on the device: the model
    drafter processes its own rows along its draft paths there (``DraftProcessing``) and gives the CPU's tokens."""
    import test_conformance as tc

    kwargs = dict(PROCESSING, **({} if mode == "greedy" else {"temperature": 1.0, "seed": 0}))
    result = _engine(pool_root, kind, NAME).generate(tc.PROMPT, max_new_tokens=12, **kwargs)
    assert result.token_ids == _engine(pool_root, kind, "cpu").generate(tc.PROMPT, max_new_tokens=12,
                                                                          **kwargs).token_ids
    assert result.stats.accepted > 0, f"{kind}: nothing accepted, so the drafter's processed rows went unchecked"

# ---------------------------------------------------------------------------------------------- syncs per step
REQUEST_LEVEL = ("(_finish)",)  # the request's end (its start is counted apart: ``_syncs_per_step``)


def _syncs_per_step(engine, prompt, **kwargs):
    """Host-device synchronisations of each decoding step (one ``next`` of the request's step loop each; the request's
    own, at its start - prefill, the drafters' ``begin`` - and its end, apart), the steps' drafts, and the drafter's own
    forwards per step (a tree: one per level; ``Draft.meta``). Returns (per-step event lists, request-level events, drafts, levels, report)."""
    drafter = engine.drafters[0]
    drafts: list = []
    propose = drafter.propose
    drafter.propose = lambda ctx: drafts.append(propose(ctx)) or drafts[-1]
    request = engine._run(prompt, **kwargs)
    start = request._start
    request_level: list = []

    def counted_start():  # the request's start (prefill, the drafters' begin) runs inside the first ``next``
        with count_host_reads() as counted:
            start()
        request_level.extend(counted.events)

    request._start = counted_start
    steps = request.steps()
    per_step, report = [], []
    while True:
        with count_host_reads() as counted:
            try:
                next(steps)
                done = False
            except StopIteration:
                done = True
        events = list(counted.events)
        if not per_step:
            for e in request_level:
                events.remove(e)
        events = [e for e in events if not e[2].endswith(REQUEST_LEVEL) or request_level.append(e)]
        if done:  # the end of the request: nothing of a step's
            assert not events, events
            break
        per_step.append(events)
        report.append("\n".join(f"{k:15s} {op:32s} {where}" for k, op, where in events))
    levels = [int(d.meta.get("drafter_forwards", 1)) for d in drafts]
    return per_step, request_level, drafts, levels, "\n---\n".join(report)


@pytest.mark.parametrize("kind", ["pretrained", "pretrained_tree", "static_tree", "ngram", "suffix", "pretrained loop",
                                  "static_tree loop"])
def test_greedy_steps_stay_within_the_sync_budget(pool_root, kind):
    """Greedy: ONE host-device synchronisation per step with a chain drafter (the chain is drafted on the device, fed
    to the verifier from there, and read once with the verifier's choices: ``Draft.read_with``), a static tree drafter
    (the same, its shape fixed) or a lookup drafter (its host draft: the verifier's choices alone), one + one per tree
    level with the dynamic tree drafter (each level's top-k read to grow the tree). Every kind counts: reads, blocking
    copies to the device, device syncs. A step makes none of the last two: host data goes to the device staged
    (``metasd.core.execution.staging``) and the step clock does not synchronise (``Engine.profile`` off); the request
    synchronises its clock at its start, when its prefill is done and at its end. "loop": the drafting loop after the
    catch-up run as one fixed-shape loop (``DraftLoops``, the buffers a CUDA graph replays), on the device."""
    import test_conformance as tc
    from metasd.core.execution.draft_loop import DraftLoops

    kind, looped = kind.removesuffix(" loop"), kind.endswith(" loop")
    engine = _engine(pool_root, kind, NAME)
    if looped:
        d = engine.drafters[0]
        d.loops = DraftLoops(d.model, d.draft_head, capture=False, name=d.name)
    per_step, request_level, drafts, levels, report = _syncs_per_step(engine, tc.PROMPT, max_new_tokens=24)
    assert len(per_step) == len(drafts) > 3 and sum(len(d) for d in drafts) > 0
    grown = kind == "pretrained_tree"  # reads each level's top-k to grow; a static tree's shape is fixed: no read
    budgets = [1 + (lv if grown else 0) for lv in levels]
    over = [(i, len(e), b) for i, (e, b) in enumerate(zip(per_step, budgets)) if len(e) > b]
    assert not over, f"{kind}: steps over budget (step, syncs, budget): {over}\n{report}"
    blocking = [(i, e) for i, events in enumerate(per_step) for e in events if e[0] in ("h2d", "sync")]
    assert not blocking, f"{kind}: blocking copies or device syncs in steps (step, event): {blocking}"
    assert [k for k, _, _ in request_level if k == "sync"] == ["sync"] * 3, request_level  # start, prefill done, end
    if looped:
        assert sum(loop.stats.eager for loop in d.loops.loops.values()) == sum(1 for x in drafts if len(x)) > 3


def test_a_profiling_engine_synchronises_its_clock_three_times_a_step(pool_root):
    """``Engine.profile``: each of the step's three clock reads waits for the device (counted as syncs)."""
    import test_conformance as tc

    engine = _engine(pool_root, "ngram", NAME)
    engine.profile = True
    per_step, _, _, _, report = _syncs_per_step(engine, tc.PROMPT, max_new_tokens=12)
    assert [sum(k == "sync" for k, _, _ in e) for e in per_step] == [3] * len(per_step), report


def test_syncs_per_step_reported_for_sampling(pool_root, capsys):
    """Sampling reads more (each sample-and-match row and each rejection test reads a draw): the figures, reported,
    not budgeted; still no blocking copy to the device and no clock sync in a step."""
    import test_conformance as tc

    figures = {}
    for kind in ("pretrained", "pretrained_tree", "ngram"):
        per_step, _, _, _, _ = _syncs_per_step(_engine(pool_root, kind, NAME), tc.PROMPT, max_new_tokens=24,
                                               temperature=1.0, seed=0)
        figures[kind] = sum(len(e) for e in per_step) / len(per_step)
        assert not [e for events in per_step for e in events if e[0] in ("h2d", "sync")], kind
    with capsys.disabled():
        print("\nhost-device syncs per sampled step:", {k: round(v, 1) for k, v in figures.items()})
    assert all(v > 0 for v in figures.values())


def _sampling_engine(case: str, seeded: str = "stream"):
    from metasd.core import Engine, Verifier
    from metasd.drafters import PretrainedDrafter, StaticTreeDrafter
    from test_exact_depth import SHARP, V

    verifier = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP).to(DEV)
    drafter_model = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=SHARP / 2).to(DEV)
    drafter = PretrainedDrafter(drafter_model, k=3) if case == "chain" else \
        StaticTreeDrafter(drafter_model, widths=[2, 2, 1], name="static")
    return Engine(Verifier(verifier), drafter, check_tokenizers=False, seeded_sampling=seeded)


@pytest.mark.parametrize("case", ["chain", "static"])
def test_sampling_on_the_device_is_exact(case):
    """On a device, acceptance draws every row at once - the chain's ratio rule all its tests together
    (``_reject_chain``), sample-and-match a draw per row (``accept_match``): the joint of three sampled tokens follows
    the verifier (the check of tests/test_exact_depth.py, on the device; seeded keyed noise chooses the CPU's tokens,
    ``test_engine_on_the_device``)."""
    from test_exact_depth import ALPHA
    from sampling_check import joint_check

    n = 2000  # the CPU tests' 5000 draws cost four minutes on this device; a wrong rule scores far below ALPHA
    check = joint_check(_sampling_engine(case), [3], n, length=3)
    assert check.pvalue > ALPHA, f"three sampled tokens do not follow the verifier: {check}"
    tried, taken = check.tried_at(2), check.taken_at(2)
    assert taken >= n // 10 and tried - taken >= n // 20, f"depth 2 was not exercised both ways: {check}"


@pytest.mark.parametrize("case, seeded", [("chain", "stream"), ("static", "stream"), ("static", "keyed")])
def test_a_sampled_step_reads_the_device_once(case, seeded):
    """The chain's ratio rule (its drafter's probabilities), sample-and-match (a static tree's draft has none) and a
    seeded request's keyed noise: one host read a step on a device, with the draft's tokens."""
    engine = _sampling_engine(case, seeded)
    per_step, _, drafts, _, report = _syncs_per_step(engine, [3], max_new_tokens=16, temperature=1.0, seed=7)
    assert len(per_step) > 3 and all(len(e) == 1 for e in per_step), report
    assert (drafts[0].probs is not None) == (case == "chain")


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("reward", ["throughput", "wall_throughput", "block_efficiency", "block_divergence"])
def test_the_engine_under_each_reward_on_the_device(pool_root, reward, mode):
    """A two-arm pool (a model chain with probabilities, prompt lookup without) chosen by UCB from each reward: on the
    device as on the CPU (the wall-clock reward reads the clock, so only its run completing is compared)."""
    import test_conformance as tc
    from metasd.config import load_pool

    def engine(device):
        pool = {"verifier": {"model": str(pool_root / "verifier"), "dtype": "fp32", "device": device},
                "drafters": [{"name": "chain", "type": "pretrained", "model": str(pool_root / "drafter"), "params": {"k": 3}},
                             {"name": "ngram", "type": "ngram", "params": {"k": 4, "n_max": 2}}],
                "policy": {"name": "ucb", "params": {"c": 1.0, "normalize": True}}, "reward": reward}
        path = pool_root / f"pool_reward_{reward}_{device}.yaml"
        path.write_text(yaml.safe_dump(pool))
        e = load_pool(path)
        e.tokenizer = tiny_tokenizer()
        return e

    kwargs = {} if mode == "greedy" else {"temperature": 1.0, "seed": 3}
    on_device = engine(NAME).generate(tc.PROMPT, max_new_tokens=16, **kwargs)
    assert len(on_device.stats.rewards) == on_device.stats.steps and all(r >= 0 for r in on_device.stats.rewards)
    if reward != "wall_throughput":
        on_cpu = engine("cpu").generate(tc.PROMPT, max_new_tokens=16, **kwargs)
        assert on_device.token_ids == on_cpu.token_ids
        assert on_device.stats.drafter_per_step == on_cpu.stats.drafter_per_step
        assert on_device.stats.rewards == pytest.approx(on_cpu.stats.rewards, rel=1e-5)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("kind", _kinds())
def test_no_step_of_any_drafter_type_copies_to_the_device_blocking(pool_root, kind, mode):
    """Every drafter type stages what it sends to the device (``metasd.core.execution.staging``): no blocking copy to
    the device and no clock sync in any step, greedy or sampled (the budget above bounds the reads of four of them)."""
    import test_conformance as tc

    if (kind, mode) == ("replay", "sampled"):
        pytest.skip("replay records the greedy text again in every sampled step that leaves it (transformers' generate "
                    "inside the step, by design: a drafter for greedy benchmarks; rerecord=False raises instead)")
    kwargs = {} if mode == "greedy" else {"temperature": 1.0, "seed": 0}
    per_step, _, _, _, _ = _syncs_per_step(_engine(pool_root, kind, NAME), tc.PROMPT, max_new_tokens=12, **kwargs)
    blocking = [(i, e) for i, events in enumerate(per_step) for e in events if e[0] in ("h2d", "sync")]
    assert not blocking, f"{kind}/{mode}: blocking copies or device syncs in steps (step, event): {blocking}"


# --------------------------------------------------------------------------------- one read per step, batched
def _dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEV)


def test_a_drafts_tokens_stay_on_the_device_until_read_with_the_verifiers_choices():
    """``DeviceTokens``: a chain drafted on the device is handed to the verifier from there (``device_tokens``, no
    read) and read once with the verifier's choices (``read_with``); its prefixes (``Draft.first``) read with it, and
    every later reader takes the host copy."""
    from metasd.core.execution.tree import DeviceTokens, Draft

    drafted = DeviceTokens(_dev(torch.tensor([5, 6, 7])))
    draft = Draft.chain(drafted).first(2)  # a node budget cut it: its first two
    choices = _dev(torch.tensor([5, 6, 9]))
    with count_host_reads() as reads:
        assert draft.device_tokens(DEV).device == DEV and len(draft) == 2 and not draft.on_host
        assert draft.read_with(choices) == [5, 6, 9]
        assert draft.tokens.tolist() == [5, 6] and drafted.host() == [5, 6, 7] and draft.on_host
        assert draft.read_with(choices) == [5, 6, 9]  # read again: the choices alone
    assert dict(reads) == {"to_cpu": 2}, reads.report()
    other = Draft.chain(DeviceTokens(_dev(torch.tensor([3, 4]))))
    with count_host_reads() as reads:
        assert other.tokens.tolist() == [3, 4]  # asked first: read alone
    assert dict(reads) == {"to_cpu": 1}, reads.report()


def test_host_reads_of_one_round_are_one_transfer():
    """``HostRead.run_together``: the reads of a drafting round (of any shapes) come back as each one's ``tolist``,
    from one transfer."""
    from metasd.core.execution.host_read import HostRead

    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor([7.0]), torch.tensor(8.0), torch.zeros(2, 0, 2)]
    reads = [HostRead(_dev(t)) for t in tensors]
    with count_host_reads() as counted:
        got = HostRead.run_together(reads)
    assert got == [t.tolist() for t in tensors] and counted.total == 1, counted.report()
    assert [r.run() for r in reads] == [t.tolist() for t in tensors]


def _scheduler_on_the_device(kind, adaptive=False, fixed=False):
    """A tiny engine on the device with a drafter of ``kind`` (test_scheduler's pools), and the per-step events of a
    scheduler serving test_scheduler's four prompts with it (``adaptive``: drafts sized by an ``AdaptiveSpeculation``
    over a forward cost rising with tokens; ``fixed``: the batched forwards at fixed shapes, batch_runner.py and
    draft_rows.py): (events of each ``_step`` bar the requests' own clock syncs, forwards
    verified in each, results, what ``Engine.generate`` gives each prompt alone)."""
    import test_scheduler as ts
    from metasd.core.batching.adaptive import AdaptiveSpeculation
    from metasd.core.batching.scheduler import Scheduler
    from metasd.core.engine import Engine
    from metasd.core.execution.verifier import Verifier
    from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter, StaticTreeDrafter, SuffixDrafter

    # with ``fixed``, the model drafters' forks draft over one set of rows at fixed shapes too (draft_rows.py)
    drafter = {"chain": lambda: PretrainedDrafter(tiny_qwen(seed=0, logit_scale=2.0).to(DEV), k=4, name="chain",
                                                  fixed_shapes=fixed),
               "tree": lambda: PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0).to(DEV), nodes=8, depth=3,
                                                     width=2, name="tree", fixed_shapes=fixed),
               "static_tree": lambda: StaticTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0).to(DEV), widths=[2, 2, 1],
                                                        name="static", fixed_shapes=fixed),
               "suffix": SuffixDrafter, "none": lambda: None}[kind]()
    engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=4.0).to(DEV), tiny_tokenizer(), fixed_shapes=fixed),
                    drafter, check_tokenizers=False)
    alone = [engine.generate(p, n).token_ids for p, n in zip(ts.PROMPTS, ts.MAX_NEW)]
    events, verified = [], []
    sizing = AdaptiveSpeculation(lambda n: 1.0 + 0.05 * n, max_width=12) if adaptive else None
    with Scheduler(engine, max_batch=4, adaptive=sizing) as s:
        step, verify = s._step, s.verifier.verify
        s.verifier.verify = lambda *a: verified.__setitem__(-1, verified[-1] + 1) or verify(*a)

        def counted_step():
            verified.append(0)
            with count_host_reads() as counted:
                step()
            events.append([e for e in counted.events if not e[2].endswith(("(open)", "(prefilled)", "(_finish)"))])

        s._step = counted_step
        handles = [s.submit(p, n) for p, n in zip(ts.PROMPTS, ts.MAX_NEW)]
        results = [h.result(timeout=120) for h in handles]
    rows = getattr(drafter, "rows", None)
    assert (rows is not None) == (fixed and kind not in ("suffix", "none"))
    assert rows is None or rows.runner.stats.eager > 0 and not rows.held  # levels ran on the rows; all given back
    return events, verified, results, alone


@pytest.mark.parametrize("kind", ["none", "chain", "suffix", "tree", "static_tree", "chain adaptive", "chain fixed",
                                  "tree fixed", "static_tree fixed"])
def test_a_scheduler_step_reads_the_device_once_for_its_whole_batch(kind):
    """A scheduler's greedy step reads the device ONCE for all its requests (``read_choices``: every row's greedy
    choices and every chain drafted on the device, in one transfer; and once more in a step where requests joined,
    for all their first tokens) - with a tree drafter, one more per tree level, for the whole batch too
    (``HostRead``: the requests' top-k joined; a static tree's shape is fixed: none) - and copies nothing to it
    blocking; the tokens are what each request gets alone."""
    kind, *flags = kind.split()
    events, verified, results, alone = _scheduler_on_the_device(kind, adaptive="adaptive" in flags,
                                                                fixed="fixed" in flags)
    assert [r.token_ids for r in results] == alone
    assert sum(verified) > 3 and sum(r.stats.drafted for r in results) > 0 or kind == "none"
    report = "\n---\n".join("\n".join(f"{k:8s} {op:28s} {w}" for k, op, w in e) for e in events)
    blocking = [(i, e) for i, step in enumerate(events) for e in step if e[0] in ("h2d", "sync")]
    assert not blocking, f"{kind}: blocking copies or syncs in scheduler steps (step, event): {blocking}"
    levels = 3 if kind == "tree" else 0  # the tree's depth: a read per level at most (joined across requests)
    # and one more in a step where requests joined: their first tokens, drawn with their prefills, read together
    firsts = [sum(w.endswith("(send_first_tokens)") for _, _, w in e) for e in events]
    assert max(firsts) == 1 and sum(firsts) >= 1, firsts
    over = [(i, len(e), n) for i, (e, n, f) in enumerate(zip(events, verified, firsts))
            if len(e) - f > n * (1 + levels)]
    assert not over, f"{kind}: steps over one read (+ one per tree level) (step, reads, verified):{over}\n{report}"
