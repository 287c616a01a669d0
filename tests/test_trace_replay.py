"""Trace-replayed acceptance (drafters/trace.py): a pool's acceptance recorded with one pair of models and replayed
on another pair (other random weights) commits the replaying verifier's own greedy text in exactly the recorded
pool's steps, with the drafter's forwards at the real drafter's shapes."""
import pytest
import torch

from metasd.core import Engine, Verifier
from metasd.drafters import FusedDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter
from metasd.drafters.trace import PromptTrace, Trace, TraceDrafter, TraceMiss
from metasd.drafters.trace_record import record_arm
from tiny import plain_greedy, tiny_qwen

PROMPT = [0, 7, 12, 9, 33, 12, 9, 41, 5, 12, 9, 33]
N = 28


def _noisy(model, scale: float, seed: int):
    """The model with noise on its head: a drafter that agrees with it often, not always."""
    torch.manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.add_(scale * torch.randn_like(model.lm_head.weight))
    return model


def _arm(kind: str, model):
    if kind == "chain":
        return PretrainedDrafter(model, k=4, name="arm")
    if kind == "tree":
        return PretrainedTreeDrafter(model, mode="dynamic", nodes=8, depth=4, width=2, name="arm")
    if kind == "suffix":
        return SuffixDrafter(max_depth=6, max_nodes=8, name="arm")
    tree = PretrainedTreeDrafter(model, mode="dynamic", nodes=6, depth=3, width=2, name="tree")
    return FusedDrafter([SuffixDrafter(max_depth=6, max_nodes=8, name="suffix"), tree], enough=3, name="arm")


class _Forwards:
    """Every forward of ``model`` (a hook): its rows, position ids and attention mask (None: causal)."""

    def __init__(self, model):
        self.rows: list[tuple] = []
        model.register_forward_hook(lambda mod, args, kwargs, out: self.rows.append(self._shape(args, kwargs)),
                                    with_kwargs=True)

    @staticmethod
    def _shape(args, kwargs) -> tuple:
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        return (int(ids.shape[-1]), None if positions is None else positions.tolist(),
                None if mask is None else mask.tolist())


@pytest.mark.parametrize("kind", ["chain", "tree", "suffix", "cascade"])
def test_a_replay_commits_its_own_verifiers_text_in_the_recorded_steps_at_the_recorded_shapes(kind):
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    real_forwards = _Forwards(drafter)
    real = Engine(Verifier(verifier), _arm(kind, drafter), check_tokenizers=False).generate(PROMPT, max_new_tokens=N)
    real_rows = list(real_forwards.rows)
    taus = real.stats.tokens_per_step
    assert max(taus) > 2 and min(taus) == 1 or kind == "suffix"  # a mix of accepted and rejected drafts

    R = plain_greedy(verifier, PROMPT, N + 8)
    assert real.token_ids == R[:N]
    real_forwards.rows.clear()
    steps = record_arm(_arm(kind, drafter), PROMPT, R, N)
    trace = Trace([PromptTrace("p0", len(PROMPT), N, {"arm": steps})])
    starts = [1 + sum(taus[:k]) for k in range(len(taus))]  # the steps start after the prefill's token
    assert [steps[p].accepted() for p in starts[:-1]] == [t - 1 for t in taus[:-1]]  # the recorded acceptance

    # another verifier and drafter (random weights: nothing in common with the recorded pair) and another prompt
    other_verifier, other_drafter = tiny_qwen(seed=5, logit_scale=4.0), tiny_qwen(seed=6)
    prompt = [(t * 7 + 3) % 64 for t in PROMPT]
    G = plain_greedy(other_verifier, prompt, N + 8)
    trace.prompts[0].replay_on(prompt, G)
    replay_forwards = _Forwards(other_drafter)
    models = [] if kind == "suffix" else [other_drafter]
    replayed = Engine(Verifier(other_verifier), TraceDrafter(trace, "arm", models, vocab=64),
                      check_tokenizers=False).generate(prompt, max_new_tokens=N)
    assert replayed.token_ids == G[:N]  # exact: the replaying verifier's own greedy text
    assert replayed.stats.tokens_per_step == taus  # the recorded pool's acceptance, step by step
    assert replay_forwards.rows == real_rows  # the real drafter's forwards: rows, positions and masks
    assert kind == "suffix" or any(mask is not None for *_, mask in real_rows) or kind == "chain"


def test_a_trace_saves_no_token_ids_and_loads_back(tmp_path):
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    R = plain_greedy(verifier, PROMPT, 16)
    steps = record_arm(_arm("tree", drafter), PROMPT, R, 8)
    Trace([PromptTrace("p0", len(PROMPT), 8, {"arm": steps})], {"pool": "test"}).save(tmp_path / "t.json")
    text = (tmp_path / "t.json").read_text()
    assert "tokens" not in text and str(R[:6])[1:-1] not in text
    back = Trace.load(tmp_path / "t.json")
    assert [s.to_json() for s in back.prompts[0].arms["arm"]] == [s.to_json() for s in steps]
    assert back.meta == {"pool": "test"}
    assert any(s.accepted() > 0 for s in steps) and any(s.accepted() == 0 for s in steps)


