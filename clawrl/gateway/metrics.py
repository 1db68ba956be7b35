"""Prometheus metrics of one gateway, in a registry of its own so several apps can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("clawrl_requests", "Chat completion requests by outcome.",
                                ["status", "stream", "turn_type"], registry=r)
        self.prompt_tokens = Counter("clawrl_prompt_tokens", "Prompt tokens served.", registry=r)
        self.completion_tokens = Counter("clawrl_completion_tokens", "Completion tokens served.", registry=r)
        self.latency = Histogram("clawrl_request_latency_seconds", "End-to-end latency of completions.",
                                 ["stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.engine_latency = Histogram("clawrl_engine_latency_seconds", "Time spent inside the engine.",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.turns_recorded = Counter("clawrl_turns_recorded", "Turns appended to the session log.", ["turn_type"],
                                      registry=r)
        self.next_states = Counter("clawrl_next_states", "Next-state records by reason.", ["reason"], registry=r)
        # the next two are read at scrape time (set_function): counting pending turns walks every open session
        self.pending_turns = Gauge("clawrl_pending_turns", "Main turns waiting for their next state.", registry=r)
        self.open_sessions = Gauge("clawrl_open_sessions", "Sessions held in memory.", registry=r)
        self.in_flight = Gauge("clawrl_in_flight_requests", "Requests being served now.", registry=r)
        self.client_aborts = Counter("clawrl_client_aborts", "Requests whose client went away before their end "
                                     "(aborted in the engine, nothing recorded).", ["stream"], registry=r)

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
