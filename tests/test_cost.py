"""The modeled step cost behind the throughput reward: its arithmetic, and reproducible output under a noisy clock."""
import itertools

import numpy as np
import pytest
import torch
from torch import nn

import metasd.core.decoding.request
from metasd.core.pricing.cost import (CPU_ROW_COST, CostModel, ForwardCost, StepMeter, attach, decode_step_cost,
                                    linear_layers)
from metasd.drafters import NGramDrafter, PretrainedDrafter
from metasd.core.engine import Engine
from metasd.policies import UCB
from metasd.models.quantize import quantize_model
from metasd.core.execution.verifier import Verifier
from tiny import tiny_llama, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5, 7, 12, 9]


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0)


def test_linear_cost_is_weight_bytes_plus_priced_rows():
    model = CostModel({"dense": 0.5, "int8": 2.0, "int4": 1.0})
    assert model.linear_cost(weight_bytes=100, macs_per_row=10, fmt="dense", rows=3) == 100 + 0.5 * 10 * 3
    assert model.linear_cost(weight_bytes=100, macs_per_row=10, fmt="int8", rows=1) == 100 + 2.0 * 10
    assert CostModel.for_device("cpu").row_cost == CPU_ROW_COST
    assert CostModel.for_device("cuda").row_cost["dense"] < CPU_ROW_COST["dense"]


def test_decode_step_cost_sums_every_linear_over_one_row():
    net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4))  # fp32: 4 bytes a weight
    model = CostModel({"dense": 0.25, "int8": 0.0, "int4": 0.0})
    expected = (8 * 16 * 4 + 0.25 * 8 * 16) + ((16 * 4 + 4) * 4 + 0.25 * 16 * 4)
    assert decode_step_cost(net, model) == pytest.approx(expected)


def test_meter_counts_rows_of_hooked_forwards_only_while_open():
    net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    model = CostModel({"dense": 1.0, "int8": 0.0, "int4": 0.0})
    attach([net, net])  # twice: one hook per layer
    unit = decode_step_cost(net, model)
    meter = StepMeter(model, unit)
    net(torch.zeros(5, 8))  # outside the meter: not counted
    with meter:
        net(torch.zeros(2, 3, 8))  # 6 rows
    one_row_bytes = (8 * 16 + 16 * 4) * 4
    assert meter.total == pytest.approx(one_row_bytes + 6 * (8 * 16 + 16 * 4))
    assert meter.steps == pytest.approx(meter.total / unit)
    with pytest.raises(RuntimeError, match="already open"):
        with meter:
            with StepMeter(model, unit):
                pass


def test_a_deep_copy_of_a_hooked_network_is_counted_once_per_layer():
    import copy

    net = nn.Sequential(nn.Linear(8, 16, bias=False))
    model = CostModel({"dense": 0.0, "int8": 0.0, "int4": 0.0})
    attach([net])
    twin = copy.deepcopy(net)  # carries the hook along
    attach([twin])
    meter = StepMeter(model, 1.0)
    with meter:
        twin(torch.zeros(1, 8))
    assert meter.total == 8 * 16 * 4  # its weight bytes once, not twice


def _per_linear_cost(model: nn.Module, cm: CostModel, rows: int, head_rows: int) -> float:
    """What a forward costs summed layer by layer (each linear over the rows it computes)."""
    head = model.get_output_embeddings()
    total = 0.0
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            nbytes = sum(t.numel() * t.element_size() for t in (layer.weight, layer.bias) if t is not None)
            r = head_rows if layer is head else rows
            total += cm.linear_cost(nbytes, layer.in_features * layer.out_features, "dense", r)
    return total


@pytest.mark.parametrize("call", ["keyword", "positional", "keep_last", "keep_two", "body_only"])
def test_a_transformers_forward_is_priced_from_its_shape_as_the_sum_of_its_linear_layers(call):
    model = tiny_qwen(seed=2)
    cm = CostModel({"dense": 0.5, "int8": 0.0, "int4": 0.0})
    attach([model])
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    meter = StepMeter(cm, 1.0)
    with meter, torch.inference_mode():
        if call == "keyword":
            model(input_ids=ids)
        elif call == "positional":
            model(ids)
        elif call == "keep_last":
            model(input_ids=ids, logits_to_keep=1)
        elif call == "keep_two":
            model(input_ids=ids, logits_to_keep=2)
        else:
            model.model(input_ids=ids)  # the body alone, as a drafter with a reduced head runs it
    head_rows = {"keep_last": 1, "keep_two": 2, "body_only": 0}.get(call, 5)
    want = _per_linear_cost(model, cm, 5, head_rows)
    if call == "body_only":
        head = model.lm_head
        want -= cm.linear_cost(head.weight.numel() * 4, head.in_features * head.out_features, "dense", 0)
    assert meter.total == pytest.approx(want)


