"""Smoke test on the real bundled pair (Qwen2.5-Coder 1.5B verifier, 0.5B drafter), run by CI.

fp32, greedy, 2 prompts x 24 new tokens: metasd's output must be token-identical to transformers' plain
greedy decoding with the fp32 0.5B chain drafter, with the int4 0.5B tree and with the default pool's drafter (a
cascade: suffix decoding, then the int4 tree, fused into one tree), whose log-probabilities are also the verifier's
from one forward over the prompt and the answer.
Skipped only when the model packages are not installed (the README's test command installs them); set
METASD_REQUIRE_REAL=1 to make a missing package a failure. The n-gram drafter and every other family are
checked on tiny models (tests/test_conformance.py); this test is about the real models and their kernels.
"""
import os

import pytest
import torch

from metasd import Engine, Verifier
from metasd.bench import baselines
from metasd.drafters import FusedDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter
from metasd.models import ModelLoadError, load_model
from metasd.models.quantize import quantize_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Translate to English: 'Der schnelle braune Fuchs springt über den faulen Hund.'",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def pair():
    # alone, both cores; beside another pytest-xdist worker (which runs tiny models on one thread), one
    threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    torch.set_num_threads(threads)
    try:
        vm, vt = load_model("bundled:qwen2.5-coder-1.5b-instruct", dtype="fp32")
        dm, dt = load_model("bundled:qwen2.5-coder-0.5b-instruct", dtype="fp32")
    except ModelLoadError as e:
        if os.environ.get("METASD_REQUIRE_REAL") == "1":
            raise
        pytest.skip(f"bundled models unavailable: {e}")
    yield vm, vt, dm, dt
    torch.set_num_threads(1)


def test_bundled_pair_is_token_identical_to_plain_greedy(pair):
    vm, vt, dm, dt = pair
    verifier = Verifier(vm, vt, name="bundled:qwen2.5-coder-1.5b-instruct")
    ids = [Engine(verifier).encode([{"role": "user", "content": p}]) for p in PROMPTS]
    references = [baselines.plain(vm, x, NEW_TOKENS)[0] for x in ids]
    accepted = {}

    def check(name: str, engine: Engine, logprobs: bool = False) -> None:
        accepted[name] = 0
        for prompt, x, reference in zip(PROMPTS, ids, references):
            result = engine.generate(x, max_new_tokens=NEW_TOKENS, logprobs=0 if logprobs else None)
            assert result.token_ids == reference, f"{name} diverged on {prompt[:40]!r}"
            accepted[name] += result.stats.accepted
            if logprobs:  # the verifier's raw log-probabilities, from the rows that accepted the drafts
                with torch.no_grad():
                    logits = vm(input_ids=torch.tensor([x + reference[:-1]])).logits[0, len(x) - 1:]
                full = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(reference)[:, None])[:, 0]
                assert [s.logprob for s in result.logprobs] == pytest.approx(full.tolist(), abs=1e-3), name

    check("0.5B chain", Engine(verifier, PretrainedDrafter(dm, dt, k=5)))
    # the default pool's drafter: the same 0.5B weights quantized to int4 in place, so the suite never holds
    # two fp32 copies of the drafter (the suite's peak memory is this test's)
    quantize_model(dm, "int4", name="bundled 0.5B", prefill_copy=True)
    tree = PretrainedTreeDrafter(dm, dt, mode="dynamic", nodes=32, depth=16, width=4, min_path_prob=0.3)
    check("0.5B int4 tree", Engine(verifier, tree))
    # the default pool (configs/default.yaml): suffix decoding first, the int4 tree where its draft is short
    suffix = SuffixDrafter(max_depth=16, max_nodes=16, name="suffix")
    check("default cascade", Engine(verifier, FusedDrafter([suffix, tree], enough=6, name="cascade")), logprobs=True)
    # the real drafters are actually used and accepted; int4 drafts nearly as well as fp32
    assert accepted["0.5B chain"] > 0 and accepted["0.5B int4 tree"] > 0.5 * accepted["0.5B chain"]
    assert accepted["default cascade"] > 0.5 * accepted["0.5B chain"]


def test_bundled_pair_calls_a_named_tool_in_its_own_format(pair):
    """A named tool choice on the bundled 1.5B: the grammar of Qwen's own call format (``<tool_call>`` as its token),
    the arguments valid under the tool's schema, the same tokens with the 0.5B drafting as without."""
    from metasd.core.constraints import Constraint
    from metasd.serve.tools import HermesParser, added_tokens

    vm, vt, dm, dt = pair
    verifier = Verifier(vm, vt, name="bundled:qwen2.5-coder-1.5b-instruct")
    weather = {"name": "get_weather", "description": "The current weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    ids = Engine(verifier).encode([{"role": "user", "content": "What is the weather in Paris right now?"}],
                                  tools=[{"type": "function", "function": weather}])
    grammar = Constraint.grammar_of(HermesParser().grammar([weather], parallel=False, added=added_tokens(vt)))
    plain = Engine(verifier).generate(ids, max_new_tokens=32, constraint=grammar)
    speculative = Engine(verifier, PretrainedDrafter(dm, dt, k=5)).generate(ids, max_new_tokens=32,
                                                                            constraint=grammar)
    assert speculative.token_ids == plain.token_ids and speculative.stats.accepted > 0
    assert plain.token_ids[0] == vt.convert_tokens_to_ids("<tool_call>")
    content, calls = HermesParser().parse(plain.text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_bundled_pair_fills_in_the_middle(pair):
    """The bundled 1.5B's own fill-in-the-middle format (Qwen's ``<|fim_prefix|>`` ... ``<|fim_middle|>`` markers):
    the line missing between a docstring and a return that uses its name, ended by the format's end-of-text; the same
    tokens with the default pool's drafter (the 0.5B tree behind suffix decoding) as without."""
    vm, vt, dm, dt = pair
    verifier = Verifier(vm, vt, name="bundled:qwen2.5-coder-1.5b-instruct")
    before = 'def mean(xs):\n    """The arithmetic mean of a non-empty list."""\n'
    after = "\n    return total / len(xs)\n\n\nprint(mean([1, 2, 3]))\n"
    prompt = Engine(verifier).encode_infill(before, after)
    plain = Engine(verifier).generate(prompt.ids, max_new_tokens=24, stop_token_ids=prompt.stop_token_ids)
    tree = PretrainedTreeDrafter(dm, dt, mode="dynamic", nodes=32, depth=16, width=4, min_path_prob=0.3)
    pool = FusedDrafter([SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"), tree], enough=6, name="cascade")
    speculative = Engine(verifier, pool).generate(prompt.ids, max_new_tokens=24, stop_token_ids=prompt.stop_token_ids)
    assert plain.text == "    total = sum(xs)" and plain.token_ids[-1] == vt.convert_tokens_to_ids("<|endoftext|>")
    assert speculative.token_ids == plain.token_ids and speculative.stats.accepted > 0
