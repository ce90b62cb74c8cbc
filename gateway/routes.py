"""The gateway's routes: OpenAI's /v1/models, /v1/chat/completions and /v1/completions, Anthropic's /v1/messages,
the status page and its JSON, the health check and /metrics. A completions route turns its request into a Job
(what it asks the daemon for; each field honoured or refused, fields.py), and dispatch.py answers it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.exposition import generate_latest
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvpool.client.chat_template import TemplateError

from . import anthropic_messages, fields, responses_api
from .dispatch import Job, OtherAnswer, respond
from .http_errors import HttpError, named_as, refuse
from .media_parts import RequestMedia, holds_media
from .messages import answer_separator, template_messages
from .middleware import FIELD_AT, decode, read_body, route
from .responses_store import StoredResponse
from .schema import MAX_STOPS, ChatCompletionRequest, CompletionRequest
from .shaping import ChoiceFormat
from .tool_result_prefill import ToolResultOpening
from .tools import Toolbox

if TYPE_CHECKING:
    from .state import Gateway, Model

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
API_ROUTES = {"chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES, "messages": MESSAGES}


def as_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A translated request as the chat route's (a field the translation cannot carry is a 400 naming it)."""
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        at = FIELD_AT.search(str(exc))
        raise HttpError(
            400, f"The request cannot be served: {exc}.", "invalid_value", param=at.group(1) if at else ""
        ) from None


def fairness_key(request: Request, *identities: str | None) -> str:
    """Who is asking, for the queue's round-robin: the `user` (or `safety_identifier`) a request names, else the
    client's address. (The API key is one per gateway: it tells no clients apart.)"""
    for identity in identities:
        if identity:
            return f"user:{identity}"
    return f"address:{request.client.host if request.client else ''}"


def conversation_key(request: Request, body_key: str | None) -> str | None:
    return body_key or request.headers.get("x-session-id") or None


