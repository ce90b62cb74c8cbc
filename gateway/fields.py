"""What this gateway does with each request field: honour it (into the daemon's generate parameters) or refuse it
with a 400 that names it. Nothing a client sends is accepted and dropped; docs/gateway.md has the table."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from .http_errors import HttpError, refuse
from .schema import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    ResponseFormat,
    _Request,
)

DEFAULT_CHAT_MAX_TOKENS = 256  # a chat request without max_tokens: enough for an answer, bounded for a device
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON Schema (tools' parameters, response_format): deeper is refused
# The daemon's llama.cpp-style sampler fields, as named in a request and in the daemon's generate.
SAMPLERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def refuse_chat_fields(body: ChatCompletionRequest) -> None:
    """400 for each chat field this gateway cannot honour (the first one found), with what to do instead."""
    refused = {
        "audio": "`audio` output is not supported: this gateway serves a text model.",
        "functions": "`functions` is OpenAI's deprecated form: use `tools`.",
        "function_call": "`function_call` is OpenAI's deprecated form: use `tool_choice` with `tools`.",
        "reasoning_effort": "`reasoning_effort` is not supported: the served model does not reason in hidden tokens.",
        "verbosity": "`verbosity` is not supported: ask for the length you want in the prompt, or set max_tokens.",
        "web_search_options": "`web_search_options` is not supported: this gateway has no web search.",
        "moderation": "`moderation` is not supported: this gateway has no moderation model.",
        "prompt_cache_options": "`prompt_cache_options` is not supported: name a conversation with "
        "`prompt_cache_key`; its KV is kept until the daemon's session_timeout.",
        "prompt_cache_retention": "`prompt_cache_retention` is not supported: a conversation's KV is kept until "
        "the daemon's session_timeout.",
        "metadata": "`metadata` is not supported: this gateway stores nothing.",
    }
    for field, message in refused.items():
        if getattr(body, field) is not None:
            raise refuse(field, message)
    if body.store:
        raise refuse("store", "`store` = true is not supported: this gateway stores nothing.", "unsupported_value")
    if body.service_tier not in (None, "auto", "default"):
        raise refuse(
            "service_tier", "`service_tier` may be auto or default: there is one tier here.", "unsupported_value"
        )
    if body.modalities is not None and body.modalities != ["text"]:
        raise refuse(
            "modalities", '`modalities` may only be ["text"]: this gateway serves a text model.', "unsupported_value"
        )
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise refuse(
            "max_tokens",
            "`max_tokens` and `max_completion_tokens` say the same and differ here: send one of them.",
            "invalid_value",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise refuse("top_logprobs", "`top_logprobs` needs `logprobs`: true.", "invalid_value")
    if not body.tools:
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(body, field) is not None:
                raise refuse(field, f"`{field}` needs `tools`.", "invalid_value")
    _refuse_common(body)
    refuse_deep("tools", body.tools)
    refuse_deep("response_format", body.response_format)


def prediction_text(body: ChatCompletionRequest) -> str | None:
    """The text of a request's ``prediction`` (OpenAI's Predicted Outputs: ``{"type": "content", "content": text or
    text parts}``), None without one; any other shape is refused. The daemon guesses from it (docs/speculative.md)."""
    prediction = body.prediction
    if prediction is None:
        return None
    content = prediction.get("content") if isinstance(prediction, dict) else None
    if isinstance(prediction, dict) and prediction.get("type") == "content":
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content
        ):
            return "".join(part["text"] for part in content)
    raise refuse(
        "prediction",
        '`prediction` must be {"type": "content", "content": the expected answer as a text or a list of text parts}.',
        "invalid_value",
    )


def refuse_obfuscation() -> HttpError:
    return refuse(
        "stream_options.include_obfuscation",
        "`include_obfuscation` is not supported: this gateway does not pad its events.",
        "unsupported_value",
    )


def refuse_stop_in_json(stop: object, json_answer: bool) -> None:
    """A stop string where the answer is JSON a grammar shapes (tools offered, a JSON response_format) could only
    cut that JSON short, and the cut would read as a finished answer (``finish_reason`` "stop", or a tool call with
    half its arguments): refused (docs/decisions.md)."""
    if stop and json_answer:
        raise refuse(
            "stop",
            "`stop` cannot be combined with tools or a JSON response_format: the answer is JSON that its schema "
            "fixes, and a stop string could only cut it short. Leave `stop` out: the answer ends where its JSON ends.",
            "invalid_value",
        )


def refuse_deep(field: str, value: object) -> None:
    """Schemas nested beyond any real use are refused here, before the daemon walks them."""
    if value is not None and depth(json_of(value)) > MAX_SCHEMA_DEPTH:
        raise refuse(field, f"`{field}` is nested more than {MAX_SCHEMA_DEPTH} levels deep.", "invalid_value")


def refuse_completion_fields(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise refuse("suffix", "`suffix` (insertion) is not supported: send the text before it as the prompt.")
    if body.best_of not in (None, 1):
        raise refuse(
            "best_of", "`best_of` > 1 is not supported: ask for `n` choices and pick one yourself.", "unsupported_value"
        )
    if body.echo and body.logprobs is not None:
        raise refuse(
            "echo",
            "`echo` with `logprobs` is not supported: the prompt's tokens have no log-probabilities here.",
            "unsupported_value",
        )
    _refuse_common(body)
    refuse_deep("response_format", body.response_format)
    if format_description(body.response_format):
        raise refuse(
            "response_format.json_schema.description",
            "`response_format.json_schema.description` is told to "
            "the model in a system message, which a completion has not: put it in the prompt.",
            "unsupported_value",
        )


def _refuse_common(body: _Request) -> None:
    if body.stream_options is not None:
        if not body.stream:
            raise refuse("stream_options", "`stream_options` needs `stream`: true.", "invalid_value")
        if body.stream_options.include_obfuscation:
            raise refuse_obfuscation()


def completion_prompt(body: CompletionRequest, n_vocab: int) -> str | list[int]:
    """The one prompt a completions request carries: text, or token ids (each one of the vocabulary's). Several
    prompts are refused."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(x, int) for x in prompt):
        return _token_ids(prompt, n_vocab, "prompt")  # type: ignore[arg-type]
    if len(prompt) != 1:
        raise refuse("prompt", "Send one prompt per request (a list of one prompt at most).", "unsupported_value")
    only = prompt[0]
    if isinstance(only, str):
        return only
    if isinstance(only, list) and only:
        return _token_ids(only, n_vocab, "prompt[0]")
    raise refuse("prompt", "`prompt` must be a text, a list of token ids, or a list of one of those.", "invalid_value")


def _token_ids(ids: list[int], n_vocab: int, where: str) -> list[int]:
    for k, token in enumerate(ids):
        if not 0 <= token < n_vocab:
            raise refuse(
                f"{where}[{k}]", f"`{where}` token ids are 0 to {n_vocab - 1}; {token} is not one.", "invalid_value"
            )
    return list(ids)


def sampling(body: _Request, n_vocab: int, max_tokens: int | None, default_max: int) -> dict[str, Any]:
    """The daemon's generate parameters for the sampler fields a request sets (the daemon's defaults, which are
    llama.cpp's, for the rest)."""
    params: dict[str, Any] = {"max_tokens": max_tokens or default_max}
    for field in SAMPLERS:
        value = getattr(body, field)
        if value is not None:
            params[field] = value
    if body.stop is not None:
        params["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.logit_bias:
        params["logit_bias"] = token_biases(body.logit_bias, n_vocab)
    return params


def token_biases(bias: dict[str, float], n_vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) as the daemon's {token id: bias}."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= n_vocab or key != str(int(key)):
            raise refuse(
                "logit_bias",
                f"`logit_bias` keys are token ids from 0 to {n_vocab - 1} (as strings, without leading zeros, so "
                f"that each token has one key); {key[:20]!r} is not one.",
                "invalid_value",
            )
        out[int(key)] = value
    return out


def format_description(response_format: ResponseFormat | None) -> str:
    """json_schema's `description` ("what the response format is for, used by the model"), as an instruction for
    the system message; "" without one."""
    if isinstance(response_format, JsonSchemaResponseFormat) and response_format.json_schema.description:
        return f"Answer in JSON: {response_format.json_schema.description.strip()}"
    return ""


def response_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON Schema the answer must follow (None: free text). json_schema's `strict` false is held to the schema
    as well: the grammar cannot do less."""
    if isinstance(response_format, JsonObjectFormat):
        return {"type": "object"}
    if isinstance(response_format, JsonSchemaResponseFormat):
        schema = response_format.json_schema.schema
        return schema if schema else {"type": "object"}
    return None


def json_of(value: object) -> object:
    return msgspec.to_builtins(value)


def depth(value: object) -> int:
    """How deeply lists and objects nest in ``value`` (without recursion: any depth is measured safely)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=False)
