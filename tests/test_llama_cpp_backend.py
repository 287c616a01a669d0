"""The verifier on llama.cpp (``metasd.core.execution.llama_cpp_verifier``), on tiny random Qwen2 models converted by
llama.cpp's own converter (``convert_to_gguf``, no vocabulary: metasd hands llama.cpp token ids) to f32 GGUFs.

In f32 llama.cpp computes what torch computes up to rounding, so the torch model the GGUF was converted from is the
reference: every node of a verified tree gets the logits of its own path (the tree's sequences mask what torch's
ancestor mask does), commits keep exactly the accepted path, the engine's greedy output on the backend is the plain
greedy output, and sampled tokens follow the verifier's distribution at draft depth 2.

Needs the ``llama-cpp`` extra (llama-cpp-python) and llama.cpp's source for the converter (downloaded once from the
package index); skipped with that reason where the extra is absent, except under ``METASD_REQUIRE_LLAMA_CPP=1``
(``.ci/run``), where its absence fails the module.
"""
from __future__ import annotations

import pytest
import torch

from llama_cpp_models import gguf_of, require_llama_cpp

require_llama_cpp()

from metasd.core import Engine  # noqa: E402
from metasd.core.decoding.drafter import Drafter  # noqa: E402
from metasd.core.execution.llama_cpp_verifier import LlamaCppVerifier  # noqa: E402
from metasd.core.execution.tree import Draft  # noqa: E402
from metasd.drafters import NGramDrafter, PretrainedTreeDrafter  # noqa: E402
from metasd.drafters.suffix import SuffixDrafter  # noqa: E402
from sampling_check import joint_check  # noqa: E402
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch model, its GGUF): 2 layers, 64 tokens, 256 positions."""
    model = tiny_qwen(seed=3, vocab=64, layers=2)
    return model, gguf_of(model, tmp_path_factory, "tiny")


@torch.no_grad()
def torch_logits(model, ids: list[int]) -> torch.Tensor:
    """The torch model's next-token logits after ``ids`` (full recomputation, no cache). [vocab]"""
    return model(torch.tensor([ids])).logits[0, -1]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-3)


def test_tree_rows_are_their_paths_logits(tiny):
    model, gguf = tiny
    v = LlamaCppVerifier(gguf, model, name="tiny")
    prompt = [5, 9, 12, 7, 30, 41]
    v.prefill(torch.tensor(prompt[:-1]))
    # pending -> a, b; a -> c, d; d -> e; b -> f (leaves c, e, f; rows = 1 + node index)
    parents = [-1, -1, 0, 0, 3, 1]
    tokens = [11, 12, 13, 14, 15, 16]
    out = v.verify(prompt[-1], Draft(torch.tensor(tokens), torch.tensor(parents)))
    assert out.logits.shape == (7, 64) and out.hidden == {}
    paths = {-1: []}
    for i, p in enumerate(parents):
        paths[i] = paths[p] + [tokens[i]]
    for row, node in enumerate([-1, *range(len(tokens))]):
        expect = torch_logits(model, prompt + paths[node])
        assert close(out.logits[row], expect), f"row {row} (path {paths[node]}) differs from its path's logits"


def test_commits_keep_exactly_the_accepted_path(tiny):
    """Random trees and accepted paths, commit after commit: each next step sees only the committed text."""
    model, gguf = tiny
    v = LlamaCppVerifier(gguf, model, name="tiny")
    gen = torch.Generator().manual_seed(0)
    committed = [3, 8, 20]
    v.prefill(torch.tensor(committed[:-1]))
    for step in range(12):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
        tokens = torch.randint(0, 64, (n,), generator=gen).tolist()
        out = v.verify(committed[-1], Draft(torch.tensor(tokens), torch.tensor(parents)))
        assert close(out.logits[0], torch_logits(model, committed)), f"step {step}: the committed text was not kept"
        leaf = int(torch.randint(-1, n, (1,), generator=gen))  # accept the path to a random node (-1: none)
        path = []
        while leaf != -1:
            path.insert(0, leaf)
            leaf = parents[leaf]
        rows = v.commit(path, out)
        assert rows.tolist() == [0] + [i + 1 for i in path]
        committed += [tokens[i] for i in path] + [int(out.logits[rows[-1]].argmax())]
        assert v.cached == len(committed) - 1


def test_greedy_output_is_plain_decoding(tiny):
    """Lookup and model drafts (chains and trees) verified on llama.cpp give plain greedy decoding's tokens: the torch
    model's (full recomputation) and the backend's own without a drafter."""
    model, gguf = tiny
    prompt = [4, 9, 4, 9, 4, 9, 17, 4, 9]
    expected = plain_greedy(model, prompt, 24)
    plain = Engine(LlamaCppVerifier(gguf, model, name="tiny"))
    alone = plain.generate(prompt, max_new_tokens=24)
    assert alone.token_ids == expected
    # llama.cpp's forwards priced from the verifier's shapes, as torch's are by hooks: a plain step costs one unit
    assert alone.stats.modeled_cost == pytest.approx(alone.stats.steps)
    drafter_model = tiny_qwen(seed=3, vocab=64, layers=1)  # another model: drafts are often rejected
    for drafter in (NGramDrafter(k=4, n_max=2), SuffixDrafter(max_depth=6, max_nodes=8),
                    PretrainedTreeDrafter(drafter_model, depth=3, width=2, nodes=6)):
        engine = Engine(LlamaCppVerifier(gguf, model, name="tiny"), drafter)
        result = engine.generate(prompt, max_new_tokens=24)
        assert result.token_ids == expected, f"{drafter.name}: greedy output differs from plain decoding"
        assert result.stats.drafted > 0


