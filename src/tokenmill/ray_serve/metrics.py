"""/metrics over every engine replica: each replica's `tokenmill:*` series with a `replica` label,
plus the ingress's own view (replicas answering, healthy)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.ray_serve.replica import ReplicaStats


def merge_replica_metrics(stats: list[ReplicaStats], model_name: str) -> bytes:
    """One Prometheus text page: the series of every replica, labelled replica="<id>"."""
    families: dict[str, Metric] = {}
    for s in stats:
        for fam in text_string_to_metric_families(s.metrics_text.decode()):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for sample in fam.samples:
                merged.add_sample(
                    sample.name,
                    {**sample.labels, "replica": s.replica},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
    replicas = Metric("tokenmill:num_replicas", "Engine replicas answering the ingress, by health.", "gauge")
    healthy = sum(s.healthy for s in stats)
    replicas.add_sample("tokenmill:num_replicas", {"model_name": model_name, "state": "healthy"}, healthy)
    replicas.add_sample(
        "tokenmill:num_replicas", {"model_name": model_name, "state": "unhealthy"}, len(stats) - healthy
    )
    families[replicas.name] = replicas

    class _Snapshot:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry)