def test_pricing_puts_no_pre_hook_on_the_linear_layers_of_transformers_models(verifier_model):
    """No Python call per linear layer while decoding (~200 a forward on a real model, and no graph capture through
    them): the engine prices a transformers model per forward, from its shape; its linear layers keep exactly the
    hooks they had (the LM head's stride fix, ``metasd.core.execution.hooks``)."""
    import metasd.core.pricing.cost as cost

    drafter_model = tiny_qwen(seed=1)
    verifier, drafter = Verifier(verifier_model), PretrainedDrafter(drafter_model, k=3)
    linears = [m for model in (verifier_model, drafter_model) for m in model.modules() if isinstance(m, nn.Linear)]
    before = [dict(m._forward_pre_hooks) for m in linears]
    engine = Engine(verifier, drafter, check_tokenizers=False)
    assert [dict(m._forward_pre_hooks) for m in linears] == before
    assert not [m for m in linears if any(h is cost._count for h in m._forward_pre_hooks.values())]
    stats = engine.generate(PROMPT, max_new_tokens=9).stats  # the prefill's token, then two steps of 3 + 1
    assert stats.modeled_cost > stats.steps  # priced all the same: drafting and multi-row verifies cost more than 1


def test_quantized_layers_are_priced_by_their_stored_bytes_and_kernel():
    net = nn.Sequential(nn.Linear(64, 32, bias=False))
    dense_cost = decode_step_cost(net, CostModel())
    quantize_model(net, "int8", name="test net")
    (layer,) = linear_layers([net])
    assert layer.mode == "int8"
    int8_cost = decode_step_cost(net, CostModel())
    assert int8_cost == pytest.approx(layer.qweight.numel() + layer.scales.numel() * layer.scales.element_size() + CPU_ROW_COST["int8"] * 64 * 32)
    assert int8_cost < dense_cost  # fp32 weights: 4 bytes each against 1 (+ scales)


def test_plain_decoding_costs_one_unit_per_step(verifier_model):
    engine = Engine(Verifier(verifier_model), check_tokenizers=False)
    stats = engine.generate(PROMPT, max_new_tokens=6).stats
    assert stats.rewards == [1.0] * stats.steps  # 1 token per verifier decode step
    assert stats.modeled_cost == pytest.approx(stats.steps)
    assert stats.modeled_speedup == pytest.approx(1.0)


def test_speculative_step_cost_counts_drafter_and_verify_rows(verifier_model):
    drafter = PretrainedDrafter(tiny_qwen(seed=0), k=3)  # same weights: every draft accepted
    engine = Engine(Verifier(verifier_model), drafter, check_tokenizers=False)
    stats = engine.generate(PROMPT, max_new_tokens=9).stats  # the prefill's token, then two steps of 3 + 1
    assert stats.position_drafted == [stats.steps] * 3  # every step drafted 3 tokens
    # each step: 3 drafter forwards of at least one unit each (the drafter is the verifier's twin) plus a
    # verify of 4 rows, which costs more than one unit
    assert stats.modeled_cost > 4 * stats.steps
    assert sum(4 / r for r in stats.rewards) == pytest.approx(stats.modeled_cost)  # reward = tokens / step cost
    assert stats.modeled_speedup == pytest.approx(sum(stats.tokens_per_step) / stats.modeled_cost)
    # a derived engine re-attaches nothing twice: the same request costs the same
    again = engine.derive().generate(PROMPT, max_new_tokens=9).stats
    assert again.modeled_cost == pytest.approx(stats.modeled_cost)


def _noisy_clock(seed):
    """A perf_counter stand-in whose step durations are random (a loaded machine)."""
    rng = np.random.default_rng(seed)
    now = itertools.accumulate(rng.exponential(0.05, size=100_000))
    return lambda: next(now)


def _pool_run(verifier_model, reward, clock_seed, monkeypatch, **kwargs):
    noisy = _noisy_clock(clock_seed)  # every step clock of a request (not time.perf_counter: other threads read it)
    monkeypatch.setattr(metasd.core.decoding.request, "now", lambda device=None: noisy())
    pool = [PretrainedDrafter(tiny_qwen(seed=0), k=3, name="same"), PretrainedDrafter(tiny_llama(seed=3), k=2, name="other"),
            NGramDrafter(k=3, name="ngram")]
    engine = Engine(Verifier(verifier_model), pool, UCB(3, normalize=True), reward=reward, check_tokenizers=False)
    result = engine.generate(PROMPT, max_new_tokens=40, **kwargs)
    return result.token_ids, result.stats.drafter_per_step


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "sampled"])
def test_throughput_reward_gives_the_same_choices_and_tokens_under_a_noisy_clock(verifier_model, monkeypatch, kwargs):
    first = _pool_run(verifier_model, "throughput", 1, monkeypatch, **kwargs)
    second = _pool_run(verifier_model, "throughput", 2, monkeypatch, **kwargs)
    assert first == second
    assert len(set(first[1])) > 1  # the policy did choose between arms


def test_wall_clock_reward_choices_follow_the_noise(verifier_model, monkeypatch):
    """The control: the same runs with the wall-clock reward choose differently (what the cost model removes)."""
    first = _pool_run(verifier_model, "wall_throughput", 1, monkeypatch)
    second = _pool_run(verifier_model, "wall_throughput", 2, monkeypatch)
    assert first[1] != second[1]


