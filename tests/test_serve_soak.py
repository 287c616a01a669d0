"""The fault and soak run (benchmarks/serve_soak.py) at a small size: concurrent clients with normal, malformed,
oversized and absurd requests and abandoned streams, while KV allocations and batched forwards fail at random. Every
answered request has exactly its text alone, every failure an OpenAI-style error, none is lost, the server answers
afterwards and its KV rows are freed (the stored prefixes of the prefix cache, on as `metasd serve` has it, stay within the
budget)."""
import pytest

pytest.importorskip("fastapi")

from benchmark_scripts import load_script  # noqa: E402


def test_a_small_soak_with_faults_loses_nothing_and_returns_no_wrong_text():
    soak = load_script("serve_soak")
    report = soak.run_soak(requests=60, clients=4, seconds=120, alloc_p=0.05, forward_p=0.05, seed=1)
    assert report["requests_sent"] == 60, report
    assert report["wrong_outputs"] == 0, report["examples"]["wrong"]
    assert report["lost_without_error"] == 0, report["examples"]["lost"]
    assert report["errors_without_a_clear_body"] == 0, report["examples"]["unclear"]
    assert report["server_alive_at_end"] and report["kv_held_bytes_when_idle"] == 0
    assert report["kv_peak_held_bytes"] <= report["kv_budget_bytes"]
    assert report["kv_prefix_cache_bytes_when_idle"] <= report["kv_budget_bytes"]  # prefix caching on, as served
    assert report["prefix_cache_hit_tokens"] > 0  # later requests reused a shared start: checked texts include them
    assert report["faults_injected"].get("allocation", 0) > 0 and report["faults_injected"].get("forward", 0) > 0
    assert report["checked_texts"] >= 10  # enough answers were compared for the zero to mean something
    assert {"malformed", "oversized", "absurd", "disconnect"} <= set(report["bad_inputs_tried"])
