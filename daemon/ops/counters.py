"""Counters the engine keeps for `status` (and, later, Prometheus): plain numbers, updated on the engine thread."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvpool.protocol.status import Counters


@dataclass
class EngineCounters:
    decode_calls: int = 0  # llama_decode calls that succeeded (one per engine step)
    batch_tokens: int = 0  # tokens fed through those calls (prompt chunks + decode tokens)
    prompt_tokens: int = 0  # prompt tokens computed (system prompts included; tokens a shared prefix held are not)
    generated_tokens: int = 0  # tokens sampled and sent to clients
    busy_seconds: float = 0.0  # wall time spent inside engine steps that decoded something
    kv_full_events: int = 0  # llama_decode found no room in the unified KV
    clients_lost: int = 0  # generations stopped because their client stopped sending heartbeats
    clients_not_reading: int = 0  # generations stopped because their client's send queue was full
    requests: Counter[str] = field(default_factory=Counter)  # by op
    errors: Counter[str] = field(default_factory=Counter)  # by error code
    finished: Counter[str] = field(default_factory=Counter)  # generations by finish reason

    def status(self, frame_errors: Counter[str]) -> Counters:
        """``frame_errors``: the frames the I/O thread refused, by code (counted on that thread)."""
        return Counters(
            decode_calls=self.decode_calls,
            batch_tokens=self.batch_tokens,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            busy_seconds=round(self.busy_seconds, 6),
            kv_full_events=self.kv_full_events,
            clients_lost=self.clients_lost,
            clients_not_reading=self.clients_not_reading,
            requests=dict(self.requests),
            errors=dict(self.errors),
            finished=dict(self.finished),
            frame_errors=dict(frame_errors),
        )