def _family_drafters(verifier_model):
    """One tiny drafter of every model-backed family (built by each family's own test helpers)."""
    import test_block
    import test_hidden_state
    import test_treeflash
    from metasd.models.draft_vocab import DraftVocab
    from metasd.drafters import BlockDrafter, SteeredTreeDrafter, TreeFlashDrafter
    from metasd.drafters.steered import SteeringModule

    drafter_model = tiny_llama(seed=3)
    heads = test_block._random_heads(verifier_model)
    steering = SteeringModule.for_models(drafter_model, 32, guide_layers=[1, 2])  # the 2-layer verifier's states
    torch.nn.init.normal_(steering.proj.weight, std=0.3)
    return {
        "pretrained": PretrainedDrafter(drafter_model, k=3),
        "block": BlockDrafter(heads, refine="none", paths=3, top_m=4),
        "block+neural": BlockDrafter(heads, refine="neural", paths=3, top_m=4, model=drafter_model),
        "steered_tree": SteeredTreeDrafter(drafter_model, steering=steering, mode="dynamic", nodes=6, depth=3, width=2),
        "treeflash": TreeFlashDrafter(test_treeflash._untrained(), verifier_model, DraftVocab(torch.arange(50, 2, -1), 64),
                                      mode="chain", m=3, k=3, tree_size=6),
        "hidden_state": test_hidden_state._drafter(verifier_model),
    }


def test_every_model_backed_family_has_its_drafting_counted(verifier_model):
    """Each family's networks are found by ``Drafter.modules`` or use ``counted_linear``: a step that drafts
    costs more than its verify alone."""
    import metasd.core.pricing.cost

    for family, drafter in _family_drafters(verifier_model).items():
        costs = []
        propose = drafter.propose

        def counted(ctx, propose=propose, costs=costs):
            before = metasd.core.pricing.cost._OPEN.meter.total
            draft = propose(ctx)
            if len(draft):
                costs.append(metasd.core.pricing.cost._OPEN.meter.total - before)
            return draft

        drafter.propose = counted
        Engine(Verifier(verifier_model), drafter, check_tokenizers=False).generate(PROMPT, max_new_tokens=8)
        assert costs and min(costs) > 0, f"{family}: drafting cost nothing in the model ({costs})"
        if hasattr(drafter, "close"):
            drafter.close()


def test_pool_file_sets_the_cost_model_and_bad_prices_are_named(tmp_path):
    import yaml

    from metasd.config import ConfigError, load_pool, parse_pool_config
    from tiny import tiny_tokenizer

    tiny_qwen(seed=0).save_pretrained(tmp_path / "verifier")
    tiny_tokenizer().save_pretrained(tmp_path / "verifier")
    pool = {"verifier": {"model": str(tmp_path / "verifier"), "dtype": "fp32", "device": "cpu"}}
    (tmp_path / "default.yaml").write_text(yaml.safe_dump(pool))
    assert load_pool(tmp_path / "default.yaml").cost_model == CostModel.for_device("cpu")
    prices = {"dense": 0.5, "int8": 1.0, "int4": 2.0}
    (tmp_path / "priced.yaml").write_text(yaml.safe_dump({**pool, "cost_model": prices}))
    assert load_pool(tmp_path / "priced.yaml").cost_model == CostModel(prices)
    with pytest.raises(ConfigError, match=r"cost_model\.int4"):
        parse_pool_config({**pool, "cost_model": {**prices, "int4": -1.0}})
    with pytest.raises(ConfigError, match=r"cost_model\.int8"):
        parse_pool_config({**pool, "cost_model": {"dense": 0.5, "int4": 2.0}})


def test_a_drafters_layer_is_priced_as_dense_above_the_rows_its_dense_copy_takes():
    net = nn.Sequential(nn.Linear(64, 32, bias=False))
    model = CostModel()
    dense = nn.Sequential(nn.Linear(64, 32, bias=False))
    quantize_model(net, "int4", name="test net", prefill_copy=True, dense_rows=3)
    (layer,) = linear_layers([net])
    kernel = lambda rows: model.linear_cost(layer.kernel_bytes, 64 * 32, "int4", rows)  # noqa: E731
    dense_cost = lambda rows: model.linear_cost(64 * 32 * 4, 64 * 32, "dense", rows)  # noqa: E731 (fp32 copy)
    forward = ForwardCost.of(net, model)
    assert [forward(r) for r in (1, 3, 4, 9)] == pytest.approx([kernel(1), kernel(3), dense_cost(4), dense_cost(9)])
    attach([net])  # a hooked forward is priced the same way
    for rows, expected in ((3, kernel(3)), (4, dense_cost(4))):
        meter = StepMeter(model, 1.0)
        with meter:
            net(torch.zeros(rows, 64))
        assert meter.total == pytest.approx(expected)
    assert ForwardCost.of(dense, model)(4) == pytest.approx(dense_cost(4))
