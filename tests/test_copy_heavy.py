"""The copy-heavy prompt set (metasd.data.copy_heavy): reproducible, the right counts, code that parses with the
renamed variable in it, passages that hold what the questions quote, prompts within the length bound, JSONL that
load_questions reads back."""
import ast
import json
import platform
import random
import re
import subprocess
import sys
import sysconfig
from dataclasses import asdict
from pathlib import Path

import pytest

import metasd.data.copy_heavy as ch
from metasd.data import CATEGORY_GROUPS, GROUP_ORDER, load_questions

SEEDS = (0, 1, 2)
PER_CATEGORY = 6


@pytest.fixture(scope="module")
def sets():
    return {seed: ch.build_copy_heavy(PER_CATEGORY, seed) for seed in SEEDS}


def _all(sets, category):
    return [q for qs in sets.values() for q in qs if q.category == category]


def _code(prompt: str) -> str:
    m = re.fullmatch(r"(?s)(?P<instruction>[^\n]+)\n\n```python\n(?P<code>.*)\n```", prompt)
    assert m, prompt[:200]
    return m["code"]


def _passage_and_question(prompt: str) -> tuple[str, str]:
    m = re.fullmatch(r"(?s)[^\n]+\n\n<passage>\n(?P<passage>.*)\n</passage>\n\n(?P<question>[^\n]+)", prompt)
    assert m, prompt[:200]
    return m["passage"], m["question"]


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others(sets):
    again = ch.build_copy_heavy(PER_CATEGORY, 0)
    assert [asdict(q) for q in again] == [asdict(q) for q in sets[0]]
    for seed in SEEDS[1:]:
        assert {q.question_id for q in sets[seed]} != {q.question_id for q in sets[0]}
    fewer = ch.build_copy_heavy(2, 0)  # a smaller set is the start of each category's larger one
    for cat in ch.CATEGORIES:
        assert [asdict(q) for q in fewer if q.category == cat] == \
               [asdict(q) for q in sets[0] if q.category == cat][:2]


def test_counts_per_category_and_unique_ids(sets):
    for qs in sets.values():
        assert [q.category for q in qs] == [ch.CODE_EDIT] * PER_CATEGORY + [ch.QUOTE_QA] * PER_CATEGORY
        assert len({q.question_id for q in qs}) == len(qs)
        assert len({q.meta["object"] for q in qs if q.category == ch.CODE_EDIT}) == PER_CATEGORY
    assert [q.category for q in ch.build_copy_heavy(1, 5)] == [ch.CODE_EDIT, ch.QUOTE_QA]
    with pytest.raises(ValueError, match="only .* prompts can be made"):
        ch.build_copy_heavy(10_000)
    with pytest.raises(ValueError, match="at least 1"):
        ch.build_copy_heavy(0)


def test_each_category_is_its_own_group_after_the_spec_bench_groups(sets):
    for cat in ch.CATEGORIES:
        assert CATEGORY_GROUPS[cat] == cat
    assert GROUP_ORDER[-2:] == list(ch.CATEGORIES)
    assert {q.group for q in sets[0]} == set(ch.CATEGORIES)


def test_ids_and_meta_say_which_python_the_text_came_from(sets):
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}"
    for q in sets[0]:
        assert q.question_id == f"{q.category}-{q.meta['object']}-{q.meta['template']}-{tag}"
        assert q.meta["python"] == platform.python_version() and q.meta["seed"] == 0


def test_code_edit_prompts_hold_a_stdlib_function_that_parses_and_the_variable_to_rename(sets):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    templates = set()
    for q in _all(sets, ch.CODE_EDIT):
        prompt = q.turns[0]
        code = _code(prompt)
        tree = ast.parse(code)
        assert len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        fn = tree.body[0]
        assert ch.MIN_LINES <= len(code.splitlines()) <= ch.MAX_LINES
        assert fn.name == q.meta["object"].rsplit(".", 1)[1]
        first, last = q.meta["lines"]  # the function is the source's lines first..last, dedented
        source_lines = (stdlib / q.meta["source"]).read_text(encoding="utf-8").splitlines()[first - 1:last]
        assert [s.strip() for s in source_lines] == [c.strip() for c in code.splitlines()]
        template = q.meta["template"]
        templates.add(template)
        if template == "rename":
            m = re.match(r"Rename the variable `(\w+)` to `(\w+)` everywhere", prompt)
            assert m and (m[1], m[2]) == (q.meta["old"], q.meta["new"])
            names = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name)] + \
                    [a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)]
            assert names.count(m[1]) >= 2, f"{q.question_id}: `{m[1]}` is not a variable used in the function"
            assert m[2] not in re.findall(r"\w+", code)
        elif template == "typehints":
            assert prompt.startswith("Rewrite this function") and "type hints" in prompt
            assert fn.returns is None and all(a.annotation is None for a in ast.walk(fn.args) if isinstance(a, ast.arg))
        else:
            assert template == "docstring" and prompt.startswith("Add a docstring") and ast.get_docstring(fn) is None
    assert templates == set(ch.CODE_TEMPLATES)


