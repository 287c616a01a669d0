"""benchmarks/serve_regret.py on synthetic serve_load rows: the best fixed configuration in hindsight per level, the
candidate's paired ratios and regret, the best single configuration by geometric mean, errors that name the missing
server, and the MLflow log (a real SQLite store in tmp_path: parent run, nested runs, the regret plot)."""
from __future__ import annotations

import json
import math

import pytest

from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def sr():
    return load_script("serve_regret")


#: output tok/s per (server, concurrency): one value per repeat (3 repeats)
TOK_S = {
    ("off", 1): [2.0, 2.1, 2.2], ("off", 8): [5.0, 5.2, 5.1],
    ("tree", 1): [3.0, 3.1, 2.9], ("tree", 8): [3.0, 3.2, 3.1],
    ("adaptive", 1): [2.9, 3.0, 2.8], ("adaptive", 8): [5.5, 5.6, 5.4],
    ("transformers", 1): [2.0, 2.0, 2.0], ("transformers", 8): [4.0, 4.1, 4.2],
}


def rows(tok_s=TOK_S):
    return [{"server": s, "concurrency": c, "repeat": r, "output_tok_s": v}
            for (s, c), vs in tok_s.items() for r, v in enumerate(vs)]


def test_best_fixed_per_level_and_paired_ratio(sr):
    rep = sr.hindsight(rows(), "adaptive", ["off", "tree"], "transformers")
    lv1, lv8 = rep.levels
    assert (lv1.concurrency, lv1.best, lv8.best) == (1, "tree", "off")
    # per-repeat ratios at c=1: 2.9/3.0, 3.0/3.1, 2.8/2.9 -> median 2.9/3.0
    assert lv1.ratio[0] == pytest.approx(2.9 / 3.0) and lv1.ratio[1] == pytest.approx(2.8 / 2.9)
    assert lv1.regret == pytest.approx(1 - 2.9 / 3.0) and lv1.verdict == "within noise"
    # c=8 per repeat: 5.5/5.0, 5.6/5.2, 5.4/5.1 -> median 5.6/5.2 (paired, not a ratio of medians)
    assert lv8.ratio[0] == pytest.approx(5.6 / 5.2) and lv8.regret < 0 and lv8.verdict == "faster"
    assert lv8.reference_ratio[0] == pytest.approx(5.6 / 4.1) and lv8.reference_verdict == "faster"


def test_best_single_by_geometric_mean(sr):
    rep = sr.hindsight(rows(), "adaptive", ["off", "tree"])
    # off: 2.1/3.0 at c=1, 1 at c=8; tree: 1 at c=1, 3.1/5.1 at c=8
    assert rep.single_geomeans["off"] == pytest.approx(math.sqrt(2.1 / 3.0))
    assert rep.single_geomeans["tree"] == pytest.approx(math.sqrt(3.1 / 5.1))
    assert rep.best_single == "off"
    assert rep.candidate_geomean_vs_single == pytest.approx(math.sqrt(2.9 / 2.1 * 5.5 / 5.1))
    assert rep.candidate_geomean_vs_best == pytest.approx(math.sqrt(2.9 / 3.0 * 5.5 / 5.1))
    text = sr.tables(rep)
    assert "| off (best single) |" in text and "| 8 |" in text


def test_a_level_without_the_candidate_is_left_out_and_missing_servers_are_named(sr):
    tok_s = {k: v for k, v in TOK_S.items() if k != ("adaptive", 8)}
    assert [lv.concurrency for lv in sr.hindsight(rows(tok_s), "adaptive", ["off", "tree"]).levels] == [1]
    with pytest.raises(ValueError, match=r"\['chain2'\]"):
        sr.hindsight(rows(), "adaptive", ["off", "chain2"])
    with pytest.raises(ValueError, match="also among the fixed"):
        sr.hindsight(rows(), "off", ["off", "tree"])


def test_mlflow_log_has_the_regret_per_level_nested_runs_and_the_plot(sr, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    result = {"command": "serve_load.py ...", "date": "2026-11-26", "args": {"repeats": 3}, "rows": rows()}
    path = tmp_path / "serve_load_x.json"
    path.write_text(json.dumps(result))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert sr.main([str(path), "--candidate", "adaptive", "--fixed", "off", "tree", "--reference", "transformers",
                    "--mlflow", uri, "--experiment", "load", "--workdir", str(tmp_path / "art")]) == 0
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("load")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if r.data.tags.get("metasd.kind") == "serve_load_regret"]
    assert len(parent) == 1 and len(runs) == 1 + 4
    pid = parent[0].info.run_id
    regret = {m.step: m.value for m in client.get_metric_history(pid, "regret_vs_best_fixed")}
    assert regret[1] == pytest.approx(1 - 2.9 / 3.0) and regret[8] == pytest.approx(1 - 5.6 / 5.2)
    assert parent[0].data.tags["best_single"] == "off"
    arts = {a.path for a in client.list_artifacts(pid)}
    assert {"regret_by_concurrency.png", "regret_tables.md", "serve_load_x.json"} <= arts
    child = [r for r in runs if r.data.tags.get("metasd.server") == "tree"][0]
    assert {m.step: m.value for m in client.get_metric_history(child.info.run_id, "tok_s_median")} == {1: 3.0, 8: 3.1}


def test_arm_shares_per_level_from_the_completions_records(sr):
    rs = rows()
    for r in rs:
        if r["server"] == "adaptive":
            pick = {"c@4": 3, "none": 1} if r["concurrency"] == 1 else {"none": 4}
            r["requests"] = [{"metasd": {"selection_counts": pick}}, {"metasd": None}]
    assert sr.arm_shares(rs, "adaptive") == {1: {"c@4": 0.75, "none": 0.25}, 8: {"none": 1.0}}
    assert sr.arm_shares(rs, "off") == {}
    assert "| 1 | 75% | 25% |" in sr.arm_table(rs, "adaptive") and sr.arm_table(rs, "off") == ""


def test_cli_names_a_missing_result_file(sr, tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        sr.main([str(tmp_path / "nope.json"), "--candidate", "a", "--fixed", "b"])
