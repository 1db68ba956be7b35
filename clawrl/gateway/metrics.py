"""Prometheus metrics of one gateway (its own registry, so several apps can live in one process).

The request path updates plain Python numbers: a labelled child is looked up once per label
values and kept, and ``inc``/``observe`` are an addition (a histogram adds a bisect). prometheus_client's
own metric objects take a lock and re-validate the label values on every call (~1.4-1.9 us a call
on the H200 host, eight calls a request); here a call costs ~0.1-0.3 us. The numbers are read
when ``/metrics`` is scraped, by a collector in a prometheus_client registry that renders the
standard text format (counters as ``<name>_total`` with ``<name>_created``, histograms as
cumulative ``_bucket{le=...}``, ``_count`` and ``_sum``).

Updated from the event loop's thread only (every caller is a coroutine or a callback of the
loop), which is what makes the unlocked ``+=`` exact; ``/metrics`` is rendered on that thread too.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Value:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class _Buckets:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative; the last bound is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # first bucket with amount <= le
        self.sum += amount


class _Family:
    """A metric and its children by label values (one child, no labels, when it has none)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], new_child: Callable):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._new_child = new_child
        self._children: dict[tuple[str, ...], object] = {}  # by label values as text
        self._lookup: dict[tuple, object] = {}  # by the values as passed (labels(200) and labels("200") meet)
        self._solo = None if self.labelnames else self._child(())

    def labels(self, *values):
        child = self._lookup.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values!r}")
            key = tuple(str(v) for v in values)
            child = self._lookup[values] = self._children.get(key) or self._child(key)
        return child

    def _child(self, values: tuple[str, ...]):
        child = self._children[values] = self._new_child()
        return child

    def children(self) -> Iterator[tuple[dict[str, str], object]]:
        for values, child in list(self._children.items()):
            yield dict(zip(self.labelnames, values)), child


class Counter(_Family):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        super().__init__(name, documentation, labelnames, _Value)

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up (got {amount})")
        self._solo.inc(amount)  # type: ignore[union-attr]

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, child in self.children():
            family.add_metric(list(labels.values()), child.value, created=child.created)  # type: ignore[attr-defined]
        return family


class Gauge(_Family):
    def __init__(self, name: str, documentation: str):
        super().__init__(name, documentation, (), _Value)
        self._function: Callable[[], float] | None = None

    def inc(self, amount: float = 1.0) -> None:
        self._solo.inc(amount)  # type: ignore[union-attr]

    def dec(self, amount: float = 1.0) -> None:
        self._solo.dec(amount)  # type: ignore[union-attr]

    def set_function(self, fn: Callable[[], float]) -> None:
        """Read ``fn()`` at scrape time instead of a stored value."""
        self._function = fn

    @property
    def value(self) -> float:
        return float(self._function()) if self._function else self._solo.value  # type: ignore[union-attr]

    def collect(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.documentation)
        family.add_metric([], self.value)
        return family


class Histogram(_Family):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS):
        bounds = tuple(sorted(float(b) for b in buckets))
        if not bounds or bounds[-1] != math.inf:
            bounds += (math.inf,)
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, lambda: _Buckets(bounds))

    def observe(self, amount: float) -> None:
        self._solo.observe(amount)  # type: ignore[union-attr]

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, child in self.children():
            running, cumulative = 0, []
            for bound, n in zip(self.bounds, child.counts):  # type: ignore[attr-defined]
                running += n
                cumulative.append((floatToGoString(bound), running))
            family.add_metric(list(labels.values()), cumulative, child.sum)  # type: ignore[attr-defined]
            family.samples.append(Sample(self.name + "_created", labels, child.created))  # type: ignore[attr-defined]
        return family


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests = Counter("clawrl_requests", "Chat completion requests by outcome.",
                                ["status", "stream", "turn_type"])
        self.prompt_tokens = Counter("clawrl_prompt_tokens", "Prompt tokens served.")
        self.completion_tokens = Counter("clawrl_completion_tokens", "Completion tokens served.")
        self.latency = Histogram("clawrl_request_latency_seconds", "End-to-end latency of completions.",
                                 ["stream"], buckets=LATENCY_BUCKETS)
        self.engine_latency = Histogram("clawrl_engine_latency_seconds", "Time spent inside the engine.",
                                        buckets=LATENCY_BUCKETS)
        self.turns_recorded = Counter("clawrl_turns_recorded", "Turns appended to the session log.", ["turn_type"])
        self.next_states = Counter("clawrl_next_states", "Next-state records by reason.", ["reason"])
        self.pending_turns = Gauge("clawrl_pending_turns", "Main turns waiting for their next state.")
        self.open_sessions = Gauge("clawrl_open_sessions", "Sessions held in memory.")
        self.in_flight = Gauge("clawrl_in_flight_requests", "Requests being served now.")
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's Collector protocol: every family, in declaration order."""
        for value in vars(self).values():
            if isinstance(value, _Family):
                yield value.collect()

    def render(self) -> bytes:
        return generate_latest(self.registry)
