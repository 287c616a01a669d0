"""Fill in the middle: ``encode_infill`` writes a code model's own format (its marker tokens found in the vocabulary,
the texts around the gap encoded apart) and the tokens that end the middle; ``/v1/completions`` with ``suffix`` serves
it through the official openai client - the answer ``Engine.generate`` gives for that prompt and those stop tokens,
the same with speculation on and off - and names the field at fault where it cannot. Tiny fp32 models over a
byte-level BPE with the markers added as special tokens."""
from __future__ import annotations

import openai
import pytest

from metasd.core.decoding.prompt import INFILL_FORMATS, encode_infill, infill_format
from metasd.core.engine import Engine
from metasd.core.execution.verifier import Verifier
from test_constraints import EOS, byte_bpe
from tiny import tiny_qwen

QWEN = INFILL_FORMATS[0]
PREFIX, SUFFIX = "def f(x):\n    return ", "\n\nprint(f(2))\n"


def _tokenizer(fmt=QWEN, with_ends=True):
    tok = byte_bpe(340)
    extra = [*fmt.markers(), *(fmt.ends if with_ends else ())]
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("fmt", INFILL_FORMATS)
def test_the_format_is_found_by_its_markers_and_written_prefix_suffix_middle(fmt):
    tok = _tokenizer(fmt)
    assert infill_format(tok) == fmt
    got = encode_infill(tok, PREFIX, SUFFIX)
    p, s, m = (tok.convert_tokens_to_ids(t) for t in fmt.markers())
    assert got.ids == [p, *_ids(tok, PREFIX), s, *_ids(tok, SUFFIX), m]
    ends = {tok.convert_tokens_to_ids(t) for t in (*fmt.ends, *fmt.markers())} | {tok.eos_token_id}
    assert set(got.stop_token_ids) == ends and EOS in got.stop_token_ids


def test_a_marker_spelled_in_the_code_stays_text_and_a_bos_comes_first():
    tok = _tokenizer()
    code = f"s = '{QWEN.middle}'\n"
    got = encode_infill(tok, code, "")
    assert got.ids.count(tok.convert_tokens_to_ids(QWEN.middle)) == 1 and got.ids[-1] == tok.convert_tokens_to_ids(
        QWEN.middle), "the marker inside the code was read as the marker"
    assert tok.decode(got.ids[1:-2]) == code

    class WithBos:  # a tokenizer that puts a BOS (9) first, as Llama's and DeepSeek's do
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, add_special_tokens=True, **kw):
            return ([9] if add_special_tokens else []) + tok.encode(text, add_special_tokens=False, **kw)

    assert encode_infill(WithBos(), PREFIX, SUFFIX).ids == [9, *encode_infill(tok, PREFIX, SUFFIX).ids]


def test_a_tokenizer_without_markers_is_a_value_error_naming_the_model():
    plain = byte_bpe(340)
    assert infill_format(plain) is None
    half = byte_bpe(340)
    half.add_special_tokens({"additional_special_tokens": [QWEN.prefix, QWEN.suffix]})  # no middle marker
    assert infill_format(half) is None
    with pytest.raises(ValueError, match="tiny-coder's tokenizer has no fill-in-the-middle tokens"):
        encode_infill(plain, PREFIX, SUFFIX, "tiny-coder")


# ---------------------------------------------------------------------------------------------------------------- served
pytest.importorskip("fastapi")
from serve_helpers import serving, tiny_chain_engine  # noqa: E402

MODEL = "tiny-coder"


def _engine(tok):
    return tiny_chain_engine(tok, MODEL)


@pytest.fixture(scope="module")
def served():
    tok = _tokenizer()
    with serving(_engine(tok), MODEL) as srv:
        srv.tok = tok
        yield srv


def _complete(served, speculate=True, **kw):
    kw.setdefault("prompt", PREFIX)
    return served.client.completions.create(model=MODEL, temperature=0, max_tokens=12,
                                            extra_body={"metasd": {"speculate": speculate},
                                                        **kw.pop("extra_body", {})}, **kw)


