"""Many requests at once on the llama.cpp backend (``metasd.core.execution.llama_cpp_batch``): rows of one llama.cpp
context verified in one decode, each seeing only its own committed text and tree; the scheduler on it gives
``Engine.generate``'s tokens; sequences and cells are freed as requests leave; what it does not do is refused by name.
Tiny f32 GGUFs (tests/llama_cpp_models.py), so the torch model they were converted from is the reference."""
from __future__ import annotations


import pytest
import torch

from llama_cpp_models import gguf_of, require_llama_cpp

require_llama_cpp()

from metasd.core import Engine  # noqa: E402
from metasd.core.batching.scheduler import Scheduler, SchedulerStep  # noqa: E402
from metasd.core.execution.batch_verifier import SlotVerifier  # noqa: E402
from metasd.core.execution.kv_memory import KVBudgetError  # noqa: E402
from metasd.core.execution.llama_cpp_batch import LlamaCppBatchVerifier  # noqa: E402
from metasd.core.execution.llama_cpp_verifier import LlamaCppVerifier  # noqa: E402
from metasd.core.execution.tree import Draft  # noqa: E402
from metasd.drafters import FusedDrafter, NGramDrafter, PretrainedTreeDrafter  # noqa: E402
from metasd.drafters.suffix import SuffixDrafter  # noqa: E402
from sampling_check import joint_check  # noqa: E402
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer  # noqa: E402

PROMPTS = [[4, 9, 4, 9, 4, 9, 17, 4, 9], [0], [21, 22, 23, 24, 25, 21, 22, 23, 11, 40, 41, 7, 7, 7, 12, 13, 21, 22],
           [50, 9, 3]]