def test_a_replay_off_its_trace_says_where():
    verifier = tiny_qwen(seed=0)
    R = plain_greedy(verifier, PROMPT, 12)
    trace = Trace([PromptTrace("p0", len(PROMPT), 4, {"arm": record_arm(_arm("suffix", None), PROMPT, R, 4)})])
    engine = Engine(Verifier(verifier), TraceDrafter(trace, "arm", vocab=64), check_tokenizers=False)
    with pytest.raises(TraceMiss, match="no trace is replayed on this prompt"):
        engine.generate(PROMPT, max_new_tokens=3)
    trace.prompts[0].replay_on(PROMPT, R)
    assert engine.generate(PROMPT, max_new_tokens=4).token_ids == R[:4]
    with pytest.raises(TraceMiss, match="holds 4 positions, the request is at 4"):
        engine.generate(PROMPT, max_new_tokens=8)
    with pytest.raises(TraceMiss, match="has no arm 'other'"):
        Engine(Verifier(verifier), TraceDrafter(trace, "other", vocab=64),
               check_tokenizers=False).generate(PROMPT, max_new_tokens=2)


def test_a_budget_or_the_tokens_left_cut_the_recorded_draft_to_its_first_nodes_and_feed_only_theirs():
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    R = plain_greedy(verifier, PROMPT, 20)
    trace = Trace([PromptTrace("p0", len(PROMPT), 12, {"arm": record_arm(_arm("tree", drafter), PROMPT, R, 12)})])
    trace.prompts[0].replay_on(PROMPT, R)  # the recording's own verifier: on-path nodes keep their tokens
    other = tiny_qwen(seed=6)
    forwards = _Forwards(other)
    from metasd.core.decoding.drafter import StepContext
    from metasd.core.decoding.sampling import SamplingParams

    def propose(p, **cut):
        replay = TraceDrafter(trace, "arm", [other], vocab=64)
        ctx = StepContext(torch.tensor(PROMPT + R[:p]), len(PROMPT), cut.get("max_depth", 16), SamplingParams(),
                          max_nodes=cut.get("max_nodes"))
        replay.begin(ctx)
        forwards.rows.clear()
        draft = replay.propose(ctx)
        return draft, [rows for rows, positions, _ in forwards.rows[1:]]  # the drafting forwards (after catch-up)

    cut_any = False
    for p in range(12):
        full, full_rows = propose(p)
        step = trace.prompts[0].arms["arm"][p]
        assert full.parents.tolist() == step.parents  # uncut: the recorded draft, on-path nodes R's tokens
        assert [t == R[p + d - 1] for t, d in zip(full.tokens.tolist(), full.depths().tolist())] == step.on_path
        budget, budget_rows = propose(p, max_nodes=3)
        assert budget.tokens.tolist() == full.tokens[:3].tolist()
        assert budget.parents.tolist() == full.parents[:3].tolist()
        assert sum(budget_rows) <= sum(full_rows)
        shallow, shallow_rows = propose(p, max_depth=2)
        assert shallow.tokens.tolist() == full.truncated(2).tokens.tolist() and shallow.depth <= 2
        assert len(shallow_rows) <= 1  # a depth-2 draft expands level 1 only
        cut_any |= sum(budget_rows) < sum(full_rows)
    assert cut_any


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed shapes"])
def test_requests_replayed_side_by_side_in_the_scheduler_each_take_their_own_recorded_steps(fixed):
    """Four requests of different lengths at once (the serving path): each commits its replaying verifier's text in
    the steps its trace gives alone, and their drafting forwards run batched (fewer calls than one request at a
    time) - with ``fixed``, each level one fixed-shape forward over the forks' rows (draft_rows.py), as the real
    drafter's forks draft where graphs are captured."""
    from drafting_helpers import MAX_NEW, PROMPTS, schedule_together

    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    prompts, alone_steps = [], []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        R = plain_greedy(verifier, prompt, n + 6)
        alone = Engine(Verifier(verifier), _arm("tree", drafter), check_tokenizers=False).generate(
            prompt, max_new_tokens=n)
        alone_steps.append(alone.stats.tokens_per_step)
        prompts.append(PromptTrace(f"p{i}", len(prompt), n, {"arm": record_arm(_arm("tree", drafter), prompt, R, n)}))
    trace = Trace(prompts)
    other_verifier, other_drafter = tiny_qwen(seed=5, logit_scale=4.0), tiny_qwen(seed=6)
    replay_prompts, continuations = [], []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        ids = [(t * 5 + i + 1) % 64 for t in prompt]
        G = plain_greedy(other_verifier, ids, n + 6)
        trace.prompts[i].replay_on(ids, G)
        replay_prompts.append(ids)
        continuations.append(G[:n])
    calls = _Forwards(other_drafter)
    replay = TraceDrafter(trace, "arm", [other_drafter], vocab=64, fixed_shapes=fixed)
    engine = Engine(Verifier(other_verifier, fixed_shapes=fixed), replay, check_tokenizers=False)
    results, _ = schedule_together(engine, replay_prompts, MAX_NEW, lambda: len(calls.rows))
    assert [r.token_ids for r in results] == continuations
    assert [r.stats.tokens_per_step for r in results] == alone_steps
    assert (replay.rows is not None) == fixed
    if fixed:  # the levels ran over the rows, four requests at a time; every row given back
        (rows,) = replay.rows
        assert rows.runner.stats.eager > 0 and max(r for r, _, _ in rows.runner.shapes) == 4 and not rows.held
    together = len(calls.rows)
    calls.rows.clear()
    for ids, n in zip(replay_prompts, MAX_NEW):
        Engine(Verifier(other_verifier), TraceDrafter(trace, "arm", [other_drafter], vocab=64),
               check_tokenizers=False).generate(ids, max_new_tokens=n)
    assert together < len(calls.rows)  # batched drafting: one forward per level for the requests drafting together
