"""The gateway's metrics: names, labels and buckets as Prometheus text, gauges read at scrape time."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clawrl.gateway.metrics import LATENCY_BUCKETS, GatewayMetrics


def scrape(m: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the rendered text, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_and_gauges_render_as_prometheus_text():
    m = GatewayMetrics()
    ok = m.requests.labels("200", "false", "main")
    ok.inc()
    m.requests.labels("200", "false", "main").inc()  # the same child, looked up again
    assert m.requests.labels("200", "false", "main") is ok
    m.requests.labels("400", "true", "side").inc()
    m.requests.labels(400, "true", "side").inc()  # a number for a label: the same child as its text
    m.prompt_tokens.inc(30)
    m.prompt_tokens.inc(12)
    m.in_flight.inc()
    m.in_flight.inc()
    m.in_flight.dec()
    m.pending_turns.set_function(lambda: 7)
    s = scrape(m)
    key = lambda status, stream, tt: ("clawrl_requests_total", (("status", status), ("stream", stream), ("turn_type", tt)))
    assert s[key("200", "false", "main")] == 2.0
    assert s[key("400", "true", "side")] == 2.0
    assert ("clawrl_requests_total", (("status", "503"), ("stream", "false"), ("turn_type", "main"))) not in s
    assert s[("clawrl_prompt_tokens_total", ())] == 42.0
    assert s[("clawrl_completion_tokens_total", ())] == 0.0
    assert s[("clawrl_in_flight_requests", ())] == 1.0
    assert s[("clawrl_pending_turns", ())] == 7.0  # read at scrape time
    assert s[("clawrl_open_sessions", ())] == 0.0
    created = s[("clawrl_requests_created", (("status", "200"), ("stream", "false"), ("turn_type", "main")))]
    assert created > 1.7e9  # a Unix time, as prometheus_client writes it


def test_histogram_buckets_are_cumulative_with_le_inclusive():
    m = GatewayMetrics()
    for v in (0.003, 0.005, 0.02, 0.02, 7.0, 200.0):  # 0.005 lands in le="0.005": buckets are <=
        m.latency.labels("false").observe(v)
    m.engine_latency.observe(0.01)
    s = scrape(m)
    bucket = lambda le: s[("clawrl_request_latency_seconds_bucket", (("le", le), ("stream", "false")))]
    assert [bucket(le) for le in ("0.005", "0.01", "0.025", "5.0", "10.0", "120.0", "+Inf")] == [2, 2, 4, 4, 5, 5, 6]
    assert s[("clawrl_request_latency_seconds_count", (("stream", "false"),))] == 6
    assert s[("clawrl_request_latency_seconds_sum", (("stream", "false"),))] == pytest.approx(207.048)
    assert s[("clawrl_engine_latency_seconds_bucket", (("le", "0.005"),))] == 0
    assert s[("clawrl_engine_latency_seconds_bucket", (("le", "0.01"),))] == 1
    assert s[("clawrl_engine_latency_seconds_sum", ())] == pytest.approx(0.01)
    assert len([k for k in s if k[0] == "clawrl_engine_latency_seconds_bucket"]) == len(LATENCY_BUCKETS) + 1


def test_misuse_is_refused():
    m = GatewayMetrics()
    with pytest.raises(ValueError, match="Incorrect label count"):
        m.requests.labels("200", "false")
    with pytest.raises(ValueError, match="non-negative"):
        m.prompt_tokens.inc(-1)



def test_each_app_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()  # the same names twice in one process: no clash, no shared counts
    a.prompt_tokens.inc(5)
    assert scrape(a)[("clawrl_prompt_tokens_total", ())] == 5.0
    assert scrape(b)[("clawrl_prompt_tokens_total", ())] == 0.0
