"""benchmarks/generate_versions.py on a tiny pool: two sides running the same code agree on every token and step;
a side that decodes plainly is told apart by its steps, not by its tokens."""
import json
import os
import sys
from pathlib import Path

import pytest

from benchmark_scripts import load_script
from serve_helpers import write_tiny_pool

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    lines = [{"question_id": str(i), "category": c, "turns": [f"say {w} {w} {w} {w}"]}
             for i, (c, w) in enumerate([("writing", "cats"), ("math", "one two")])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_same_code_agrees_and_plain_decoding_differs_in_steps(tmp_path, questions, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = load_script("generate_versions")
    cli = f"{sys.executable} -m metasd.cli generate"
    out = tmp_path / "versions.json"
    assert script.main(["--side", f"a={cli}", "--side", f"b={cli}", "--side", f"plain={cli} --drafter none",
                        "--pool", str(write_tiny_pool(tmp_path)), "--questions", str(questions),
                        "--per-group", "2", "--max-new-tokens", "12", "--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 4 and all(set(r["methods"]) == {"a", "b", "plain"} for r in rows)
    assert all("error" not in e for r in rows for e in r["methods"].values())
    b_line, plain_line = result["summary"]
    assert b_line.startswith("b vs a: same tokens 2/2, same steps 2/2, same drafted nodes 2/2;")
    # plain decoding commits the same greedy tokens, one per step, drafting nothing
    assert plain_line.startswith("plain vs a: same tokens 2/2, same steps 0/2")
    assert all(r["methods"]["plain"]["tokens_per_step"] == [1] * (r["methods"]["plain"]["tokens"] - 1)
               for r in rows)  # and the token drawn with the prefill
    # the order of the sides rotates by prompt and repeat
    assert [list(r["methods"]) for r in rows[:2]] == [["a", "b", "plain"], ["b", "plain", "a"]]


def test_a_side_needs_a_name_and_a_command():
    script = load_script("generate_versions")
    with pytest.raises(SystemExit):
        script.main(["--side", "onlyname", "--side", "x=y", "--out", "o.json"])
    with pytest.raises(SystemExit):
        script.main(["--side", "a=metasd generate", "--out", "o.json"])