def test_sampling_follows_the_verifier_at_depth_two(tmp_path_factory):
    """Three sampled tokens from a recursive-rejection tree verified on llama.cpp follow the verifier's joint
    distribution (enumerated from the torch weights the GGUF holds), and the rule decided at depth 2 both ways."""
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=20.0)
    drafter_model = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=10.0)
    engine = Engine(LlamaCppVerifier(gguf_of(verifier, tmp_path_factory, "sharp"), verifier, name="sharp"),
                    PretrainedTreeDrafter(drafter_model, depth=2, mode="rsd_c", branching=[2, 2], nodes=6))
    n = 3000
    check = joint_check(engine, [3], n, length=3, reference=verifier)
    print(check)
    assert check.pvalue > 1e-4, f"sampled tokens do not follow the verifier: {check}"
    assert check.taken_at(2) >= n // 10 and check.tried_at(2) - check.taken_at(2) >= n // 20, check


class _HiddenReader(Drafter):
    """A drafter that asks for the verifier's hidden states (and never drafts)."""

    hidden_layers = (1,)

    def propose(self, ctx):
        return Draft(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))


def test_what_the_backend_cannot_do_is_refused_by_name(tiny):
    model, gguf = tiny
    with pytest.raises(ValueError, match=r"\['reader'\] read the verifier's hidden states.*llama.cpp"):
        Engine(LlamaCppVerifier(gguf, model, name="tiny"), _HiddenReader("reader"))
    from metasd.core.execution.batch_verifier import BatchVerifier

    with pytest.raises(ValueError, match="batches torch verifiers only.*llama.cpp"):
        BatchVerifier(LlamaCppVerifier(gguf, model, name="tiny"), 4)
    v = LlamaCppVerifier(gguf, model, name="tiny", context=64)
    with pytest.raises(ValueError, match="70 positions do not fit in the llama.cpp context of 64"):
        v.prefill(torch.arange(10), reserve=70)
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        LlamaCppVerifier(gguf.with_name("no-such.gguf"), model)


def test_quantized_weights_a_build_with_amx_kernels_would_crash_on_are_refused_before_any_forward(tiny, monkeypatch):
    from metasd.core.execution import llama_cpp_verifier as backend

    amx = "CPU : AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | OPENMP = 1 | "
    assert backend.crashes_on_amx(amx, 15)  # Q4_K_M: a segmentation fault in llama_decode, seen with 0.3.36
    assert backend.crashes_on_amx(amx, 7) and backend.crashes_on_amx(amx, 2)  # Q8_0, Q4_0: seen too
    assert not any(backend.crashes_on_amx(amx, t) for t in (0, 1, 32))  # f32, f16, bf16 run
    assert not backend.crashes_on_amx(amx, None)  # not recorded: not refused
    assert not backend.crashes_on_amx(amx.replace("AMX_INT8 = 1 | ", ""), 15)  # a build without AMX runs them
    model, gguf = tiny
    assert LlamaCppVerifier(gguf, model, name="tiny").vocab_size == 64  # this f32 GGUF, on any build
    lib = backend.llama_cpp_module()
    monkeypatch.setattr(lib, "llama_print_system_info", lambda: amx.encode())
    real = lib.llama_model_meta_val_str

    def q4_k_m(m, key, buf, size):  # the file as if quantized: what the GGUF of a Q4_K_M download records
        if key != b"general.file_type":
            return real(m, key, buf, size)
        buf.value = b"15"
        return 2

    monkeypatch.setattr(lib, "llama_model_meta_val_str", q4_k_m)
    with pytest.raises(ValueError, match=r"tiny: tiny.*gguf holds quantized weights \(GGUF file type 15\).*AMX.*"
                                         r"GGML_AMX_INT8=OFF"):
        LlamaCppVerifier(gguf, model, name="tiny")


def test_a_pool_runs_on_the_backend(tiny, tmp_path):
    """``verifier: {backend: llama.cpp}`` in a pool: a local model directory converted once (f32 here), its output
    the torch pool's; settings that mean nothing there are refused when the pool is read."""
    from metasd.config import ConfigError, load_pool

    model, _ = tiny
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    base = {"verifier": {"model": str(folder), "dtype": "fp32"},
            "drafters": [{"name": "ng", "type": "ngram", "params": {"k": 4, "n_max": 2}}]}
    prompt = [4, 9, 4, 9, 4, 9, 17, 4, 9]
    reference = load_pool(overrides=base).generate(prompt, max_new_tokens=16).token_ids
    base["verifier"]["backend"] = "llama.cpp"
    engine = load_pool(overrides=base)
    assert isinstance(engine.verifier, LlamaCppVerifier)
    assert engine.generate(prompt, max_new_tokens=16).token_ids == reference
    engine.verifier.gguf.unlink()  # converted into the user's cache (keyed by this temporary directory): not kept
    for bad, field in (({"quantize": "int8"}, "quantize"), ({"threads": 2, "backend": "torch"}, "threads")):
        with pytest.raises(ConfigError, match=field):
            load_pool(overrides={**base, "verifier": {**base["verifier"], **bad}})
