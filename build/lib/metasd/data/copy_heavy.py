"""A copy-heavy prompt set, generated from the running interpreter's standard library: prompts whose answers mostly
copy their input, where lookup drafters (n-gram, suffix) should win.

Two categories, each its own Spec-Bench-style group (``CATEGORY_GROUPS`` / ``GROUP_ORDER`` in ``metasd.data``):

- ``code_edit``: one function (15-40 lines) from the ``.py`` sources of a fixed list of stable standard-library
  modules (``CODE_MODULES``, read from ``sysconfig.get_paths()["stdlib"]`` and parsed with ``ast``; nothing is
  imported), with an edit that leaves almost all of it unchanged: add type hints, rename one variable (one that
  really is a parameter or assigned name of the function, used at least twice, never also an attribute or keyword
  name there) or add a docstring (only to functions without one), then output the whole function.
- ``quote_qa``: a passage of 250-500 words from a long module, class or function docstring of the modules in
  ``QUOTE_MODULES`` (consecutive paragraphs, most of the words in prose paragraphs, whose lines are joined; code
  examples and lists kept as they are), and a question answered by quoting it: copy the paragraph that begins with
  given words, copy the text from one named paragraph to the end of another, or quote every sentence that contains
  a given word. The quoted words are checked to occur in the passage (the paragraph openings exactly once).

Why lookup drafters should win: the expected answer is a near-verbatim copy of a long span of the prompt, so a
drafter that looks up the last few generated tokens in the prompt (n-gram, suffix) proposes long runs the verifier
accepts, where a small model drafter has to predict them token by token.

Selection: each category has its own random stream, seeded by the string ``metasd.copy_heavy/<category>/<seed>``.
It shuffles the modules that have candidates and each module's candidates, then takes them round-robin over the
modules (so the first prompts come from different modules); the k-th prompt of a category uses template
``k + offset`` (offset drawn once), or the next template that applies. A candidate that is missing (module absent
in this Python version, unreadable, unparsable) or too long is skipped and the next one taken, so the same Python
version, seed and ``per_category`` give the same prompts, and a smaller ``per_category`` gives a prefix of a larger
one. Each prompt keeps to ``TOKEN_BUDGET`` tokens by ``estimate_tokens`` (a count of the pieces the Qwen2.5
pre-tokenizer makes; measured at 0.8-1.15x the real Qwen2.5 count on stdlib code and docstrings), i.e. under
``MAX_PROMPT_TOKENS`` real tokens. The text differs between Python versions, so every ``question_id`` ends with the
interpreter's ``py<major>.<minor>`` and ``meta`` records the full version, the source file and lines.

Licensing: the project commits no code or text taken from elsewhere, and the standard library's sources and
docstrings are the PSF's, so the prompt set is not committed as a data file; this generator builds it on the
user's machine from the Python installed there::

    python -m metasd.data.copy_heavy copy_heavy.jsonl [--per-category 4] [--seed 0]

writes Spec-Bench-format JSONL (``question_id``, ``category``, ``turns``, ``meta``) that ``load_questions`` reads.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import platform
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from metasd.data import Question

CODE_EDIT, QUOTE_QA = "code_edit", "quote_qa"
CATEGORIES = (CODE_EDIT, QUOTE_QA)
#: modules whose functions make ``code_edit`` prompts (order matters only through the seeded shuffle)
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "calendar", "heapq", "bisect", "difflib", "json.encoder",
                "json.decoder", "string", "base64", "html", "posixpath", "glob", "copy", "statistics", "fractions",
                "csv", "configparser", "pprint", "gettext", "quopri", "urllib.parse", "ipaddress", "shutil",
                "tempfile", "locale")
#: modules whose long docstrings make ``quote_qa`` passages (some have none in a given Python version: skipped)
QUOTE_MODULES = ("argparse", "logging", "decimal", "unittest", "email.header", "email.headerregistry", "difflib",
                 "doctest", "fileinput", "gzip", "lzma", "http.cookies", "http.server", "imaplib", "json.encoder",
                 "os", "pdb", "pickle", "pickletools", "pstats", "pydoc", "shutil", "site", "smtplib",
                 "socketserver", "statistics", "typing", "unittest.mock", "urllib.parse", "urllib.request",
                 "asyncio.events")
CODE_TEMPLATES = ("typehints", "rename", "docstring")
QUOTE_TEMPLATES = ("paragraph", "sentences", "span")
MIN_LINES, MAX_LINES = 15, 40
MIN_WORDS, MAX_WORDS = 250, 500
MAX_PROMPT_TOKENS = 700  # the bound for every prompt, in Qwen2.5 tokens
TOKEN_BUDGET = 600  # the bound on estimate_tokens, which can be up to ~15% low
_OPENING_WORDS = 6  # a paragraph is named by its first words

_PIECE = re.compile(r"'(?:[sdmt]|ll|ve|re)|[^\r\n\w]?[^\W\d_]+|\d|_+| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                    re.IGNORECASE)


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` for a Qwen2.5 (byte-level BPE) tokenizer, estimated without it: the pieces its
    pre-tokenizer splits text into (a word with its leading space or punctuation, a digit, a punctuation run, a
    whitespace run), one more for a piece of 10+ characters."""
    return sum(1 + (len(m.group()) >= 10) for m in _PIECE.finditer(text))