def test_quote_qa_passages_contain_what_the_questions_refer_to(sets):
    templates = set()
    for q in _all(sets, ch.QUOTE_QA):
        passage, question = _passage_and_question(q.turns[0])
        assert ch.MIN_WORDS <= len(passage.split()) <= ch.MAX_WORDS
        quoted = re.findall(r'"([^"]+)"', question)
        assert quoted and quoted == q.meta["refers_to"]
        paragraphs = passage.split("\n\n")
        template = q.meta["template"]
        templates.add(template)
        if template in ("paragraph", "span"):  # named by their openings, each found once, at a paragraph's start
            assert all(passage.count(words) == 1 for words in quoted)
            starts = [next(i for i, p in enumerate(paragraphs) if p.startswith(words)) for words in quoted]
            end = starts[-1]
            assert len(starts) == (1 if template == "paragraph" else 2) and starts[0] <= end
            assert "\n\n".join(paragraphs[starts[0]:end + 1]) == q.meta["answer"]
        else:
            assert template == "sentences"
            word = quoted[0]
            assert re.search(rf"\b{word}\b", passage)
            hits = [s for p in paragraphs for s in ch._sentences(p) if re.search(rf"\b{word}\b", s)]
            assert 2 <= len(hits) <= 3 and " ".join(hits) == q.meta["answer"]
    assert templates == set(ch.QUOTE_TEMPLATES)


def _qwen_tokenizer():
    """The Qwen2.5 tokenizer of a bundled model already in the cache (none is prepared here), or None."""
    tokenizers = pytest.importorskip("tokenizers")
    from metasd.models.bundled import cache_dir
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        path = cache_dir() / name / "tokenizer.json"
        if path.is_file():
            return tokenizers.Tokenizer.from_file(str(path))
    return None


def test_prompts_are_under_the_length_bound(sets):
    prompts = [q.turns[0] for qs in sets.values() for q in qs]
    assert ch.TOKEN_BUDGET * 1.15 < ch.MAX_PROMPT_TOKENS <= 700  # the estimate was measured up to ~15% low
    assert all(ch.estimate_tokens(p) <= ch.TOKEN_BUDGET for p in prompts)
    assert ch.estimate_tokens("hello, world") == 3 and ch.estimate_tokens("    return x\n") == 4
    tok = _qwen_tokenizer()
    if tok is None:
        pytest.skip("no bundled Qwen2.5 tokenizer in the cache: only the estimate was checked")
    real = [len(tok.encode(p).ids) for p in prompts]
    assert max(real) < ch.MAX_PROMPT_TOKENS
    ratios = [r / ch.estimate_tokens(p) for r, p in zip(real, prompts)]
    assert max(ratios) * ch.TOKEN_BUDGET < ch.MAX_PROMPT_TOKENS, "the estimate is too low for the bound"


def test_a_module_missing_from_this_python_is_skipped(sets, monkeypatch):
    monkeypatch.setattr(ch, "CODE_MODULES", ("no_such_module_here",) + ch.CODE_MODULES)
    monkeypatch.setattr(ch, "QUOTE_MODULES", ch.QUOTE_MODULES + ("no_such.package",))
    assert [asdict(q) for q in ch.build_copy_heavy(PER_CATEGORY, 0)] == [asdict(q) for q in sets[0]]


def test_too_long_candidates_are_skipped(monkeypatch):
    code = {m: ch._functions(m) for m in ch.CODE_MODULES}
    passage = next(w for ws in ch._passages("os") for w in ws)  # from os.walk's docstring
    assert any(ch.estimate_tokens(f.code) > 300 for fs in code.values() for f in fs)  # some a budget of 300 skips
    monkeypatch.setattr(ch, "TOKEN_BUDGET", 300)
    qs = ch._pick(ch.CODE_EDIT, code, ch.CODE_TEMPLATES, 20, 0, ch._code_question)
    assert len(qs) == 20 and all(ch.estimate_tokens(q.turns[0]) <= 300 for q in qs)
    with pytest.raises(ValueError, match="quote_qa: only 0 prompts"):  # no passage of 250+ words fits in 300
        ch.build_copy_heavy(1, 0)
    size = ch.estimate_tokens(passage.text)
    for budget, fits in ((size + 20, False), (size + 200, True)):
        monkeypatch.setattr(ch, "TOKEN_BUDGET", budget)  # the passage fits; with the question, only the larger
        made = [ch._quote_question(passage, t, random.Random(0), 0) for t in ch.QUOTE_TEMPLATES]
        assert any(q is not None for q in made) == fits


def test_the_command_line_writes_jsonl_that_load_questions_reads_back(sets, tmp_path):
    out = tmp_path / "copy.jsonl"  # one subprocess (importing metasd takes seconds): python -m works
    done = subprocess.run([sys.executable, "-m", "metasd.data.copy_heavy", str(out), "--per-category",
                           str(PER_CATEGORY), "--seed", "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text(encoding="ascii").splitlines()]
    assert all(set(r) == {"question_id", "category", "turns", "meta"} for r in rows)
    assert [asdict(q) for q in load_questions(out)] == [asdict(q) for q in sets[1]]
    assert [q.question_id for q in load_questions(out, groups=["quote_qa"])] == \
           [q.question_id for q in sets[1] if q.category == ch.QUOTE_QA]
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": ["hi"], "meta": 3}\n')
    with pytest.raises(ValueError, match="'meta' must be an object"):
        load_questions(tmp_path / "bad.jsonl")


def test_the_command_line_refuses_more_prompts_than_the_library_gives(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ch.main([str(tmp_path / "x.jsonl"), "--per-category", "10000"])
    assert e.value.code == 2 and "only" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
