"""The gateway's state: one asyncio client of kvpoold shared by every request, what it knows of the model, the
conversation map, the queue and the metrics. The routes read it; app.py builds the app around it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import jinja2

from kvpool.client.aio import AsyncClient
from kvpool.client.chat_template import ChatTemplate, TemplateError, template_for
from kvpool.client.errors import DaemonUnavailable
from kvpool.protocol.status import ModelStatus

from .admission import Admission
from .conversations import ConversationStore
from .http_errors import HttpError
from .metrics import GatewayMetrics
from .responses_store import ResponseStore
from .settings import GatewayConfig
from .tools import AnswerMemory
from .turns import Turns

FALLBACK_INFLIGHT = 16  # a daemon whose hello does not say how many generations a connection may have
# How long a request waits for a connection to kvpoold before it is answered 503 with Retry-After: a daemon that is
# stopped or restarting is reported at once, not after the client library's ride-through of a restart.
DAEMON_WAIT_S = 1.5


@dataclass
class Model:
    """What the gateway knows of the daemon's model: its id for clients, and its chat template."""

    id: str
    status: ModelStatus
    template: ChatTemplate


def anonymous_file(state_file: Path | None) -> Path | None:
    """Where the sessions of requests without a name are recorded, next to the conversation map."""
    return state_file.with_name(f"{state_file.stem}-anonymous{state_file.suffix}") if state_file else None


def responses_file(state_file: Path | None) -> Path | None:
    """Where stored responses (the Responses API) are kept, next to the conversation map."""
    return state_file.with_name(f"{state_file.stem}-responses.sqlite") if state_file else None


class Gateway:
    """The app's state: one asyncio client of kvpoold (connected lazily, so the gateway starts before the daemon
    and outlives its restarts), the conversation map, the queue, the raw text of reshaped answers, the metrics."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.admission = Admission(config.queue_size, config.queue_per_key, self.metrics)
        self.turns = Turns(
            ConversationStore(config.state_file),
            self.metrics,
            self.admission,
            reuse=config.reuse,
            anonymous=ConversationStore(anonymous_file(config.state_file)),
        )
        self.memory = AnswerMemory()
        self.responses = ResponseStore(
            responses_file(config.state_file), config.responses_max, config.responses_max_bytes, config.responses_ttl
        )
        self._client: AsyncClient | None = None
        self._model: Model | None = None
        self._connecting = asyncio.Lock()  # concurrent first requests share one connection
        self._connect_failed: tuple[float, DaemonUnavailable] | None = None  # the last failed attempt

    async def client(self) -> AsyncClient:
        asked = time.monotonic()
        async with self._connecting:
            if self._client is None:
                failed = self._connect_failed
                if failed is not None and failed[0] >= asked:
                    raise failed[1]  # an attempt made while this request waited for it failed: so does this one
                try:
                    # A multiplexer: the daemon lets this one connection have many users' generations in flight.
                    self._client = await AsyncClient.connect(
                        self.config.daemon,
                        timeout=self.config.timeout,
                        reconnect_wait=DAEMON_WAIT_S,  # the hello's answer may take connect_timeout (5 s)
                        name="gateway",
                        curve=self.config.curve(),
                        multiplexer=True,
                    )
                except DaemonUnavailable as exc:
                    self._connect_failed = (time.monotonic(), exc)
                    raise
                status = await self._client.status()
                # Sessions kept for requests without a name: a quarter of what the daemon may hold.
                self.turns.anonymous_max = max(1, status.sessions.max // 4)
                self.admission.set_limit(self.inflight_limit(self._client.max_inflight, status.sessions.max))
        return self._client

    def inflight_limit(self, daemon_inflight: int, daemon_sessions: int) -> int:
        """Generations dispatched at once: --max-inflight (default: what the daemon lets this connection have), and
        at most half the daemon's sessions, since each generation needs a session and the gateway also keeps idle
        ones for conversations. The rest wait in the gateway's queue, where they are served fairly."""
        allowed = daemon_inflight or FALLBACK_INFLIGHT
        wanted = self.config.max_inflight or allowed
        return max(1, min(wanted, allowed, daemon_sessions // 2))

    async def model(self) -> Model:
        if self._model is None:
            status = (await (await self.client()).status()).model
            name = status.path.rsplit("/", 1)[-1].removesuffix(".gguf") or "kvpool"
            try:
                source, stops = template_for(self.config.chat_template, status.chat_template)
                template = ChatTemplate(source, status.bos_token, status.eos_token, tuple(stops))
            except (TemplateError, jinja2.TemplateError) as exc:
                raise HttpError(
                    500, f"The chat template cannot be used ({exc}); fix --chat-template.", "template", "server_error"
                ) from None
            self._model = Model(name, status, template)
        return self._model

    async def close(self) -> None:
        await self.turns.close()
        self.responses.close()
        if self._client is not None:
            await self._client.close()