def python_tag() -> str:
    return f"py{sys.version_info.major}.{sys.version_info.minor}"


@functools.cache
def _module_tree(module: str) -> tuple[str, str, ast.Module] | None:
    """(path relative to the stdlib, source, tree) of a standard-library module, or None when this Python lacks it
    or it does not read or parse. Cached per process (nothing changes the parsed trees)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
        if (stdlib / rel).is_file():
            try:
                source = (stdlib / rel).read_text(encoding="utf-8")
                return rel, source, ast.parse(source)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                return None
    return None


def _definitions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Top-level functions and classes and the methods of top-level classes, by qualified name; a name defined
    twice (a property's setter, say) is left out as ambiguous."""
    found: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, node))
            if isinstance(node, ast.ClassDef):
                found += [(f"{node.name}.{m.name}", m) for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    counts: dict[str, int] = {}
    for name, _ in found:
        counts[name] = counts.get(name, 0) + 1
    return [(name, node) for name, node in found if counts[name] == 1]


@dataclass(frozen=True)
class _Function:
    module: str
    path: str
    qualname: str
    first_line: int
    code: str  # dedented source, decorators included
    node: ast.FunctionDef | ast.AsyncFunctionDef  # parsed from ``code``


def _functions(module: str) -> list[_Function]:
    parsed = _module_tree(module)
    if parsed is None:
        return []
    rel, source, tree = parsed
    lines = source.splitlines()
    out = []
    for qualname, node in _definitions(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not MIN_LINES <= node.end_lineno - first + 1 <= MAX_LINES:
            continue
        code = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno]))
        try:
            fn = ast.parse(code).body[0]
        except SyntaxError:  # a multi-line string less indented than the function: dedent could not strip it
            continue
        if "```" not in code:
            out.append(_Function(module, rel, qualname, first, code, fn))
    return out


