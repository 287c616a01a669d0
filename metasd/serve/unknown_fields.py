"""Request fields the server does not declare (docs/serving.md#requests): refused where they would change the output
(``refused_field``: vLLM's ``logits_processors``, llama-server's ``grammar``, ...), with what to send
instead where the server has it; every other unknown field (``store``, ``metadata``, ``user``, ...) changes nothing
and is accepted, its name logged (``ignored_fields``), as vLLM does. A refused field is accepted at its "off" value,
which clients built for vLLM or llama-server often send explicitly. Fields are matched by their path from the top of
the body (``stream_options.continuous_usage_stats``): an unknown key inside a message is only ignored.
"""
from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel


def _off(*values) -> Callable[[Any], bool]:
    """Whether a value is one of ``values`` (or null): the field's "off" value, which changes nothing."""
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in (None, *values))


#: field -> (is it off, why it is refused): OpenAI's and vLLM's fields metasd does not implement
REFUSED_OPENAI_VLLM = {
    "functions": (_off([]), "the legacy functions field is not supported: use tools"),
    "function_call": (_off("none", "auto"), "the legacy function_call field is not supported: use tool_choice"),
    "guided_whitespace_pattern": (_off(), "guided_whitespace_pattern is not supported"),
    "structured_outputs": (_off(), "structured_outputs is not supported: use response_format or guided_json, "
                                   "guided_regex, guided_grammar, guided_choice"),
    "modalities": (_off(["text"]), "only text output is served"),
    "audio": (_off(), "only text output is served"),
    "web_search_options": (_off(), "web search is not supported"),
    "max_completion_tokens": (_off(), "max_completion_tokens is a chat field: /v1/completions takes max_tokens"),
    "use_beam_search": (_off(False), "beam search is not supported"),
    "length_penalty": (_off(1, 1.0), "length_penalty is not supported (beam search only)"),
    "spaces_between_special_tokens": (_off(True), "spaces_between_special_tokens is not supported (only true)"),
    "logits_processors": (_off([]), "logits_processors are not supported"),
    "conversation": (_off(), "conversation objects are not served here: continue a stored response with "
                             "previous_response_id, or send the whole conversation as input"),
}

#: llama-server's own fields: refused, naming the OpenAI or vLLM field this server takes instead
REFUSED_LLAMA_SERVER = {
    "n_predict": (_off(-1), "n_predict is llama-server's: use max_tokens"),
    "grammar": (_off(""), "grammar (GBNF) is llama-server's: use guided_grammar, a Lark grammar"),
    "json_schema": (_off({}), "json_schema is llama-server's: use response_format (type json_schema) or guided_json"),
    "repeat_penalty": (_off(1, 1.0), "repeat_penalty is llama-server's: use repetition_penalty"),
    "repeat_last_n": (_off(-1), "repeat_last_n is not supported: the penalties cover the whole text (-1)"),
    "penalty_last_n": (_off(-1), "penalty_last_n is not supported: the penalties cover the whole text (-1)"),
    "typical_p": (_off(1, 1.0), "typical_p is not supported (only 1)"),
    "tfs_z": (_off(1, 1.0), "tfs_z is not supported (only 1)"),
    "top_n_sigma": (_off(-1, -1.0), "top_n_sigma is not supported"),
    "mirostat": (_off(0), "mirostat is not supported (only 0)"),
    "dynatemp_range": (_off(0, 0.0), "dynatemp_range is not supported (only 0)"),
    "dry_multiplier": (_off(0, 0.0), "DRY sampling is not supported (dry_multiplier only 0)"),
    "xtc_probability": (_off(0, 0.0), "XTC sampling is not supported (xtc_probability only 0)"),
    "n_probs": (_off(0), "n_probs is llama-server's: use logprobs and top_logprobs"),
    "samplers": (_off(), "samplers (llama-server's sampler order) is not supported"),
}

#: every refused field, by its path from the top of the body
REFUSED = {**REFUSED_OPENAI_VLLM, **REFUSED_LLAMA_SERVER}
#: llama-server's penalty windows: they change nothing where the request applies no penalty (llama-server's clients
#: send their default, 64, with every request)
PENALTY_WINDOWS = {"repeat_last_n", "penalty_last_n"}
_PENALTIES = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


def _extras(model: BaseModel, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, value) of every unknown field in ``model`` and the models inside it (``messages.[0].refusal``)."""
    out = [(prefix + k, v) for k, v in (model.model_extra or {}).items()]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                out += _extras(item, f"{prefix}{name}." + (f"[{i}]." if i is not None else ""))
    return out


def _penalised(req: BaseModel) -> bool:
    """Whether the request applies a penalty (a value other than its off value)."""
    return any(getattr(req, name, None) not in (None, off) for name, off in _PENALTIES.items())


def refused_field(req: BaseModel) -> tuple[str, str] | None:
    """The first unknown field that would change the output, as (path, why); None when there is none."""
    for path, value in _extras(req):
        rule = REFUSED.get(path)
        if path in PENALTY_WINDOWS and not _penalised(req):
            continue
        if rule and not rule[0](value):
            return path, f"{rule[1]}, got {path}={value!r}"
    return None


def ignored_fields(req: BaseModel) -> list[str]:
    """The unknown fields of ``req`` (paths), accepted and not used: for the server's warning."""
    return [path for path, _ in _extras(req)]