MAX_NEW = [24, 9, 30, 14]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch model, its GGUF): 2 layers, 64 tokens, 4096 positions (a context of several requests)."""
    model = tiny_qwen(seed=3, vocab=64, layers=2, context=4096)
    return model, gguf_of(model, tmp_path_factory, "tiny")


@torch.no_grad()
def torch_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]  # [vocab]


def _random_draft(gen: torch.Generator) -> tuple[Draft, list[int], list[int]]:
    """A random chain or tree of 0-7 nodes: (draft, tokens, parents)."""
    n = int(torch.randint(0, 8, (1,), generator=gen))
    chain = bool(torch.randint(0, 2, (1,), generator=gen))
    parents = [i - 1 if chain else (int(torch.randint(-1, i, (1,), generator=gen)) if i else -1) for i in range(n)]
    tokens = torch.randint(0, 64, (n,), generator=gen).tolist()
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)), tokens, parents


def test_rows_see_only_their_own_text_through_joins_commits_and_leaves(tiny):
    """Rows join after prefills of their own (one in two chunks), are verified together with random chains and trees,
    commit random paths, and leave (the last row taking the hole); every row of every verify is its own path's logits,
    and the sequences and cells come back when all have left."""
    model, gguf = tiny
    v = LlamaCppVerifier(gguf, model, name="tiny", context=512)
    bv = LlamaCppBatchVerifier(v, 4)
    gen = torch.Generator().manual_seed(1)
    texts: list[list[int]] = []  # committed tokens of each row (the pending one last)
    slots: list[SlotVerifier] = []

    def join(prompt):
        prefill = bv.start_prefill(prompt[:-1])
        while not prefill.finished:
            prefill.step(3)
        slot = SlotVerifier(v, None)
        bv.join(slot, prefill)
        assert slot.row == len(slots)
        slots.append(slot)
        texts.append(list(prompt))

    for prompt in ([3, 8, 20, 5, 5, 7, 9], [1], [40, 41]):
        join(prompt)
    for step in range(10):
        if step == 3:
            bv.remove(0)  # the last row moves into row 0
            texts[0], slots[0] = texts.pop(), slots.pop()
            slots[0].row = 0
        if step == 5:
            join([9, 9, 9, 2])
        drafts = [_random_draft(gen) for _ in slots]
        outs = bv.verify([t[-1] for t in texts], [d for d, _, _ in drafts])
        for b, ((draft, tokens, parents), out) in enumerate(zip(drafts, outs)):
            assert out.logits.shape == (len(tokens) + 1, 64)
            assert torch.allclose(out.logits[0], torch_logits(model, texts[b]), atol=1e-3), f"step {step} row {b}"
            node = int(torch.randint(-1, len(tokens), (1,), generator=gen))
            path = []
            while node != -1:
                path.insert(0, node)
                node = parents[node]
            for k, i in enumerate(path, start=1):  # the accepted nodes' rows (1 + node): their own paths' logits
                expect = torch_logits(model, texts[b] + [tokens[j] for j in path[:k]])
                assert torch.allclose(out.logits[i + 1], expect, atol=1e-3), f"step {step} row {b} node {i}"
            rows = slots[b].commit(path, out)
            texts[b] += [tokens[i] for i in path] + [int(out.logits[rows[-1]].argmax())]
        bv.commit(slots)
        assert bv.cache.lengths[: len(texts)] == [len(t) - 1 for t in texts]
    while slots:
        bv.remove(len(slots) - 1)
        slots.pop()
    assert sorted(bv._free) == list(range(v.max_sequences)), "a sequence was not freed"
    lib = v.lib
    assert all(lib.llama_memory_seq_pos_max(v._memory, s) == -1 for s in range(v.max_sequences)), "cells kept"


def _tree():
    return PretrainedTreeDrafter(tiny_qwen(seed=3, vocab=64, layers=1), depth=3, width=2, nodes=6, name="tree")


def _cascade():
    return FusedDrafter([SuffixDrafter(max_depth=8, max_nodes=8, name="suffix"),
                         PretrainedTreeDrafter(tiny_qwen(seed=3, vocab=64, layers=1), mode="dynamic", nodes=8,
                                               depth=4, width=2, min_path_prob=0.3, name="model")],
                        enough=4, name="cascade")


POOLS = {"none": lambda: None, "ngram": lambda: NGramDrafter(k=4, n_max=2), "tree": _tree, "cascade": _cascade}


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_scheduler_on_the_backend_gives_engine_generate_tokens(tiny, pool):
    """Four requests through three rows (one waits, joins when a row frees) give ``Engine.generate``'s tokens on the
    same backend, which are plain greedy decoding's."""
    model, gguf = tiny
    engine = Engine(LlamaCppVerifier(gguf, model, name="tiny", context=2048), POOLS[pool](), check_tokenizers=False)
    expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    assert expected[0] == plain_greedy(model, PROMPTS[0], MAX_NEW[0])
    steps = []
    with Scheduler(engine, max_batch=3, prefill_chunk=5) as s:
        s.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) else None)
        with s._lock:  # queued together: the batch of 3 is sure to run, however loaded the machine
            handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        got = [h.result(timeout=120) for h in handles]
        bv = s.verifier
    assert [r.token_ids for r in got] == expected
    assert max(st.batch_size for st in steps) == 3
    if pool != "none":
        assert sum(r.stats.drafted for r in got) > 0 and sum(r.stats.accepted for r in got) > 0
    assert isinstance(bv, LlamaCppBatchVerifier) and sorted(bv._free) == list(range(bv.verifier.max_sequences))


def test_sampling_through_the_batched_backend_follows_the_verifier_at_depth_two(tmp_path_factory):
    """Three sampled tokens of seeded requests served eight at a time, drafted by a recursive-rejection tree of depth 2
    and verified in batched llama.cpp decodes, follow the verifier's joint distribution (enumerated from the torch
    weights the GGUF holds); the rule decided at depth 2 both ways."""
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=20.0, context=4096)  # eight requests' reservations
    drafter_model = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=10.0)
    engine = Engine(LlamaCppVerifier(gguf_of(verifier, tmp_path_factory, "sharp"), verifier, name="sharp",
                                     context=2048), PretrainedTreeDrafter(drafter_model, depth=2, mode="rsd_c",
                                                                         branching=[2, 2], nodes=6))

    def generate(prompt, seeds):
        with Scheduler(engine, max_batch=8, max_queue=len(seeds), max_draft_nodes=6) as s:
            handles = [s.submit(prompt, 3, temperature=1.0, seed=seed) for seed in seeds]
            return [h.result(timeout=300) for h in handles]

    n = 2000
    check = joint_check(engine, [3], n, length=3, generate=generate, reference=verifier)
    print(check)
    assert check.pvalue > 1e-4, f"sampled tokens do not follow the verifier: {check}"
    drafted, accepted = check.position_drafted[1], check.position_accepted[1]  # steps whose draft reached depth 2
    assert accepted >= n // 10 and drafted - accepted >= n // 20, check


