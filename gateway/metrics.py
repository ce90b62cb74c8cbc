"""The gateway's own Prometheus series: requests by route and status, latency, and prompt tokens reused."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvpool_gateway_requests", "HTTP requests by route and status.", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "kvpool_gateway_request_seconds",
            "Time to the whole answer (non-streamed) or to the last chunk (streamed), by route.",
            ["route"],
            buckets=BUCKETS_S,
            registry=self.registry,
        )
        self.first_token = Histogram(
            "kvpool_gateway_first_token_seconds",
            "Time from the request to its first generated text, by route.",
            ["route"],
            buckets=BUCKETS_S,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvpool_gateway_prompt_tokens",
            "Prompt tokens of the requests (whole conversations).",
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "kvpool_gateway_cached_tokens",
            "Prompt tokens not computed because the conversation's session already held them.",
            registry=self.registry,
        )
        self.reused = Counter(
            "kvpool_gateway_conversations",
            "Turns by what the gateway found: a session to continue, or a new one (first turn or edited history).",
            ["kind"],
            registry=self.registry,
        )
