"""The gateway's own Prometheus series: requests by route and status, latency, prompt tokens reused, and its
queue (admission.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.prefilled_tokens = Counter(
            "kvpool_gateway_prefilled_tokens",
            "Tokens of a tool result's opening computed while the tool ran, before the request carrying it came.",
            registry=self.registry,
        )
        self.continued = Counter(
            "kvpool_gateway_continued",
            "Answers the daemon cut short that the gateway continued, by the cut's code (continuation.py).",
            ["code"],
            registry=self.registry,
        )
        self.streams_cut = Counter(
            "kvpool_gateway_streams_cut",
            "Streamed answers that ended with an error event (a cut: their 200 status had gone out, and "
            "kvpool_gateway_requests counts them under it), by route and the error's code.",
            ["route", "code"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "kvpool_gateway_queue_depth", "Requests waiting in the gateway's queue now.", registry=self.registry
        )
        self.queued = Counter(
            "kvpool_gateway_queued",
            "Requests that waited in the gateway's queue (the others were dispatched at once).",
            registry=self.registry,
        )
        self.queue_refused = Counter(
            "kvpool_gateway_queue_refused",
            "Requests answered 429 because the gateway's queue (or the key's share of it) was full.",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvpool_gateway_queue_wait_seconds",
            "Time requests waited in the gateway's queue before dispatch.",
            buckets=BUCKETS_S,
            registry=self.registry,
        )

    def requests_by_route(self, routes: dict[str, str]) -> dict[str, int]:
        """Requests answered so far per API (whatever their status), for the status page."""
        counts = dict.fromkeys(routes, 0)
        by_path = {path: name for name, path in routes.items()}
        for metric in self.requests.collect():
            for sample in metric.samples:
                name = by_path.get(sample.labels.get("route", ""))
                if name is not None and sample.name.endswith("_total"):
                    counts[name] += int(sample.value)
        return counts
