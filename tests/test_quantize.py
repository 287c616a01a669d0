"""Weight-only quantization: kernels against their dequantized weights, model swaps, errors that name the
model and field, and losslessness with quantized drafters (greedy identity, sampling exactness) and a
quantized verifier (identical to plain decoding of the same quantized model)."""

import copy

import pytest
import torch
from torch import nn

from metasd.config import ConfigError, ModelCache, build_engine, parse_pool_config
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from metasd.core.engine import Engine
from metasd.models.quantize import (
    KERNELS, QuantizedLinear, check_quantize, dense_weight, dequantize_int4, kernel_for, quantize_int4,
    quantize_int8, quantize_model,
)
from metasd.core.execution.verifier import Verifier
from test_engine import PROMPT, _sampling_pvalue
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer


# ---------------------------------------------------------------------------------------------- formulas


def test_int8_rounds_each_weight_to_the_nearest_step_of_its_row():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.01, 0.02, -0.04, 0.03]])  # [out 2, in 4]
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8
    assert torch.allclose(s, torch.tensor([1.0 / 127, 0.04 / 127]))
    assert q[0].tolist() == [127, -64, 32, 0]  # -0.5 * 127 = -63.5 rounds to even
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()


def test_int4_groups_have_their_own_scale_and_zero():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[:, 32:] *= 100  # second group far larger: per-group scales keep the first one accurate
    q, sz = quantize_int4(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and sz.shape == (2, 16, 2)  # [groups, out, (scale, zero)]
    back = dequantize_int4(q, sz, 32)
    step = sz[..., 0].t().repeat_interleave(32, dim=1)  # [out, in] scale of each weight's group
    assert ((back - w).abs() <= step / 2 + 1e-5).all()
    assert (back[:, :32] - w[:, :32]).abs().max() < 0.5  # not the big group's step


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 80])  # 80: above gemm_rows (int8's dense path)
def test_quantized_linear_computes_with_its_dequantized_weight(mode, dtype, rows):
    torch.manual_seed(1)
    lin = nn.Linear(64, 48).to(dtype)
    ql = QuantizedLinear(lin, mode, group_size=32)
    x = torch.randn(2, rows, 64, dtype=dtype)
    dense_path = ql.has_gemm_path and rows > ql.gemm_rows
    # the reference weight is dequantized here by plain arithmetic, independently of the kernel, from the codes and
    # the scales (rounded to the kernel's dtype, as stored) of the module's own quantizers
    if mode == "int8":
        q, s = quantize_int8(lin.weight.detach())
        w = q.float() * s.to(ql.kernel_dtype).float()[:, None]  # scales stored in the kernel's dtype
    else:
        q, sz = quantize_int4(lin.weight.detach(), 32)
        w = dequantize_int4(q, sz.to(ql.kernel_dtype), 32)
    x_in = x if dense_path else x.to(ql.kernel_dtype)  # the CPU kernels take bf16 activations (fp32 ones are slow)
    ref = x_in.float() @ w.t() + lin.bias.float()
    tol = 1e-4 if dtype == torch.float32 and dense_path else 0.1 if dtype == torch.bfloat16 else 0.02
    assert ql(x).shape == (2, rows, 48) and ql(x).dtype == dtype
    assert (ql(x).float() - ref).abs().max() < tol
    # and the dequantized weight is close to the original
    err = (w - lin.weight.float()).abs().max()
    assert err < (0.02 if mode == "int8" else 0.2) * lin.weight.float().abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_kernels_get_bf16_activations_and_return_the_model_dtype(monkeypatch, mode, dtype):
    # torch's CPU int8/int4 kernels are 15-90x slower for fp32/fp16 activations than for bf16 ones
    seen = []
    kernel = KERNELS[("cpu", mode)]
    monkeypatch.setitem(KERNELS, ("cpu", mode), lambda layer, x2: seen.append(x2.dtype) or kernel(layer, x2))
    ql = QuantizedLinear(nn.Linear(64, 48).to(dtype), mode, group_size=32)
    y = ql(torch.randn(3, 64, dtype=dtype))
    assert seen == [torch.bfloat16] and y.dtype == dtype