def test_a_suffix_is_the_engines_infill_with_speculation_on_and_off(served):
    on = _complete(served, suffix=SUFFIX)
    off = _complete(served, speculate=False, suffix=SUFFIX)
    engine = _engine(served.tok)
    prompt = engine.encode_infill(PREFIX, SUFFIX)
    want = engine.generate(prompt.ids, 12, stop_token_ids=prompt.stop_token_ids)
    assert on.choices[0].text == off.choices[0].text == want.text
    assert on.usage.prompt_tokens == len(prompt.ids)
    assert on.model_extra["metasd"]["accepted"] > 0, "nothing was accepted: the draft rows were not exercised"
    chunks = list(_complete(served, suffix=SUFFIX, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == on.choices[0].finish_reason


def test_the_formats_end_token_ends_the_middle(served):
    end = served.tok.convert_tokens_to_ids("<|endoftext|>")
    forced = {"logit_bias": {str(end): 100}, "min_tokens": 3,  # three tokens, then the end token
              "skip_special_tokens": False}
    got = _complete(served, suffix=SUFFIX, extra_body=forced)
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == 4
    assert "<|endoftext|>" not in got.choices[0].text
    plain = _complete(served, extra_body=forced)  # without a suffix the token is text like any other
    assert plain.choices[0].finish_reason == "length" and "<|endoftext|>" in plain.choices[0].text


@pytest.mark.parametrize("kw, field", [
    ({"prompt": [5, 6, 7], "suffix": SUFFIX}, "suffix"),  # token ids: no text to infill
    ({"suffix": SUFFIX, "echo": True}, "echo"),
])
def test_bad_infill_requests_are_a_400_naming_the_field(served, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(served, **kw)
    assert e.value.body["param"] == field, e.value.body


def test_a_model_without_markers_refuses_a_suffix_naming_it():
    with serving(_engine(byte_bpe(340)), MODEL) as srv:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
        assert e.value.body["param"] == "suffix" and "fill-in-the-middle" in e.value.body["message"]
        empty = srv.client.completions.create(model=MODEL, prompt=PREFIX, suffix="", max_tokens=4, temperature=0)
        plain = srv.client.completions.create(model=MODEL, prompt=PREFIX, max_tokens=4, temperature=0)
        assert (empty.choices[0].text, empty.usage.prompt_tokens) == (plain.choices[0].text, plain.usage.prompt_tokens)


# ------------------------------------------------------------------------------------------------------ metasd generate
def test_metasd_generate_fills_in_the_middle_with_suffix(tmp_path, capsys):
    import json

    import yaml

    from metasd.cli import main

    tok = _tokenizer()
    for name, tokenizer in (("coder", tok), ("plain", byte_bpe(340))):
        tiny_qwen(seed=3, vocab=len(tok), logit_scale=3.0, eos=EOS).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        pool = {"verifier": {"model": str(tmp_path / name), "dtype": "fp32", "device": "cpu"},
                "drafters": [{"name": "ngram", "type": "ngram", "params": {"k": 4, "n_max": 2}}]}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(pool))
    argv = ["generate", PREFIX, "--suffix", SUFFIX, "--max-new-tokens", "12", "--json", "--threads", "1"]
    assert main([*argv, "--pool", str(tmp_path / "coder.yaml")]) == 0
    got = json.loads(capsys.readouterr().out)
    from metasd.models import load_tokenizer
    saved = load_tokenizer(str(tmp_path / "coder"))  # as the command loads it (transformers may pick another class)
    reference = Engine(Verifier(tiny_qwen(seed=3, vocab=len(tok), logit_scale=3.0, eos=EOS), saved))
    prompt = reference.encode_infill(PREFIX, SUFFIX)
    want = reference.generate(prompt.ids, 12, stop_token_ids=prompt.stop_token_ids)
    assert got["token_ids"] == want.token_ids and got["stats"]["prompt_tokens"] == len(prompt.ids)
    assert main([*argv, "--pool", str(tmp_path / "plain.yaml")]) == 2  # refused before the model loads
    assert "has no fill-in-the-middle tokens" in capsys.readouterr().err
