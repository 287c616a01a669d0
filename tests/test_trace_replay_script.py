"""benchmarks/trace_replay.py on tiny models (the CPU dry run of what a GPU session runs): a pool recorded with one
pair of models replays, on random weights of another shape, in exactly the recorded pool's steps, its output the
replaying verifier's own greedy text, every row timed against metasd with no drafter."""
import sys
from pathlib import Path

import pytest
import torch

from metasd.config.build import make_policy_from_config, parse_pool_config
from metasd.core import Engine, Verifier
from metasd.drafters import PretrainedTreeDrafter, SuffixDrafter
from metasd.drafters.trace import Trace
from tiny import tiny_qwen

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_replay  # noqa: E402
from gpu_overhead import build  # noqa: E402

POOL = {"verifier": {"model": "tiny-verifier"},
        "drafters": [{"name": "tree", "type": "pretrained_tree", "model": "tiny-drafter",
                      "params": {"mode": "dynamic", "nodes": 8, "depth": 4, "width": 2}},
                     {"name": "suffix", "type": "suffix", "params": {"max_depth": 6, "max_nodes": 8}}],
        "policy": {"name": "ucb"}}
PROMPTS = [("a/0", [0, 7, 12, 9, 33, 12, 9, 41, 5, 12, 9, 33]), ("b/1", [3, 4, 5, 6, 3, 4, 5, 6, 3, 4])]


def _recorded_pool():
    verifier = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = tiny_qwen(seed=0, logit_scale=4.0)
    torch.manual_seed(1)
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.05 * torch.randn_like(drafter.lm_head.weight))
    one_arm = Engine(Verifier(verifier), PretrainedTreeDrafter(drafter, mode="dynamic", nodes=8, depth=4, width=2,
                                                               name="tree"), check_tokenizers=False)
    both = Engine(Verifier(verifier), [PretrainedTreeDrafter(drafter, mode="dynamic", nodes=8, depth=4, width=2,
                                                             name="tree"), SuffixDrafter(max_depth=6, max_nodes=8,
                                                                                         name="suffix")],
                  make_policy_from_config(parse_pool_config(POOL).policy, 2), check_tokenizers=False)
    return one_arm, both


def test_record_checks_itself_against_the_pool_and_the_replay_takes_the_pools_steps(tmp_path):
    one_arm, both = _recorded_pool()
    checked = trace_replay.record_pool(one_arm, ["tree"], PROMPTS, max_new=20, margin=6, check="tree")
    for info in checked.meta["prompts"]:
        assert info["check_identical"] and info["check_mismatches"] == 0 and max(info["check_tokens_per_step"]) > 1

    trace = trace_replay.record_pool(both, ["tree", "suffix"], PROMPTS, max_new=20, margin=6)
    trace.save(tmp_path / "trace.json")
    trace = Trace.load(tmp_path / "trace.json")
    config = parse_pool_config({**POOL, "drafters": POOL["drafters"][:1]})  # the tree alone: steps comparable
    verifier, drafter = build("tiny", torch.device("cpu"), torch.float32), build("tiny", torch.device("cpu"),
                                                                                 torch.float32, seed=2, perm_seed=3)
    rows = trace_replay.replay_rows(trace, {"tree": config}, verifier, drafter, repeats=2, graphs="off",
                                    device=torch.device("cpu"))
    assert len(rows) == 2 * 2 * 2 and all(r["identical"] for r in rows)
    pool_steps = {i["name"]: len(i["check_tokens_per_step"]) for i in checked.meta["prompts"]}
    for r in rows:
        if r["method"] == "trace-replayed tree":
            assert r["steps"] == pool_steps[r["prompt"]]  # the recorded pool's acceptance
        else:
            assert r["steps"] + 1 == r["tokens"] == 20  # one token a step after the prefill's
    s = trace_replay.summary(rows)
    assert s["repeats"] == 2 and "copy_heavy" not in s and s["all"] == s["spec_bench"]
    assert s["all"]["metasd, no drafter"]["ratio_median"] == 1.0
    assert len(s["all"]["trace-replayed tree"]["tokens_per_s"]) == 2
    cut = trace_replay.summary([r for r in rows if not (r["repeat"] == 1 and r["prompt"] == "b/1")])
    assert cut["repeats"] == 1  # a repeat cut short is left out


def test_a_pool_of_two_arms_replays_under_its_policy_from_the_pool_file(tmp_path):
    _, both = _recorded_pool()
    trace = trace_replay.record_pool(both, ["tree", "suffix"], PROMPTS[:1], max_new=16, margin=6)
    config = parse_pool_config(POOL)
    verifier, drafter = build("tiny", torch.device("cpu"), torch.float32), build("tiny", torch.device("cpu"),
                                                                                 torch.float32, seed=2, perm_seed=3)
    arms = trace_replay.replay_arms(config, trace, [drafter], vocab=1024)
    assert [a.name for a in arms] == ["tree", "suffix"] and len(arms[0].models) == 1 and arms[1].models == []
    rows = trace_replay.replay_rows(trace, {"both": config}, verifier, drafter, repeats=1, graphs="off",
                                    device=torch.device("cpu"))
    assert all(r["identical"] for r in rows)
    bad = parse_pool_config({**POOL, "drafters": [{**POOL["drafters"][0], "name": "other"}]})
    try:
        trace_replay.replay_arms(bad, trace, [drafter], vocab=1024)
    except SystemExit as e:
        assert "no arm 'other'" in str(e)
    else:
        raise AssertionError("an arm missing from the trace was not refused")


@pytest.mark.parametrize("pool, trace_file, check", [("default", "trace_default.json", "cascade"),
                                                      ("gpu_default", "trace_gpu_default.json", "gpu_cascade")])
def test_the_committed_trace_holds_every_arm_of_the_default_pool_and_what_its_check_found(pool, trace_file, check):
    """benchmarks/results/trace_default.json and trace_gpu_default.json (recorded with the real models, what a GPU
    session replays): every arm of configs/default.yaml (gpu_default.yaml) is in it for every prompt, over every
    position, and its recording's check is kept."""
    from metasd.config import read_pool_config

    root = Path(__file__).resolve().parents[1]
    trace = Trace.load(root / "benchmarks" / "results" / trace_file)
    arms = [d.name for d in read_pool_config(root / "configs" / f"{pool}.yaml").drafters if d.arm]
    assert arms and {p.name.split("/")[0] for p in trace.prompts} >= {"code_edit", "quote_qa", "MT"}
    for p in trace.prompts:
        assert set(arms) <= set(p.arms) and all(len(p.arms[a]) == p.recorded_len for a in arms)
    for info in trace.meta["prompts"]:
        assert info["check_arm"] == check and info["check_mismatches"] <= len(info["check_tokens_per_step"])
