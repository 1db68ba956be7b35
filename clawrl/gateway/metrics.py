"""Prometheus metrics of one gateway, in a registry of its own so several apps can live in one process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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

    def watch_engines(self, engine_states: Callable[[], list[dict[str, Any]]]) -> None:
        """Per-engine metrics of several engines behind the gateway, read at scrape time."""
        self.registry.register(_EngineCollector(engine_states))

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class _EngineCollector:
    """``clawrl_engine_*{engine="<url>"}``: up, weight version, in flight, sessions, requests, failures."""

    def __init__(self, engine_states: Callable[[], list[dict[str, Any]]]):
        self.engine_states = engine_states

    def collect(self) -> Iterator[Metric]:
        states = self.engine_states()
        gauges = {"up": "1 while the engine is in rotation, 0 while it is out.",
                  "weight_version": "The weight version it serves (-1: not a number or not known).",
                  "in_flight": "Requests it is serving now.", "sessions": "Sessions routed to it."}
        for key, doc in gauges.items():
            g = GaugeMetricFamily(f"clawrl_engine_{key}", doc, labels=["engine"])
            for st in states:
                g.add_metric([st["url"]], _number(st[key]))
            yield g
        for key, doc in {"requests": "Requests sent to it.", "failures": "Times it was taken out."}.items():
            c = CounterMetricFamily(f"clawrl_engine_{key}", doc, labels=["engine"])
            for st in states:
                c.add_metric([st["url"]], float(st[key]))
            yield c


def _number(v: Any) -> float:
    """A gauge's value: booleans and numbers as they are, a numeric version string as its number, else -1."""
    if isinstance(v, (bool, int, float)):
        return float(v)
    return float(v) if isinstance(v, str) and v.isdigit() else -1.0