def _recording(verifier, fail_on: int | None = None):
    """Wrap ``verifier._decode``: record each call's (tokens, tokens with logits); raise for a batch holding token
    ``fail_on`` as a prompt token (one without logits: drafts and generated tokens have them)."""
    calls, decode = [], verifier._decode

    def wrapped(tokens, positions, sequences, outputs):
        flags = [outputs] * len(tokens) if isinstance(outputs, bool) else list(outputs)
        calls.append((len(tokens), sum(flags)))
        if fail_on is not None and any(t == fail_on and not f for t, f in zip(tokens, flags)):
            raise RuntimeError("decode failed on purpose")
        return decode(tokens, positions, sequences, outputs)

    verifier._decode = wrapped
    return calls


def test_prompt_chunks_ride_with_the_verify_and_a_failed_decode_fails_only_its_requests(tiny):
    """A joining request's prompt chunks go into the running rows' verify decode (one llama_decode a step); a decode
    that fails fails the requests it held - the running ones and the one whose prompt chunk was in it, which must not
    run on missing cells - and the backend serves the next request right."""
    model, gguf = tiny
    engine = Engine(LlamaCppVerifier(gguf, model, name="tiny", context=2048), _tree(), check_tokenizers=False)
    expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    calls = _recording(engine.verifier)
    with Scheduler(engine, max_batch=3, prefill_chunk=4) as s:
        first = s.submit(PROMPTS[0], 150)
        next(first.events(timeout=60))  # running: the next prompt's chunks join its verifies
        got = s.submit(PROMPTS[2], MAX_NEW[2]).result(timeout=120).token_ids
    assert got == expected[2]
    assert any(0 < with_logits < n for n, with_logits in calls), "no prompt chunk rode along with a verify"

    engine.verifier._decode = LlamaCppVerifier._decode.__get__(engine.verifier)
    _recording(engine.verifier, fail_on=63)
    bad_prompt = [1, 2, 3, 4, 5, 6, 63, 7, 8, 9, 10, 11, 12]
    with Scheduler(engine, max_batch=3, prefill_chunk=4) as s:
        running = s.submit(PROMPTS[0], 150)
        next(running.events(timeout=60))
        bad = s.submit(bad_prompt, 10)
        assert list(bad.events(timeout=60))[-1].finish_reason == "error"
        assert list(running.events(timeout=60))[-1].finish_reason == "error"  # it was in the failed decode
        after = s.submit(PROMPTS[3], MAX_NEW[3]).result(timeout=60).token_ids
        bv = s.verifier
    assert after == expected[3]
    assert sorted(bv._free) == list(range(bv.verifier.max_sequences)) and not bv._broken


def test_the_first_token_comes_out_of_the_decode_that_holds_the_prompts_end(tiny):
    """No decode of the prompt alone: a request's first step verifies its prompt's last token (and its first draft)
    in the same llama_decode as the rest of its prompt, so its first token costs no forward more than the prefill."""
    model, gguf = tiny
    engine = Engine(LlamaCppVerifier(gguf, model, name="tiny", context=2048), _tree(), check_tokenizers=False)
    expected = engine.generate(PROMPTS[2], MAX_NEW[2]).token_ids
    calls = _recording(engine.verifier)
    with Scheduler(engine, max_batch=3, prefill_chunk=64) as s:
        assert s.submit(PROMPTS[2], MAX_NEW[2]).result(timeout=120).token_ids == expected
    tokens, with_logits = calls[0]
    assert tokens - with_logits == len(PROMPTS[2]) - 1 and with_logits >= 1, calls[:2]


def test_requests_cancelled_in_their_prefill_free_their_sequence(tiny):
    model, gguf = tiny
    engine = Engine(LlamaCppVerifier(gguf, model, name="tiny", context=2048), _tree(), check_tokenizers=False)
    long_prompt = list(range(60)) * 3
    prefilled = []

    def cancel_in_prefill(r):  # on the scheduler thread: cancelled after its first prefill step, well before its last
        if isinstance(r, SchedulerStep) and r.prefill_tokens:
            prefilled.append(r.prefill_tokens)
            if len(prefilled) == 1:
                h.cancel()

    with Scheduler(engine, max_batch=2, prefill_chunk=4) as s:  # 45 steps of prefill
        with s._lock:
            h = s.submit(long_prompt, 8)
            s.add_listener(cancel_in_prefill)
        events = h.events(timeout=60)
        assert list(events)[-1].finish_reason == "cancelled"
        other = s.submit(PROMPTS[0], 10).result(timeout=60)  # the backend still serves
        bv = s.verifier
    assert other.token_ids == engine.generate(PROMPTS[0], 10).token_ids
    assert sorted(bv._free) == list(range(bv.verifier.max_sequences))


