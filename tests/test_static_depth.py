"""benchmarks/static_depth.py: every static tree shape within a recorded one, scored on its trace - the nodes a
smaller shape keeps, the greedy walk, the cascade's rule - on hand-made trace steps."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import static_depth  # noqa: E402
from metasd.core.execution.draft_loop import tree_shape  # noqa: E402

PARENTS = tree_shape([2, 2, 1])[0]  # 2 + 4 + 4 nodes: levels [0, 2), [2, 6), [6, 10)


def _step(on: set[int], parents=PARENTS) -> dict:
    return {"parents": parents, "on_path": "".join("1" if i in on else "0" for i in range(len(parents)))}


def test_a_smaller_shape_keeps_the_best_ranked_children_of_the_levels_it_has():
    assert static_depth.within(PARENTS, (2, 2, 1)) == [True] * 10
    assert static_depth.within(PARENTS, (1, 1, 1)) == [True, False, True, False, False, False, True, False, False,
                                                       False]
    assert static_depth.within(PARENTS, (2,)) == [True, True] + [False] * 8
    # the path through the second child of the root, then its first child, then that one's child: 3 tokens in (2, 2, 1)
    step = _step({1, 4, 8})
    assert static_depth.accepted(step) == 3
    assert static_depth.accepted(step, static_depth.within(PARENTS, (1, 1, 1))) == 0
    assert static_depth.accepted(step, static_depth.within(PARENTS, (2, 1))) == 2


def test_the_walk_takes_the_engines_steps_and_the_cascade_takes_a_deep_lookup_alone():
    static = [_step({0, 2, 6})] * 8  # the best-ranked chain: 3 accepted at every position
    assert static_depth.walk(static, None, (2, 2, 1), 6) == {"tokens": 8, "steps": 2, "verify_tokens": 22,
                                                             "drafter_forwards": 6}
    assert static_depth.walk(static, None, (1,), 6)["steps"] == 4  # 1 accepted + 1 a step
    chain = list(range(-1, 6))  # a 7-deep lookup chain, all on the path
    lookup = [_step(set(range(7)), chain)] * 8
    out = static_depth.walk(static, lookup, (2, 2, 1), 6)
    assert out["steps"] == 1 and out["drafter_forwards"] == 0 and out["verify_tokens"] == 8  # alone, the model idle
    short = [_step({0}, [-1])] * 8  # a 1-deep lookup: both drafted, the longer path wins
    assert static_depth.walk(static, short, (2, 2, 1), 6) == {"tokens": 8, "steps": 2, "verify_tokens": 24,
                                                              "drafter_forwards": 6}


def test_candidate_shapes_are_the_non_increasing_shapes_within_the_recorded_one():
    shapes = static_depth.candidate_shapes((2, 2, 1))
    assert (2, 2, 1) in shapes and (1,) in shapes and (1, 2) not in shapes and len(shapes) == len(set(shapes)) == 8
