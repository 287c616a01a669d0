"""A static-tree arm trace-replayed at its captured drafting cost (drafters/trace_loop.py), run on the CPU over the
buffers a CUDA graph replays (``fixed_shapes``): the replaying verifier's own greedy text in exactly the recorded
steps, one fixed-shape catch-up and one drafting loop per drafting step, alone and inside the GPU default's cascade;
a trace of another shape refused; a scheduler's forks replaying through one loop over their rows."""
import pytest

from metasd.core import Engine, Verifier
from metasd.drafters import FusedDrafter, SuffixDrafter
from metasd.drafters.static_tree import StaticTreeDrafter
from metasd.drafters.trace import PromptTrace, Trace, TraceMiss
from metasd.drafters.trace_record import record_arm
from metasd.drafters.trace_loop import LoopTraceDrafter
from test_trace_replay import PROMPT, _noisy
from tiny import plain_greedy, tiny_qwen

N = 28
WIDTHS = [2, 2, 1]


def replay_on_other(trace, verifier, prompts, max_new):
    """``trace``'s prompts replayed on other prompt ids with ``verifier``'s own greedy text (8 tokens past each
    request's): the ids, and each request's continuation the replay must commit."""
    replay_prompts, continuations = [], []
    for i, (prompt, n) in enumerate(zip(prompts, max_new)):
        ids = [(t * 7 + 3 + i) % 64 for t in prompt]
        G = plain_greedy(verifier, ids, n + 8)
        trace.prompts[i].replay_on(ids, G)
        replay_prompts.append(ids)
        continuations.append(G[:n])
    return replay_prompts, continuations


def _arm(kind: str, model):
    tree = StaticTreeDrafter(model, widths=WIDTHS, name="arm" if kind == "static" else "tree")
    if kind == "static":
        return tree
    return FusedDrafter([SuffixDrafter(max_depth=6, max_nodes=8, name="suffix"), tree], enough=3, name="arm")


@pytest.mark.parametrize("kind", ["static", "cascade"])
def test_a_static_tree_arm_replays_through_its_loop_in_the_recorded_steps(kind):
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    real = Engine(Verifier(verifier), _arm(kind, drafter), check_tokenizers=False).generate(PROMPT, max_new_tokens=N)
    taus = real.stats.tokens_per_step
    assert max(taus) > 2 and min(taus) == 1  # a mix of accepted and rejected drafts
    R = plain_greedy(verifier, PROMPT, N + 8)
    steps = record_arm(_arm(kind, drafter), PROMPT, R, N)
    trace = Trace([PromptTrace("p0", len(PROMPT), N, {"arm": steps})])

    other_verifier, other_drafter = tiny_qwen(seed=5, logit_scale=4.0), tiny_qwen(seed=6)
    prompt = [(t * 7 + 3) % 64 for t in PROMPT]
    G = plain_greedy(other_verifier, prompt, N + 8)
    trace.prompts[0].replay_on(prompt, G)
    arm = LoopTraceDrafter(trace, "arm", other_drafter, WIDTHS, vocab=64, fixed_shapes=True)
    replayed = Engine(Verifier(other_verifier), arm, check_tokenizers=False).generate(prompt, max_new_tokens=N)
    assert replayed.token_ids == G[:N]  # exact: the replaying verifier's own greedy text
    assert replayed.stats.tokens_per_step == taus  # the recorded pool's acceptance, step by step
    starts = [1 + sum(taus[:k]) for k in range(len(taus))]  # the steps start after the prefill's token
    drafting = sum(1 for p in starts if steps[p].feeds)  # the cascade's deep lookups ran no model forward
    (loop,) = arm.loops.loops.values()
    assert loop.stats.eager == arm.loops.runner.stats.eager == drafting > 0
    assert kind == "static" or drafting < len(starts), "the cascade never let its lookup draft alone"
    assert arm.fork().loops is None  # a scheduler's fork replays over its row (below)


def test_a_trace_of_another_shape_is_refused():
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    R = plain_greedy(verifier, PROMPT, 12)
    trace = Trace([PromptTrace("p0", len(PROMPT), 4, {"arm": record_arm(_arm("static", drafter), PROMPT, R, 4)})])
    trace.prompts[0].replay_on(PROMPT, R)
    arm = LoopTraceDrafter(trace, "arm", drafter, [3, 1], vocab=64, fixed_shapes=True)
    with pytest.raises(TraceMiss, match=r"recorded 6 fed rows .* not the static tree of widths \[3, 1\] \(after a "
                                        r"catch-up, its first levels: \[0, 3\] rows\)"):
        Engine(Verifier(verifier), arm, check_tokenizers=False).generate(PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match="runs no fixed shape; replay this arm with TraceDrafter"):
        LoopTraceDrafter(trace, "arm", drafter, WIDTHS, vocab=64)  # graphs auto on a CPU, no fixed shapes


def test_requests_side_by_side_replay_their_steps_through_one_loop_over_their_rows():
    """A scheduler's forks of the arm: their catch-ups over their rows, then ONE loop for every request drafting
    (rows_loop.py, as the real static tree's forks draft) - each request still commits its replaying verifier's text
    in its recorded steps."""
    from drafting_helpers import MAX_NEW, PROMPTS, schedule_together

    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    prompts, taus = [], []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        taus.append(Engine(Verifier(verifier), _arm("static", drafter), check_tokenizers=False).generate(
            prompt, max_new_tokens=n).stats.tokens_per_step)
        R = plain_greedy(verifier, prompt, n + 8)
        prompts.append(PromptTrace(f"p{i}", len(prompt), n, {"arm": record_arm(_arm("static", drafter), prompt, R, n)}))
    trace = Trace(prompts)
    other_verifier, other_drafter = tiny_qwen(seed=5, logit_scale=4.0), tiny_qwen(seed=6)
    replay_prompts, continuations = replay_on_other(trace, other_verifier, PROMPTS, MAX_NEW)
    arm = LoopTraceDrafter(trace, "arm", other_drafter, WIDTHS, vocab=64, fixed_shapes=True)
    engine = Engine(Verifier(other_verifier, fixed_shapes=True), arm, check_tokenizers=False)
    results, _ = schedule_together(engine, replay_prompts, MAX_NEW, lambda: 0)
    assert [r.token_ids for r in results] == continuations
    assert [r.stats.tokens_per_step for r in results] == taus
    (rows,) = arm.rows
    (loop,) = rows.loops.values()
    assert loop.stats.eager > 0 and max(R for R, _ in loop.shapes) == 4 and not rows.held, loop.describe()
