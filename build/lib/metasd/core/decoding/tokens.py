"""What the engine needs to know about tokens: which ids end a generation, and whether a drafter's token ids mean
the same to the verifier."""
from __future__ import annotations


class TokenizerMismatchError(ValueError):
    """The verifier's and a drafter's tokenizers do not map tokens to the same ids."""


def _eos_ids(*sources) -> set[int]:
    """The ids named by ``eos_token_id`` values (an int, a list of ints, or None)."""
    ids: set[int] = set()
    for source in sources:
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    return ids


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token that ends a generation: the model's generation config plus the tokenizer's EOS."""
    return _eos_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                    getattr(tokenizer, "eos_token_id", None))


def config_eos_ids(model) -> set[int]:
    """The EOS ids a model's generation config and model config name (no tokenizer needed)."""
    return _eos_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                    getattr(getattr(model, "config", None), "eos_token_id", None))


# --------------------------------------------------------------------------------------------------
# Tokenizer compatibility


def _fmt_tok(token: str, idx: int | None) -> str:
    return f"{token!r} (id {idx})"


def check_tokenizers_compatible(
    verifier_tok,
    drafter_tok,
    verifier_name: str,
    drafter_name: str,
    *,
    verifier_vocab_rows: int | None = None,
    drafter_vocab_rows: int | None = None,
    advice: str = "",
) -> None:
    """Raise ``TokenizerMismatchError`` unless the drafter's token ids mean the same to the verifier.

    Every token of the smaller vocabulary must have the same id in the larger one. Vocabularies of
    different size pass only when both models' embedding row counts (``*_vocab_rows``) are given,
    equal, and cover the larger vocabulary. The eos tokens must agree. The message names both models, both
    tokenizers (their ``name_or_path``) and the first concrete difference, then ``advice``.
    """
    def fail(detail: str) -> None:
        names = [getattr(t, "name_or_path", "") for t in (verifier_tok, drafter_tok)]
        which = f" ({names[0]!r} and {names[1]!r})" if all(names) and names[0] != names[1] else ""
        raise TokenizerMismatchError(
            f"tokenizers of verifier {verifier_name!r} and drafter {drafter_name!r}{which} are incompatible: {detail}. "
            f"A drafter must share the verifier's tokenizer (same token -> id map){advice}."
        )

    vv: dict[str, int] = verifier_tok.get_vocab()
    dv: dict[str, int] = drafter_tok.get_vocab()
    for name, vocab, rows in ((verifier_name, vv, verifier_vocab_rows), (drafter_name, dv, drafter_vocab_rows)):
        if rows is not None and vocab and max(vocab.values()) >= rows:
            top = max(vocab.items(), key=lambda kv: kv[1])
            fail(f"{name!r} tokenizer has token {_fmt_tok(*top)} but the model has only {rows} embedding rows")
    if vv != dv:
        if len(vv) <= len(dv):
            small, large, sname, lname = vv, dv, f"verifier {verifier_name!r}", f"drafter {drafter_name!r}"
        else:
            small, large, sname, lname = dv, vv, f"drafter {drafter_name!r}", f"verifier {verifier_name!r}"
        for token, idx in sorted(small.items(), key=lambda kv: (kv[1], kv[0])):
            other = large.get(token)
            if other != idx:
                where = "is missing" if other is None else f"has id {other}"
                fail(
                    f"token {token!r} has id {idx} in {sname} but {where} in {lname} "
                    f"(vocab sizes: verifier {len(vv)}, drafter {len(dv)})"
                )
        # The smaller vocabulary is an id-consistent subset of the larger one.
        extra_id, extra_tok = min((i, t) for t, i in large.items() if t not in small)
        ok = (
            verifier_vocab_rows is not None
            and verifier_vocab_rows == drafter_vocab_rows
            and max(large.values()) < verifier_vocab_rows
        )
        if not ok:
            fail(
                f"vocab sizes differ: verifier {len(vv)}, drafter {len(dv)}; first token only in {lname}: "
                f"{_fmt_tok(extra_tok, extra_id)}"
                + (
                    f"; embedding rows: verifier {verifier_vocab_rows}, drafter {drafter_vocab_rows}"
                    if verifier_vocab_rows is not None or drafter_vocab_rows is not None
                    else ""
                )
            )
    v_eos, d_eos = verifier_tok.eos_token_id, drafter_tok.eos_token_id
    if v_eos != d_eos:
        fail(
            f"eos tokens differ: verifier {_fmt_tok(verifier_tok.eos_token, v_eos)}, "
            f"drafter {_fmt_tok(drafter_tok.eos_token, d_eos)}"
        )
