"""Per-link counters as Prometheus metrics (optional: ``pip install 'kvpush[metrics]'``).

    from kvpush.metrics import export_prometheus
    export_prometheus(dd)                 # registers with prometheus_client's default registry
    prometheus_client.start_http_server(9400)

The values are those of ``LLMDataDist.link_stats()``, read at scrape time; nothing is sampled or
cached in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from .datadist import LLMDataDist

_COUNTERS = {
    "bytes_in": "bytes received on the link's control stream (TCP payloads included)",
    "bytes_out": "bytes sent on the link's control stream (TCP payloads included)",
    "bytes_pushed": "block bytes this engine asked to push over the link",
    "bytes_pulled": "block bytes this engine asked to pull over the link",
    "bytes_received": "block bytes the peer pushed into this engine's caches",
    "bytes_served": "block bytes the peer pulled from this engine's caches",
    "write_requests": "layers this engine pushed",
    "read_requests": "layers this engine pulled",
}


class LinkCollector:
    """A prometheus_client collector over one engine's links."""

    def __init__(self, engine: LLMDataDist) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["cluster", "peer", "transport"]
        stats = self.engine.link_stats()
        mine = str(self.engine.cluster_id)
        for name, text in _COUNTERS.items():
            family = CounterMetricFamily(f"kvpush_link_{name}", text, labels=labels)
            for peer, link in stats.items():
                family.add_metric([mine, str(peer), link["transport"]], float(link.get(name, 0)))
            yield family
        failures = CounterMetricFamily("kvpush_link_failures", "failed transfers by status code",
                                       labels=[*labels, "status"])
        rtt = GaugeMetricFamily("kvpush_link_rtt_seconds", "keepalive round trip", labels=labels)
        for peer, link in stats.items():
            for status, count in link["failures"].items():
                failures.add_metric([mine, str(peer), link["transport"], status], float(count))
            if link["rtt_ms"] is not None:
                rtt.add_metric([mine, str(peer), link["transport"]], link["rtt_ms"] / 1000)
        yield failures
        yield rtt
        links = GaugeMetricFamily("kvpush_links", "live links of this engine", labels=["cluster"])
        links.add_metric([mine], float(len(stats)))
        yield links


def export_prometheus(engine: LLMDataDist, registry: Any = None) -> LinkCollector:
    """Register the engine's link counters with ``registry`` (default: prometheus_client's).
    LLM_FEATURE_NOT_ENABLED when prometheus_client is not installed."""
    try:
        import prometheus_client
    except ImportError:
        raise LLMException(LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                           "export_prometheus needs prometheus_client: pip install 'kvpush[metrics]'") from None
    collector = LinkCollector(engine)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
