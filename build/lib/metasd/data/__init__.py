"""Prompt sets: Spec-Bench JSONL (or any JSONL with ``turns`` or ``prompt``), their category groups, and the built-in
prompts (``prompts.jsonl`` beside this file); ``metasd.data.copy_heavy`` generates a copy-heavy set from the
installed Python's standard library. Imports nothing of metasd."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Spec-Bench reports one column per group; the eight MT-bench categories form the "MT" column. The copy-heavy
# set's two categories (metasd.data.copy_heavy) are a column each, after Spec-Bench's.
CATEGORY_GROUPS = {
    "writing": "MT", "roleplay": "MT", "reasoning": "MT", "math": "MT", "coding": "MT", "extraction": "MT",
    "stem": "MT", "humanities": "MT", "translation": "translation", "summarization": "summarization",
    "qa": "QA", "math_reasoning": "math", "rag": "RAG", "code_edit": "code_edit", "quote_qa": "quote_qa",
}
GROUP_ORDER = ["MT", "translation", "summarization", "QA", "math", "RAG", "code_edit", "quote_qa"]
SPEC_BENCH_DEFAULT = Path("../shared/data/spec_bench/question.jsonl")


@dataclass
class Question:
    """One benchmark request: one or more user turns (answered turn by turn)."""

    question_id: str
    category: str
    turns: list[str]
    meta: dict = field(default_factory=dict)

    @property
    def group(self) -> str:
        return CATEGORY_GROUPS.get(self.category, self.category)


def load_questions(path: str | Path, groups: list[str] | None = None, per_group: int | None = None,
                   categories: list[str] | None = None) -> list[Question]:
    """Read a JSONL of ``{"question_id", "category", "turns": [...]}`` or ``{"prompt": ...}`` lines (an optional
    ``meta`` object is kept in ``Question.meta``).

    groups / categories filter; per_group keeps the first n questions of each group, taken round-robin
    over the group's categories (so 2 MT questions are a writing and a roleplay one, not two writing).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    questions = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON: {e}") from None
            turns = row.get("turns") or ([row["prompt"]] if "prompt" in row else None)
            if not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{path}:{i + 1}: needs a non-empty 'turns' list or a 'prompt' string")
            meta = row.get("meta", {})
            if not isinstance(meta, dict):
                raise ValueError(f"{path}:{i + 1}: 'meta' must be an object")
            questions.append(Question(str(row.get("question_id", i)), row.get("category", "default"), list(turns),
                                      meta))
    if categories:
        questions = [q for q in questions if q.category in categories]
    if groups:
        unknown = sorted(set(groups) - {q.group for q in questions})
        if unknown:
            raise ValueError(f"{path}: no questions in group(s) {unknown}; groups present: "
                             f"{sorted({q.group for q in questions})}")
        questions = [q for q in questions if q.group in groups]
    if per_group is not None:
        questions = _round_robin(questions, per_group)
    return questions


def _round_robin(questions: list[Question], per_group: int) -> list[Question]:
    by_group: dict[str, dict[str, list[Question]]] = defaultdict(lambda: defaultdict(list))
    for q in questions:
        by_group[q.group][q.category].append(q)
    out = []
    for group, cats in by_group.items():
        picked, depth = [], 0
        while len(picked) < per_group and any(len(v) > depth for v in cats.values()):
            for qs in cats.values():
                if depth < len(qs) and len(picked) < per_group:
                    picked.append(qs[depth])
            depth += 1
        out.extend(picked)
    order = {g: i for i, g in enumerate(GROUP_ORDER)}
    return sorted(out, key=lambda q: order.get(q.group, len(order)))