def test_what_serving_on_the_backend_refuses_is_named(tiny):
    model, gguf = tiny
    engine = Engine(LlamaCppVerifier(gguf, model, name="tiny", context=512), check_tokenizers=False)
    with pytest.raises(ValueError, match="kv_budget=1024: the llama.cpp context holds 512"):
        Scheduler(engine, kv_budget=1024)
    with pytest.raises(ValueError, match="max_batch=300: the llama.cpp backend holds 256 sequences"):
        Scheduler(engine, max_batch=300)
    with Scheduler(engine, max_batch=100) as s:  # 256 sequences: 100 requests, one tree leaf each
        assert s.max_draft_nodes == 1
    expected = engine.generate([1, 2, 3], 5).token_ids
    with Scheduler(engine, max_batch=2) as s:
        assert s.max_draft_nodes == 127
        with pytest.raises(KVBudgetError, match="the llama.cpp context holds 512"):
            s.submit(list(range(50)), 400)
        assert s.submit([1, 2, 3], 5).result(timeout=60).token_ids == expected


def test_metasd_serve_on_the_backend_answers_the_openai_client(tmp_path):
    """``metasd serve --backend llama.cpp`` over a pool with adaptive speculation (the forward profiled through
    llama.cpp): concurrent greedy completions from the official client are plain greedy decoding's; the log says
    where the verifier runs and that prefix caching is on; a prompt continuing a finished one reuses its cells."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import openai
    import yaml

    from metasd.models.llama_cpp_source import converted_gguf
    from test_serve_cli import _listening

    model, tok = tiny_qwen(seed=0, context=4096), tiny_tokenizer()
    folder = tmp_path / "verifier"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    gguf = converted_gguf(str(folder), "f32", vocab=False)  # where metasd serve finds it (the user's cache)
    pool = {"verifier": {"model": str(folder), "dtype": "fp32", "context": 2048},
            "drafters": [{"name": "ngram", "type": "ngram", "params": {"k": 4, "n_max": 2}, "budgets": [2, 4]}],
            "no_speculation_arm": True, "policy": {"name": "per_load", "params": {"inner": "ucb"}},
            "reward": "throughput", "feedback": "full", "granularity": "step", "persistent": True,
            "serving": {"adaptive": True, "max_width": 8, "profile": {"token_counts": [1, 4, 16], "max_seconds": 2}}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "metasd.cli", "serve", "--pool", str(tmp_path / "pool.yaml"), "--backend",
           "llama.cpp", "--port", "0", "--served-model-name", "tiny", "--max-batch", "3", "--threads", "1"]
    prompts = [[4, 9, 4, 9, 4, 9, 17, 4, 9], [21, 22, 23, 21, 22, 23, 11], [50, 9, 3], [7, 7, 7, 7]]
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = _listening(proc, log)
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

            def complete(prompt):
                return client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=0)

            with ThreadPoolExecutor(4) as pool_:
                answers = list(pool_.map(complete, prompts))
            # prefix caching (on by default): a prompt that continues a finished one prefills only what follows it
            long_prompt = list(range(10, 50))
            first = complete(long_prompt)
            later_prompt = long_prompt + tok.convert_tokens_to_ids(first.choices[0].logprobs.tokens) + [5, 6]
            later = complete(later_prompt)
        finally:
            proc.terminate()
            proc.wait(60)
        text = log.read_text()
        for prompt, answer in zip(prompts, answers):
            expected = tok.convert_ids_to_tokens(plain_greedy(model, prompt, 16))
            assert answer.choices[0].logprobs.tokens == expected, text
            assert answer.usage.completion_tokens == 16
        assert later.usage.prompt_tokens_details.cached_tokens >= len(long_prompt)
        assert later.choices[0].logprobs.tokens == tok.convert_ids_to_tokens(plain_greedy(model, later_prompt, 16))
        assert "verifier: " in text and "on llama.cpp" in text and "prefix caching on" in text, text
        assert "llama.cpp" in text.split("adaptive speculation")[1].splitlines()[0], text  # the profile's line
    finally:
        gguf.unlink(missing_ok=True)  # converted into the user's cache, keyed by this temporary directory