def _rename_candidates(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameters and assigned names of ``fn`` used at least twice as names and never as an attribute, keyword
    argument, global, nonlocal or a nested function's parameter there; in order of first appearance."""
    a = fn.args
    params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p is not None]
    uses: dict[str, int] = {p: 1 for p in params}
    assigned: list[str] = []
    banned = {"self", "cls"}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name):
            uses[n.id] = uses.get(n.id, 0) + 1
            if isinstance(n.ctx, ast.Store) and n.id not in assigned:
                assigned.append(n.id)
        elif isinstance(n, ast.Attribute):
            banned.add(n.attr)
        elif isinstance(n, ast.keyword) and n.arg:
            banned.add(n.arg)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            banned.update(n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and n is not fn:
            banned.update(p.arg for p in ast.walk(n.args) if isinstance(p, ast.arg))
    names = params + [n for n in assigned if n not in params]
    return [n for n in names if n not in banned and uses[n] >= 2]


def _code_question(fn: _Function, template: str, rng: random.Random, seed: int) -> Question | None:
    """The ``template`` edit of ``fn``, or None when it does not apply to ``fn`` or the prompt is too long."""
    node, where = fn.node, f"this function from Python's `{fn.module}` module"
    meta: dict = {}
    if template == "typehints":
        a = node.args
        params = [p for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p is not None]
        if node.returns is not None or any(p.annotation is not None for p in params) \
                or not [p for p in params if p.arg not in ("self", "cls")]:
            return None
        instruction = (f"Rewrite {where} with type hints added to its parameters and return value; change nothing "
                       "else. Output the whole function.")
    elif template == "rename":
        names = _rename_candidates(node)
        if not names:
            return None
        old = rng.choice(names)
        taken = set(re.findall(r"[A-Za-z_]\w*", fn.code))
        new = next(n for n in (f"new_{old}", f"{old}_renamed", f"renamed_{old}_var") if n not in taken)
        instruction = (f"Rename the variable `{old}` to `{new}` everywhere in {where} and output the whole function; "
                       "change nothing else.")
        meta.update(old=old, new=new)
    elif template == "docstring":
        if ast.get_docstring(node) is not None:
            return None
        instruction = f"Add a docstring to {where} and output the whole function; change nothing else."
    else:
        raise ValueError(f"unknown code_edit template {template!r}")
    prompt = f"{instruction}\n\n```python\n{fn.code}\n```"
    if estimate_tokens(prompt) > TOKEN_BUDGET:
        return None
    meta.update(python=platform.python_version(), seed=seed, template=template, object=f"{fn.module}.{fn.qualname}",
                source=fn.path, lines=[fn.first_line, fn.first_line + len(fn.code.splitlines()) - 1])
    return Question(f"{CODE_EDIT}-{fn.module}.{fn.qualname}-{template}-{python_tag()}", CODE_EDIT, [prompt], meta)


# ------------------------------------------------------------------------------------------------------------------
# quote_qa


def _is_prose(paragraph: str) -> bool:
    """A paragraph of sentences: unindented lines of words (no doctest, list, table or heading), a sentence end."""
    lines = paragraph.split("\n")
    words = paragraph.split()
    if any(line.startswith((" ", "\t", ">>>", "...", "$", "-", "*", "|", "+", "=", "#")) for line in lines):
        return False
    letters = sum(c.isalpha() for c in paragraph) / max(1, sum(not c.isspace() for c in paragraph))
    return (len(words) >= 12 and len(words) >= 5 * len(lines) and letters >= 0.75
            and re.search(r"[a-z][.?!]['\")]?(\s|$)", paragraph) is not None)


@dataclass(frozen=True)
class _Passage:
    module: str
    path: str
    qualname: str  # "" for the module's docstring
    line: int
    paragraphs: tuple[str, ...]  # prose paragraphs joined to one line each
    prose: tuple[bool, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


def _opening(paragraph: str) -> str:
    return " ".join(paragraph.split()[:_OPENING_WORDS])


def _passages(module: str) -> list[list[_Passage]]:
    """Per docstring of ``module``: its windows of consecutive paragraphs that make a passage (MIN_WORDS to MAX_WORDS
    words, at least 60% of them in prose paragraphs, two prose paragraphs or more, starting with no code and ending
    with no colon, within the token budget)."""
    parsed = _module_tree(module)
    if parsed is None:
        return []
    rel, _, tree = parsed
    out = []
    for qualname, node in [("", tree)] + _definitions(tree):
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        raw = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", doc) if p.strip()]
        prose = [_is_prose(p) for p in raw]
        paragraphs = [" ".join(p.split()) if ok else p for p, ok in zip(raw, prose)]
        words = [len(p.split()) for p in paragraphs]
        windows = []
        for i in range(len(paragraphs)):
            if paragraphs[i].startswith((" ", ">>>")):
                continue
            for j in range(i + 1, len(paragraphs) + 1):
                total = sum(words[i:j])
                if total > MAX_WORDS:
                    break
                in_prose = sum(w for w, ok in zip(words[i:j], prose[i:j]) if ok)
                if (total >= MIN_WORDS and in_prose >= 0.6 * total and sum(prose[i:j]) >= 2
                        and not paragraphs[j - 1].rstrip().endswith(":")):
                    p = _Passage(module, rel, qualname, getattr(node, "lineno", 1), tuple(paragraphs[i:j]),
                                 tuple(prose[i:j]))
                    if estimate_tokens(p.text) <= TOKEN_BUDGET - 90:  # room for the framing and the question
                        windows.append(p)
        if windows:
            out.append(windows)
    return out


def _sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`\"'(])", paragraph)


_COMMON = frozenset("about above after again against along also another because been before being below between "
                    "both cannot could does doing down during each either every from further have having here into "
                    "itself just more most much must never none only other otherwise same should since some such "
                    "than that their them then there these they this those through under until upon very were what "
                    "when where whether which while will with within without would your".split())


def _quote_question(p: _Passage, template: str, rng: random.Random, seed: int) -> Question | None:
    text = p.text
    prose = [par for par, ok in zip(p.paragraphs, p.prose) if ok]
    # paragraphs their opening names unambiguously (one that holds a double quote could not be quoted as is)
    named = [par for par in prose if text.count(_opening(par)) == 1 and '"' not in _opening(par)]
    meta: dict = {}
    if template == "paragraph":
        if not named:
            return None
        par = rng.choice(named)
        question = (f'Copy, word for word, the paragraph of the passage that begins with "{_opening(par)}". '
                    "Output only that paragraph.")
        meta.update(refers_to=[_opening(par)], answer=par)
    elif template == "span":
        idx = [i for i, par in enumerate(p.paragraphs) if par in named]
        pairs = [(i, j) for i in idx for j in idx if 1 <= j - i <= 3]
        if not pairs:
            return None
        i, j = rng.choice(pairs)
        a, b = _opening(p.paragraphs[i]), _opening(p.paragraphs[j])
        question = (f'Copy, word for word, the part of the passage from the paragraph that begins with "{a}" to the '
                    f'end of the paragraph that begins with "{b}". Output only that text.')
        meta.update(refers_to=[a, b], answer="\n\n".join(p.paragraphs[i:j + 1]))
    elif template == "sentences":
        sentences = [s for par in prose for s in _sentences(par)]
        found: dict[str, list[str]] = {}
        for s in sentences:
            for w in dict.fromkeys(re.findall(r"\b[A-Za-z][a-z]{4,}\b", s)):
                found.setdefault(w, []).append(s)
        # a word in two or three sentences, and nowhere else (not in a code example, not inside a longer word)
        terms = sorted(w for w, ss in found.items() if 2 <= len(ss) <= 3 and w.lower() not in _COMMON
                       and sum(len(re.findall(rf"\b{w}\b", s)) for s in ss) == len(re.findall(rf"\b{w}\b", text)))
        if not terms:
            return None
        term = rng.choice(terms)
        question = (f'Quote, word for word, every sentence of the passage that contains the word "{term}". Output '
                    "only those sentences, in the order they appear.")
        meta.update(refers_to=[term], answer=" ".join(found[term]))
    else:
        raise ValueError(f"unknown quote_qa template {template!r}")
    source = f"`{p.module}.{p.qualname}`" if p.qualname else f"the `{p.module}` module"
    prompt = (f"The passage below is from the documentation of {source} in Python's standard library.\n\n"
              f"<passage>\n{text}\n</passage>\n\n{question}")
    if estimate_tokens(prompt) > TOKEN_BUDGET:
        return None
    obj = f"{p.module}.{p.qualname}" if p.qualname else p.module
    meta.update(python=platform.python_version(), seed=seed, template=template, object=obj, source=p.path,
                line=p.line, words=len(text.split()))
    return Question(f"{QUOTE_QA}-{obj}-{template}-{python_tag()}", QUOTE_QA, [prompt], meta)


# ------------------------------------------------------------------------------------------------------------------

_C = TypeVar("_C")


def _pick(category: str, by_module: dict[str, list[_C]], templates: tuple[str, ...], n: int, seed: int,
          make: Callable[[_C, str, random.Random, int], Question | None]) -> list[Question]:
    """``n`` questions: modules and candidates shuffled by the category's seeded stream, taken round-robin over the
    modules; the k-th question tries template k + offset first, then the next ones."""
    rng = random.Random(f"metasd.copy_heavy/{category}/{seed}")
    modules = [m for m, cands in by_module.items() if cands]
    rng.shuffle(modules)
    queues = {m: list(by_module[m]) for m in modules}
    for m in modules:
        rng.shuffle(queues[m])
    offset = rng.randrange(len(templates))
    out: list[Question] = []
    for depth in range(max((len(q) for q in queues.values()), default=0)):
        for m in modules:
            if len(out) == n:
                return out
            if depth >= len(queues[m]):
                continue
            cand_rng = random.Random(f"metasd.copy_heavy/{category}/{seed}/{m}/{depth}")
            for t in range(len(templates)):
                q = make(queues[m][depth], templates[(len(out) + offset + t) % len(templates)], cand_rng, seed)
                if q is not None:
                    out.append(q)
                    break
    if len(out) < n:
        raise ValueError(f"{category}: only {len(out)} prompts can be made from this Python's standard library "
                         f"(Python {platform.python_version()}), {n} asked for")
    return out


def _pick_window(windows: list[_Passage], template: str, rng: random.Random, seed: int) -> Question | None:
    return _quote_question(rng.choice(windows), template, rng, seed)


def build_copy_heavy(per_category: int = 4, seed: int = 0) -> list[Question]:
    """``per_category`` ``code_edit`` then ``per_category`` ``quote_qa`` questions (see the module docstring); the
    same Python version, seed and per_category give the same questions. Raises ValueError when this Python's
    standard library cannot give ``per_category`` of a category."""
    if per_category < 1:
        raise ValueError(f"per_category must be at least 1, not {per_category}")
    code = {m: _functions(m) for m in CODE_MODULES}
    quote = {m: _passages(m) for m in QUOTE_MODULES}
    return (_pick(CODE_EDIT, code, CODE_TEMPLATES, per_category, seed, _code_question)
            + _pick(QUOTE_QA, quote, QUOTE_TEMPLATES, per_category, seed, _pick_window))


def write_jsonl(questions: list[Question], path: str | Path) -> None:
    """Spec-Bench-format JSONL (ASCII, so any locale's default encoding reads it back)."""
    with open(path, "w", encoding="ascii") as f:
        for q in questions:
            f.write(json.dumps({"question_id": q.question_id, "category": q.category, "turns": q.turns,
                                "meta": q.meta}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metasd.data.copy_heavy",
                                description="Write the copy-heavy prompt set, built from this Python's standard "
                                            "library, as Spec-Bench-format JSONL.")
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--per-category", type=int, default=4, help="prompts per category (default 4)")
    p.add_argument("--seed", type=int, default=0, help="selection seed (default 0)")
    args = p.parse_args(argv)
    try:
        questions = build_copy_heavy(args.per_category, args.seed)
    except ValueError as e:
        p.error(str(e))
    write_jsonl(questions, args.out)
    print(f"wrote {len(questions)} prompts ({', '.join(CATEGORIES)}; Python {platform.python_version()}, seed "
          f"{args.seed}) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