def build_routes(gateway: Gateway) -> list[Route]:
    config = gateway.config

    def wrapped(name: str):
        return route(name, config, gateway.metrics)

    async def body_of(request: Request) -> bytes:
        return await read_body(request, config.max_body_bytes, config.body_timeout)

    def request_media() -> RequestMedia:
        return RequestMedia(config.media_dir, config.fetch_media_urls, config.max_body_bytes)

    def route_with_errors(errors: Callable[[HttpError], Response]):
        return lambda name: route(name, config, gateway.metrics, errors)

    @wrapped("/v1/models")
    async def models(request: Request) -> Response:
        """One model, served under any name asked (llama-server's convention); --alias names are listed too."""
        model = await gateway.model()
        entry = {"id": model.id, "object": "model", "created": 0, "owned_by": "kvpool", "aliases": list(config.aliases)}
        return JSONResponse({"object": "list", "data": [entry]})

    @wrapped(CHAT)
    async def chat(request: Request) -> Response:
        return await chat_answer(request, decode(await body_of(request), ChatCompletionRequest))

    async def chat_prompt(
        body: ChatCompletionRequest, media: RequestMedia
    ) -> tuple[Model, str, list[dict[str, str]], Toolbox | None, Any]:
        """The chat request's rendered prompt (its media as markers, kept in ``media``), with what it was made
        from."""
        fields.refuse_chat_fields(body)
        model = await gateway.model()
        response = fields.response_schema(body.response_format)
        toolbox = Toolbox.of(body, response)
        fields.refuse_stop_in_json(body.stop, json_answer=toolbox is not None or response is not None)
        messages = template_messages(
            body.messages, toolbox, gateway.memory, fields.format_description(body.response_format), media
        )
        try:
            text = model.template.render(messages, add_generation_prompt=True)
        except TemplateError as exc:
            raise HttpError(400, str(exc), "template", param="messages") from None
        return model, text, messages, toolbox, response

    async def chat_answer(
        request: Request, body: ChatCompletionRequest, answer: OtherAnswer | None = None, route: str = CHAT
    ) -> Response:
        """The chat route's answer to ``body``, shaped as OpenAI's (or as ``answer`` shapes it); ``route``: the API
        asked, which the metrics name (a Messages or Responses request is answered through this one)."""
        media = request_media()
        model, text, messages, toolbox, response = await chat_prompt(body, media)
        params = fields.sampling(
            body, model.status.n_vocab, body.max_completion_tokens or body.max_tokens, fields.DEFAULT_CHAT_MAX_TOKENS
        )
        own = params.get("stop", [])
        implied = [stop for stop in model.template.stops if stop not in own]
        if len(own) + len(implied) > MAX_STOPS:  # (the daemon's bound, which the client could not see)
            raise refuse(
                "stop",
                f"`stop` may hold at most {MAX_STOPS - len(implied)} strings with this chat template, which adds "
                f"{', '.join(repr(s) for s in implied)} of its own.",
                "invalid_value",
            )
        params["stop"] = [*own, *implied]
        schema_fields: list[tuple[str, str]] = []
        if toolbox is not None:
            schema, schema_fields = toolbox.schema()
        else:
            schema = response
            schema_fields = [("$", "response_format.json_schema.schema")]
        if schema is not None:
            params["json_schema"] = fields.schema_text(schema)
            text += answer_separator(model.template, messages, text)
        if body.logprobs:
            params["logprobs"] = body.top_logprobs or 0
        if (predicted := fields.prediction_text(body)) is not None:
            params["prediction"] = predicted
        job = Job(
            route=route,
            prompt=text,
            special=True,
            add_bos=model.template.needs_bos(text),
            params=params,
            choice_format=ChoiceFormat(chat=True, logprobs=params.get("logprobs"), tools=toolbox is not None),
            n=body.n or 1,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            conversation=conversation_key(request, body.prompt_cache_key),
            fairness=fairness_key(request, body.user, body.safety_identifier),
            service_tier=body.service_tier,
            schema_fields=schema_fields if schema is not None else [],
            tool_results=(
                ToolResultOpening(model.template, messages)
                if toolbox is not None and config.prefill_tool_results
                else None
            ),
            answer=answer,
            media=media if media.by_digest else None,
        )
        return await respond(request, gateway, model.id, job)

    anthropic = route_with_errors(anthropic_messages.error_response)

    @anthropic(MESSAGES)
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API, through the chat route (anthropic_messages.py)."""
        asked = decode(await body_of(request), anthropic_messages.MessagesRequest)
        translated, names = anthropic_messages.chat_request(asked)
        with named_as(names):
            body = as_chat_request(translated)
            model = await gateway.model()
            answer = anthropic_messages.AnthropicAnswer(model.id, asked.stop_sequences)
            return await chat_answer(request, body, answer, MESSAGES)

    @anthropic(COUNT_TOKENS)
    async def count_tokens(request: Request) -> Response:
        """The tokens a Messages request's prompt comes to, as the chat route renders it."""
        asked = decode(await body_of(request), anthropic_messages.CountTokensRequest)
        translated, names = anthropic_messages.chat_request(asked)
        with named_as(names):
            model, text, *_ = await chat_prompt(as_chat_request(translated), request_media())
        if holds_media(text):  # (the daemon counts a medium's cells; a rendering without it would undercount)
            raise HttpError(
                400, "count_tokens counts text only here: leave the images out, or send the message.", "invalid_value"
            )
        client = await gateway.client()
        tokens = await client.tokenize(text, add_bos=model.template.needs_bos(text), special=True)
        return JSONResponse({"input_tokens": len(tokens)})

    @wrapped(RESPONSES)
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, through the chat route (responses_api.py); a chain runs as one conversation."""
        asked = decode(await body_of(request), responses_api.ResponsesRequest)
        responses_api.refuse_unserved(asked)
        history: list[dict[str, Any]] = []
        # A chain runs as the conversation its client names, else as an unnamed one, continued by its history as
        # the chat route continues any (so a client that resends the whole history, as the Agents SDK does, and one
        # that chains by previous_response_id both reach the session that holds it).
        chain = asked.prompt_cache_key or ""
        if asked.previous_response_id is not None:
            previous = gateway.responses.get(asked.previous_response_id)
            if previous is None:
                raise HttpError(
                    404,
                    f"No stored response {asked.previous_response_id!r}: it was not stored (store: false), was "
                    "deleted, or has expired; send the conversation as input instead.",
                    "not_found",
                    param="previous_response_id",
                )
            history, chain = previous.messages, asked.prompt_cache_key or previous.chain
        translated, names = responses_api.chat_request(asked, history, chain)
        with named_as(names):
            body = as_chat_request(translated)
            model = await gateway.model()
            items = responses_api.input_items_of(asked)

            def store(response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
                gateway.responses.put(response, chain, messages, items)

            conversation = translated["messages"][1 if asked.instructions else 0 :]  # (the chain, then the input)
            answer = responses_api.ResponsesAnswer(
                asked, model.id, conversation, store if asked.store is not False else None
            )
            return await chat_answer(request, body, answer, RESPONSES)

    def stored(request: Request) -> StoredResponse:
        found = gateway.responses.get(request.path_params["response_id"])
        if found is None:
            raise HttpError(
                404, "No such stored response (never stored, deleted, or expired).", "not_found", param="response_id"
            )
        return found

    @wrapped(RESPONSES + "/{id}")
    async def get_response(request: Request) -> Response:
        return JSONResponse(stored(request).response)

    @wrapped(RESPONSES + "/{id}/input_items")
    async def response_input_items(request: Request) -> Response:
        return JSONResponse(responses_api.input_item_list(stored(request).input_items))

    @wrapped(RESPONSES + "/{id} DELETE")
    async def delete_response(request: Request) -> Response:
        response_id = stored(request).response["id"]
        gateway.responses.delete(response_id)
        return JSONResponse(responses_api.deleted(response_id))

    @wrapped(COMPLETIONS)
    async def completions(request: Request) -> Response:
        body = decode(await body_of(request), CompletionRequest)
        fields.refuse_completion_fields(body)
        model = await gateway.model()
        prompt = fields.completion_prompt(body, model.status.n_vocab)
        params = fields.sampling(body, model.status.n_vocab, body.max_tokens, fields.DEFAULT_COMPLETION_MAX_TOKENS)
        schema = fields.response_schema(body.response_format)
        fields.refuse_stop_in_json(body.stop, json_answer=schema is not None)
        if schema is not None:
            params["json_schema"] = fields.schema_text(schema)
        if body.logprobs is not None:
            params["logprobs"] = body.logprobs
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else await (await gateway.client()).detokenize(prompt)
        job = Job(
            route=COMPLETIONS,
            prompt=prompt,
            special=False,
            # A raw completion gets the model's BOS the way kvpool's own sessions do; token ids are sent as given.
            add_bos=bool(model.status.bos_token),
            params=params,
            choice_format=ChoiceFormat(chat=False, logprobs=body.logprobs, echo=echo),
            n=body.n or 1,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            conversation=conversation_key(request, body.prompt_cache_key),
            fairness=fairness_key(request, body.user),
            schema_fields=[("$", "response_format.json_schema.schema")] if schema is not None else [],
        )
        return await respond(request, gateway, model.id, job)

    @wrapped(config.health_path)
    async def health(request: Request) -> Response:
        status = await (await gateway.client()).status()
        ok = status.stepping()
        return JSONResponse(
            {"ok": ok, "engine_idle_s": status.engine_idle_s, "sessions": status.sessions.open},
            status_code=200 if ok else 503,
        )

    page = (Path(__file__).parent / "static" / "index.html").read_text(encoding="utf-8")

    @wrapped("/")
    async def index(request: Request) -> Response:
        """The status page: the daemon's live state, the gateway's queue and a chat box, all through this gateway's
        own API."""
        return HTMLResponse(page)

    @wrapped("/status")
    async def status(request: Request) -> Response:
        daemon_status = await (await gateway.client()).status()
        model = await gateway.model()
        body = {
            "model": model.id,
            "aliases": list(config.aliases),
            "conversations": len(gateway.turns.store),
            "queue": gateway.admission.status(),
            "apis": gateway.metrics.requests_by_route(API_ROUTES),
            "stored_responses": len(gateway.responses),
            "daemon": msgspec.to_builtins(daemon_status),
        }
        return JSONResponse(body)

    @wrapped("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type="text/plain; version=0.0.4")

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route(CHAT, chat, methods=["POST"]),
        Route(COMPLETIONS, completions, methods=["POST"]),
        Route(MESSAGES, messages, methods=["POST"]),
        Route(RESPONSES, responses, methods=["POST"]),
        Route(RESPONSES + "/{response_id}", get_response, methods=["GET"]),
        Route(RESPONSES + "/{response_id}", delete_response, methods=["DELETE"]),
        Route(RESPONSES + "/{response_id}/input_items", response_input_items, methods=["GET"]),
        Route(COUNT_TOKENS, count_tokens, methods=["POST"]),
        Route(config.health_path, health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", index, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
    ]