def test_quantized_linear_keeps_no_dense_weight():
    lin = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    for mode, bytes_per_weight in (("int8", 1.0), ("int4", 0.5)):
        ql = QuantizedLinear(lin, mode, group_size=32)
        assert not any(isinstance(t, nn.Parameter) and t.is_floating_point() and t.numel() == 64 * 64
                       for t in list(ql.parameters()) + list(ql.buffers()))
        assert ql.weight_bytes < 64 * 64 * 2 * (bytes_per_weight / 2 + 0.3)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_drafters_layer_computes_many_rows_with_its_own_dense_weight(mode):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    plain = QuantizedLinear(lin, mode, group_size=32)
    assert not plain.has_dense_copy  # a verifier's: one model
    ql = QuantizedLinear(lin, mode, group_size=32, prefill_copy=True, dense_rows=5)
    assert ql.has_dense_copy and ql.has_gemm_path and ql.dense_rows == 5 and ql.weight_bytes >= 64 * 32 * 4
    many, few = torch.randn(6, 64), torch.randn(5, 64)
    assert torch.allclose(ql(many), many @ lin.weight.t() + lin.bias, atol=1e-5)  # the original weight, no codes
    assert torch.equal(ql(few), plain(few))  # few rows: the quantized kernel, as a verifier's layer computes them
    assert not torch.allclose(ql(few), few @ lin.weight.t() + lin.bias, atol=1e-4)
    assert ql.kernel_bytes == plain.kernel_bytes  # the kernel reads the codes alone


def test_the_dense_crossover_is_timed_once_per_shape_where_the_dense_path_wins_twice(monkeypatch):
    import metasd.models.quantize as mq

    # a kernel whose time grows with the rows, a dense matmul flat: the dense one wins from 8 rows
    timed = []

    def fake_best(fn, reps):
        rows, path = fn()
        timed.append((rows, path))
        return rows * 1.0 if path == "kernel" else 6.0

    monkeypatch.setattr(mq, "_best_seconds", fake_best)
    monkeypatch.setattr(mq, "_crossovers", {})
    monkeypatch.setattr(mq.QuantizedLinear, "_kernel", lambda self, x: (len(x), "kernel"))
    monkeypatch.setattr(mq.F, "linear", lambda x, w: (len(x), "dense"))
    lin = nn.Linear(64, 32)
    layer = QuantizedLinear(lin, "int4", group_size=32, prefill_copy=True)
    assert layer.dense_rows == 4  # 1, 2, 4: the kernel; 8 and 16: the dense path twice, so it stops there
    assert [r for r, path in timed if path == "kernel"] == [1, 2, 4, 8, 16]
    timed.clear()
    again = QuantizedLinear(lin, "int4", group_size=32, prefill_copy=True)
    assert again.dense_rows == 4 and timed == []  # the same shape: measured once
    other = QuantizedLinear(nn.Linear(32, 64), "int4", group_size=32, prefill_copy=True)
    assert other.dense_rows == 4 and timed  # another shape: timed again
    # a dense path that never wins: inputs above the largest count timed (a long prefill) still take it
    monkeypatch.setattr(mq, "_best_seconds", lambda fn, reps: 1.0 if fn()[1] == "kernel" else 2.0)
    slow = QuantizedLinear(nn.Linear(64, 64), "int4", group_size=32, prefill_copy=True)
    assert slow.dense_rows == mq.CROSSOVER_ROWS[-1]


def test_kernels_are_chosen_by_device_not_by_a_flag(monkeypatch):
    assert kernel_for(torch.device("cuda"), "int4") is KERNELS[("cuda", "int4")]
    assert kernel_for(torch.device("cuda", 0), "int8") is KERNELS[("cuda", "int8")]
    assert kernel_for("cpu", "int4") is KERNELS[("cpu", "int4")]
    with pytest.raises(ValueError, match="no int8 kernel for device 'meta'"):
        kernel_for(torch.device("meta"), "int8")
    # a CPU input goes through the CPU kernel
    called = []
    real = KERNELS[("cpu", "int8")]
    monkeypatch.setitem(KERNELS, ("cpu", "int8"), lambda layer, x: called.append(x.device.type) or real(layer, x))
    QuantizedLinear(nn.Linear(32, 16), "int8")(torch.randn(1, 32))
    assert called == ["cpu"]


