"""The prepared GPU script and its overhead benchmark, dry-run on the CPU so that neither rots before a GPU runs it:
``benchmarks/gpu_check.py --device cpu --quick`` end to end (tiny shapes, one test per pytest section), and the
benchmark's rule that a row fails loudly instead of recording inside a step."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_overhead  # noqa: E402


def test_the_dry_run_of_the_gpu_script_runs_every_section(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    result = json.loads((out / "gpu_check.json").read_text())
    s = result["sections"]
    assert result["ok"] and s["environment"]["metasd_imports"] is True and s["kernels"]["ok"]
    for section in ("conformance_greedy", "conformance_batch", "conformance_sampling"):
        assert s[section]["exit"] == 0 and s[section]["counts"].get("passed", 0) >= 1, s[section]
    figures = s["overhead"]["tiny"]["figures"]
    rows = figures["shapes"][0]["rows"]
    assert [(r.get("tokens_per_step"), r.get("graphs_setting"), r.get("drafter_graphs")) for r in rows] == \
        [(1, "off", None), (1, "fixed", None), (2, "off", None), (2, "fixed", None), (None, "fixed", "off"),
         (None, "fixed", "fixed"), (None, "fixed", "off"), (None, "fixed", "off"), (None, "fixed", "fixed")] \
        and not [r for r in rows if "failed" in r]
    assert rows[2]["tokens_per_step_measured"] > 1.5 and rows[6]["depth"] == 2
    # the static tree drafts too, eagerly and through its drafting loop's buffers (as a captured graph replays them)
    assert rows[7]["static"] == rows[8]["static"] == [2, 1] and rows[7]["tokens_per_step_measured"] > 1.5
    assert rows[8]["tokens_per_step_measured"] == rows[7]["tokens_per_step_measured"]
    # the chain drafter on the drafter shape drafts the verifier's text: about k + 1 tokens a step, the loop the same
    assert rows[4]["k"] == 2 and rows[4]["tokens_per_step_measured"] > 1.5
    assert rows[5]["tokens_per_step_measured"] == rows[4]["tokens_per_step_measured"]
    assert rows[4]["draft_loops"] is None and rows[5]["draft_loops"]["loops"][0]["eager"] > 0
    assert rows[8]["draft_loops"]["loops"][0]["eager"] > 0 and rows[6]["draft_loops"] is None
    assert all(r["static_s"]["median"] > 0 and r["speedup_over_static"] > 0 for r in rows[:6])  # the strongest baseline
    assert rows[0]["graphs"] is None and rows[1]["graphs"]["eager"] > 0 == rows[1]["graphs"]["captured"]
    assert figures["shapes"][0]["margins"]["ties"] == 0  # decisive greedy decoding
    assert set(figures["shapes"][0]["forward_ms_by_rows"]["ms"]) == {"1", "2"}
    host = s["host_time"]  # a scheduler step's host time on the machine's CPU, in the background
    assert host["exit"] == 0, host["tail"]
    assert [(r["drafter"], r["batch"]) for r in host["figures"]["rows"]] == [("none", 2), ("adaptive", 2)]
    rows = host["figures"]["rows"]
    assert all(r["host_ms_median"] > 0 for r in rows) and rows[1]["plan_ms_median"] > 0 == rows[0]["plan_ms_median"]
    fake = s["fake_syncs"]
    assert fake["tokens_per_step_2"]["tokens_match"] and fake["tokens_per_step_2"]["per_step"] < 1.5  # one read a step
    assert fake["tokens_per_step_2"].get("h2d_per_step", 0) == 0
    # a chain drafted on the device: one read a step (the request's start and end spread over its steps besides)
    for case in ("chain_2", "chain_2_loop", "tree_static:2,1", "tree_static:2,1_loop"):  # no read per level either
        assert fake[case]["tokens_match"] and fake[case]["per_step"] < 1.5, (case, fake[case])
    replay = s["trace_replay"]  # the committed trace of the default pool, replayed on tiny shapes
    assert replay["exit"] == 0, replay["tail"]
    summary = replay["figures"]["summary"]
    assert summary["repeats"] == 1 and set(summary) == {"repeats", "all", "spec_bench", "copy_heavy"}
    assert all(m["identical"] for m in summary["all"].values()) and "trace-replayed default" in summary["all"]
    # the GPU default's trace (its cascade's static tree replayed through the drafting loop's buffers: its cost as
    # captured), first
    gpu = s["trace_replay_gpu_default"]
    assert gpu["exit"] == 0, gpu["tail"]
    assert list(s).index("trace_replay_gpu_default") < list(s).index("trace_replay")
    gpu_summary = gpu["figures"]["summary"]
    assert all(m["identical"] for m in gpu_summary["all"].values()) and "trace-replayed gpu_default" in gpu_summary["all"]
    (arm,) = gpu["figures"]["methods"]["trace-replayed gpu_default"]["arms"]
    assert arm["draft_loops"]["loops"][0]["eager"] > 0 and arm["draft_loops"]["catch_up"]["eager"] > 0
    deep = s["trace_replay_gpu_default8"]  # its deeper candidate (the static tree to depth 8), replayed the same way
    assert deep["exit"] == 0, deep["tail"]
    assert list(s).index("trace_replay_gpu_default") < list(s).index("trace_replay_gpu_default8") \
        < list(s).index("trace_replay")
    assert all(m["identical"] for m in deep["figures"]["summary"]["all"].values())
    (arm,) = deep["figures"]["methods"]["trace-replayed gpu_default8"]["arms"]
    assert arm["draft_loops"]["loops"][0]["widths"] == [4, 2, 2, 1, 1, 1, 1, 1]
    batch = s["batch_forward"]  # the scheduler's batched verify forward, exact shapes against the runner's buffers
    assert batch["exit"] == 0 and [(r["rows"], r["tokens"]) for r in batch["figures"]["rows"]] == \
        [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert all(r["fixed_over_off"] > 0 for r in batch["figures"]["rows"])
    assert batch["figures"]["runners"]["3"]["fixed"]["eager"] > 0
    draft = s["draft_forward"]  # a drafting level of the batch: each request's own cache against one DraftRows
    assert draft["exit"] == 0 and draft["figures"]["level"] == "draft"
    assert [(r["rows"], r["tokens"]) for r in draft["figures"]["rows"]] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert draft["figures"]["runners"]["3"]["fixed"]["eager"] > 0
    assert len(s["summary"]["rows"]) == 9 + 4 + 4 + 3 * 2 * 3 and (out / "gpu_check.log").exists()


@pytest.fixture(scope="module")
def tiny():
    model = gpu_overhead.build("tiny", torch.device("cpu"), torch.float32)
    prompt = torch.randint(1, 1024, (1, 8), generator=torch.Generator().manual_seed(1))
    reference, _ = gpu_overhead.record(model, prompt, 16)
    return model, prompt, reference


def _row(tiny, reference, accept, target):
    from metasd import Engine, Verifier
    from metasd.drafters.replay import ReplayDrafter

    model, prompt, _ = tiny
    ids = prompt[0].tolist()
    drafter = ReplayDrafter(model, accept=accept, wrong=1, rerecord=False)
    drafter.record(ids, reference)
    timer = gpu_overhead.ForwardTimer(model, torch.device("cpu"))
    with torch.inference_mode():
        return gpu_overhead.measure_row(Engine(Verifier(model), drafter), model, prompt, ids, reference, 8, 3,
                                        torch.device("cpu"), timer, target_tau=target)


def test_a_row_fails_loudly_when_a_step_leaves_the_recording_instead_of_recording_again(tiny):
    _, _, reference = tiny
    wrong = reference[:3] + [(reference[3] + 1) % 1024] + reference[4:]
    row = _row(tiny, wrong, accept=1, target=2)
    assert "left the recording" in row["failed"] and "ms_per_step" not in row


def test_a_row_fails_loudly_when_a_step_commits_another_number_of_tokens(tiny):
    _, _, reference = tiny
    assert "ms_per_step" in _row(tiny, reference, accept=1, target=2)
    row = _row(tiny, reference, accept=1, target=3)
    assert "committed 2 tokens, not 3" in row["failed"]


def test_a_replayed_graph_row_prints_without_forward_figures():
    """A row whose verify forwards were replayed graphs has no hooked forward time (``engine_share`` None): the row's
    line and the check's summary say so instead of breaking on it."""
    import gpu_check

    row = {"ms_per_step": 2.0, "ms_per_step_range": [1.9, 2.1], "verifier_forward_ms_per_step": None,
           "engine_share": None, "host_reads_per_step": 1.0, "blocking_uploads_per_step": 0.0,
           "clock_syncs_per_step": 0.0, "cuda_sync_warnings_per_step": 1.0, "speedup_over_transformers": 3.0,
           "speedup_range": [2.9, 3.1], "speedup_over_static": 1.2, "speedup_over_static_range": [1.1, 1.3],
           "graphs": {"captured": 4, "capture_s": 2.5}, "tokens_per_step": 4, "graphs_setting": "on"}
    assert "replayed graphs: no hooks" in gpu_overhead._fmt(row) and "4 captured in 2.5 s" in gpu_overhead._fmt(row)
    summary = gpu_check._summary({"ok": True, "sections": {"overhead": {"1.5b": {"figures": {"shapes": [
        {"shape": "1.5b", "rows": [row]}]}}}}})
    assert summary["rows"] == ["1.5b tau 4 graphs on: 2.00 ms/step, engine - (graphs), 3.00x transformers, 1.20x "
                               "static-cache generate, syncs/step cuda 1.00"]
