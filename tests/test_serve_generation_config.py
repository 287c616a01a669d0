"""``--generation-config``: with ``auto`` (the default, as vLLM's) a request that leaves temperature, top_p, top_k,
min_p, repetition_penalty or max_tokens unset gets the model's ``generation_config`` value; a value the request sets wins;
with ``none`` the server keeps OpenAI's defaults. Driven by the official openai client against tiny fp32 models."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.serve.app import create_app  # noqa: E402
from metasd.serve.protocol import generation_defaults  # noqa: E402
from serve_helpers import ServerThread, openai_client, tiny_engine  # noqa: E402

MODEL = "tiny"
MSG = [{"role": "user", "content": "w10 w11 w12 w10 w11 w12 w10"}]


def _engine():
    engine = tiny_engine()
    config = engine.verifier.model.generation_config
    config.do_sample, config.top_k, config.repetition_penalty, config.max_new_tokens = True, 1, 1.6, 7
    config.min_p = 0.05
    return engine


def _chat(setting: str, **kw):
    engine = _engine()
    scheduler = Scheduler(engine, max_batch=2)
    try:
        with ServerThread(create_app(scheduler, MODEL, generation_config=setting)) as srv:
            client = openai_client(srv)
            return engine, [client.chat.completions.create(model=MODEL, messages=MSG, **k) for k in kw["asks"]]
    finally:
        scheduler.close()


def test_generation_defaults_read_only_what_the_model_sets():
    assert generation_defaults(_engine().verifier.model) == {"top_k": 1, "min_p": 0.05, "repetition_penalty": 1.6,
                                                           "max_tokens": 7}
    assert generation_defaults(tiny_engine().verifier.model) == {}


def test_auto_fills_unset_fields_from_the_models_generation_config():
    engine, (unset, overridden) = _chat("auto", asks=[{}, {"max_tokens": 5, "extra_body": {"repetition_penalty": 1.0}}])
    penalised = engine.generate(MSG, 7, temperature=1.0, top_k=1, min_p=0.05, repetition_penalty=1.6)
    plain = engine.generate(MSG, 5)
    assert penalised.text != engine.generate(MSG, 7).text, "the model's repetition_penalty changed nothing here"
    assert unset.usage.completion_tokens == 7 and unset.choices[0].message.content == penalised.text
    assert overridden.usage.completion_tokens == 5 and overridden.choices[0].message.content == plain.text


def test_none_keeps_openais_defaults():
    engine, (answer,) = _chat("none", asks=[{"extra_body": {"top_k": 1}}])
    assert answer.usage.completion_tokens > 7  # max_tokens: what the context leaves, not the model's 7
    assert answer.choices[0].message.content.startswith(engine.generate(MSG, 7).text)  # no repetition penalty


def test_a_bad_setting_is_refused():
    scheduler = Scheduler(tiny_engine())
    try:
        with pytest.raises(ValueError, match="generation_config must be"):
            create_app(scheduler, MODEL, generation_config="sometimes")
    finally:
        scheduler.close()