# ---------------------------------------------------------------------------------------------- models


def test_quantize_model_swaps_every_linear_and_keeps_the_embeddings():
    model = tiny_qwen(seed=3)
    emb = model.get_input_embeddings().weight.clone()
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    quantize_model(model, "int8", name="tiny")
    assert sum(type(m) is nn.Linear for m in model.modules()) == 0
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == n_linear
    assert isinstance(model.get_output_embeddings(), QuantizedLinear)
    assert torch.equal(model.get_input_embeddings().weight, emb)
    assert model.metasd_quantize == "int8"
    assert quantize_model(model, "int8") is model  # same mode again: nothing happens
    with pytest.raises(ValueError, match="tiny: already quantized as 'int8'; it cannot also be 'int4'"):
        quantize_model(model, "int4", name="tiny")


def test_tied_lm_head_is_quantized_without_touching_the_embedding():
    model = tiny_qwen(seed=3)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, as Qwen2.5-0.5B/1.5B do
    emb = model.model.embed_tokens.weight.detach().clone()
    quantize_model(model, "int4")
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert torch.allclose(dense_weight(model.lm_head), emb, atol=0.2 * emb.abs().max())


def test_a_tied_drafters_dense_head_copy_is_the_embedding_table_itself():
    model = tiny_qwen(seed=3)
    model.lm_head.weight = model.model.embed_tokens.weight
    quantize_model(model, "int4", prefill_copy=True, dense_rows=2)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.gemm_dense.data_ptr() == embedding.data_ptr()  # one copy in memory, not two
    x = torch.randn(3, embedding.shape[1])
    assert torch.allclose(model.lm_head(x), x @ embedding.t(), atol=1e-5)  # 3 rows > 2: the dense path


@pytest.mark.parametrize("value, match", [
    ("int5", "tiny: quantize must be one of 'none', 'int8', 'int4', got 'int5'"),
    (8, "got 8"),
])
def test_bad_quantize_value_names_model_and_field(value, match):
    with pytest.raises(ValueError, match=match):
        check_quantize(value, name="tiny")


def test_unsupported_kernel_is_refused_before_any_work():
    with pytest.raises(ValueError, match="m: quantize='int4' on CUDA needs dtype bf16"):
        check_quantize("int4", name="m", dtype=torch.float32, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="m: drafters.0.quantize='int8' has no kernel on device 'meta'"):
        check_quantize("int8", name="m", field="drafters.0.quantize", device=torch.device("meta"))
    model = tiny_qwen(seed=0, vocab=40)  # the LM head's 40 outputs: not a multiple of 16 for the CPU int4 kernel
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="tiny: quantize='int4' cannot take layer 'lm_head': output size 40"):
        quantize_model(model, "int4", name="tiny")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was changed
    assert getattr(model, "metasd_quantize", "none") == "none"


# ---------------------------------------------------------------------------------------------- lossless


def _engine(verifier_model, drafter):
    return Engine(Verifier(verifier_model), drafter)


@pytest.fixture(scope="module")
def verifier_model():
    return tiny_qwen(seed=0)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("tree", [False, True])
def test_quantized_drafter_keeps_greedy_identity(verifier_model, mode, tree):
    drafter_model = quantize_model(tiny_qwen(seed=1), mode)
    drafter = (PretrainedTreeDrafter(drafter_model, nodes=8, depth=4, width=2) if tree
               else PretrainedDrafter(drafter_model, k=4))
    out = _engine(verifier_model, drafter).generate(PROMPT, max_new_tokens=40).token_ids
    assert out == plain_greedy(verifier_model, PROMPT, 40)


def test_quantized_self_drafter_drafts_well(verifier_model):
    """A drafter that is the verifier in int8 agrees with it almost always (the quantization is not noise)."""
    drafter = PretrainedDrafter(quantize_model(copy.deepcopy(verifier_model), "int8"), k=4)
    result = _engine(verifier_model, drafter).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == plain_greedy(verifier_model, PROMPT, 40)
    assert result.stats.accepted / result.stats.drafted > 0.8


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_verifier_output_is_the_quantized_models_greedy_output(mode):
    base = tiny_qwen(seed=2)  # a model whose greedy text int8 and int4 both change
    quantized = quantize_model(copy.deepcopy(base), mode)
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=1), nodes=8, depth=4, width=2)
    out = _engine(quantized, drafter).generate(PROMPT, max_new_tokens=40).token_ids
    assert out == plain_greedy(quantized, PROMPT, 40)
    assert out != plain_greedy(base, PROMPT, 40)  # int8/int4 weights change this tiny model's text


V16 = 16


@pytest.fixture(scope="module")
def pair16():
    return tiny_qwen(seed=5, vocab=V16, logit_scale=4.0), tiny_qwen(seed=6, vocab=V16, logit_scale=4.0)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("drafter", ["chain", "rsd_s"])
def test_quantized_drafter_keeps_sampling_exact(pair16, mode, drafter):
    verifier, drafter_model = pair16
    q = quantize_model(copy.deepcopy(drafter_model), mode)
    d = (PretrainedDrafter(q, k=2) if drafter == "chain"
         else PretrainedTreeDrafter(q, mode="rsd_s", width=3, nodes=9, depth=2))
    assert _sampling_pvalue(_engine(verifier, d)) > 1e-3


# ---------------------------------------------------------------------------------------------- configs


@pytest.fixture()
def tiny_dir(tmp_path):
    model = tiny_qwen(seed=0)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")


def test_model_cache_quantizes_only_the_copy_that_asked(tiny_dir):
    cache = ModelCache("cpu")
    plain, _ = cache.load(tiny_dir, "fp32")
    int8, _ = cache.load(tiny_dir, "fp32", "int8")
    assert plain is not int8 and cache.load(tiny_dir, "fp32", "int8")[0] is int8
    assert type(plain.lm_head) is nn.Linear and isinstance(int8.lm_head, QuantizedLinear)
    verifier_int4, _ = cache.load(tiny_dir, "fp32", "int4")
    drafter_int4, _ = cache.load(tiny_dir, "fp32", "int4", drafter=True)
    assert verifier_int4 is not drafter_int4
    assert not verifier_int4.model.layers[0].mlp.up_proj.has_dense_copy
    assert drafter_int4.model.layers[0].mlp.up_proj.has_dense_copy and drafter_int4.lm_head.has_dense_copy


def _pool(tiny_dir, **drafter):
    return parse_pool_config({
        "verifier": {"model": tiny_dir, "dtype": "fp32", "device": "cpu"},
        "drafters": [{"name": "d", "type": "pretrained", "model": tiny_dir, "params": {"k": 3}, **drafter},
                     {"name": "ngram", "type": "ngram"}],
    })


def test_pool_with_quantized_drafter_shares_nothing_with_the_verifier(tiny_dir):
    engine = build_engine(_pool(tiny_dir, quantize="int4"))
    drafter = engine.drafters[0]
    assert isinstance(drafter.model.lm_head, QuantizedLinear) and drafter.model.metasd_quantize == "int4"
    assert drafter.model.model.layers[0].mlp.up_proj.has_dense_copy  # a drafter's int4 keeps its dense weights
    assert type(engine.verifier.model.lm_head) is nn.Linear
    out = engine.generate(PROMPT, max_new_tokens=20).token_ids
    assert out == plain_greedy(engine.verifier.model, PROMPT, 20)


def test_pool_quantize_errors_name_the_field(tiny_dir):
    with pytest.raises(ConfigError, match=r"drafters\.0\.quantize: Input should be 'none', 'int8' or 'int4'"):
        _pool(tiny_dir, quantize="int3")
    cfg = _pool(tiny_dir)
    cfg.drafters[1].quantize = "int8"
    with pytest.raises(ConfigError, match="drafter 'ngram' of type 'ngram' has no model weights to quantize"):
        build_engine(cfg)
    cfg = _pool(tiny_dir)
    cfg.verifier.quantize = "int4"
    cfg.verifier.device = "meta"
    with pytest.raises((ConfigError, ValueError), match="meta"):
        build_engine(cfg)


def test_ngram_drafter_from_python_has_nothing_to_quantize():
    from metasd.core.decoding.drafter import BuildContext

    with pytest.raises(ValueError, match="field 'quantize' is 'int8'"):
        NGramDrafter.from_config("ng", {}, BuildContext(None, None, None, None, quantize="int8"))
