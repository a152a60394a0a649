"""Prometheus metrics served by the router's `/metrics`.

Replica block state is exported from the ledger at scrape time (a custom collector, so
there is no second copy of the state to keep in sync), in protocol/blocks.py's words;
router events are counters and histograms. Names follow Prometheus conventions
(`promtool check metrics` clean).

With several routers (issue 28) a scrape reaches one of them (through HAProxy), so each
router's `/metrics` shows every router: the replicas' series once, from its own snapshots
(every router reads the same truth), and each router's own series (its ledger, queue,
decisions, latencies), labelled `router`, from the other routers' latest reports on the
board (router/board.py). Dashboards sum over `router`.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector

from blockserve.protocol.blocks import STATES
from blockserve.protocol.snapshot import BLOCK_POLICY_KINDS, LATENCY_BUCKETS_S
from blockserve.router.admission import AdmissionQueue

# What a replica's block policies did (protocol/snapshot.py BLOCK_POLICY_EFFECTS), counted
# only while they are installed.
EFFECT_HELP = {
    "cached_blocks_evicted": "Cached KV blocks a replica reused for new work",
    "blocks_spared": "Cached KV blocks a replica's eviction policy kept for later",
    "blocks_sent_first": "Freed KV blocks a replica's retention policy put next in line "
                         "for eviction",
    "admissions_refused": "Times a replica's block budget kept a waiting request waiting",
}

class Families(Collector):
    """Metric families collected elsewhere (another router's report), to expose."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merged(families: Iterable[Metric]) -> list[Metric]:
    """Families of one name from several routers as one family (one HELP and TYPE)."""
    by_name: dict[str, Metric] = {}
    for family in families:
        into = by_name.get(family.name)
        if into is None:
            into = by_name[family.name] = Metric(family.name, family.documentation,
                                                 family.type, family.unit)
        into.samples.extend(family.samples)
    return list(by_name.values())


class ReplicaCollector(Collector):
    """The replicas' own state, as their snapshots report it: the same at every router."""

    def __init__(self, app: str, queue: AdmissionQueue):
        self.app = app
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        app, ledger = self.app, self.queue.ledger
        labels = ["app", "replica"]
        blocks = GaugeMetricFamily(
            "blockserve_replica_kv_blocks",
            "KV blocks of a replica by state, which sum to capacity: "
            + "; ".join(f"{state}: {meaning}" for state, meaning in STATES.items()),
            labels=labels + ["state"])
        capacity = GaugeMetricFamily("blockserve_replica_kv_blocks_capacity",
                                     "Usable KV blocks of a replica", labels=labels)
        usage = GaugeMetricFamily("blockserve_replica_kv_usage_ratio",
                                  "Held KV blocks over capacity (vLLM's kv_cache_usage)",
                                  labels=labels)
        growth = GaugeMetricFamily("blockserve_replica_kv_growth_blocks",
                                   "Further KV blocks a replica's running requests will take "
                                   "before their common peak", labels=labels)
        waiting_blocks = GaugeMetricFamily("blockserve_replica_kv_waiting_blocks",
                                           "New KV blocks the requests waiting in a replica's "
                                           "engine need to start", labels=labels)
        requests = GaugeMetricFamily("blockserve_replica_requests",
                                     "Requests in a replica's engine by state",
                                     labels=labels + ["state"])
        preemptions = CounterMetricFamily("blockserve_replica_preemptions",
                                          "Requests preempted by a replica's scheduler",
                                          labels=labels)
        age = GaugeMetricFamily("blockserve_replica_snapshot_age_seconds",
                                "Seconds since the router last heard from a replica",
                                labels=labels)
        prefix_queries = CounterMetricFamily(
            "blockserve_replica_prefix_cache_queries_tokens",
            "Prompt tokens looked up in a replica's prefix cache (vLLM's count)", labels=labels)
        prefix_hits = CounterMetricFamily(
            "blockserve_replica_prefix_cache_hits_tokens",
            "Prompt tokens found in a replica's prefix cache (vLLM's count)", labels=labels)
        policies = GaugeMetricFamily(
            "blockserve_replica_block_policies_info",
            "The block policies a replica's config names (1 per replica)",
            labels=labels + list(BLOCK_POLICY_KINDS))
        effects = {key: CounterMetricFamily(f"blockserve_replica_{key}", help_text, labels=labels)
                   for key, help_text in EFFECT_HELP.items()}
        policy_errors = CounterMetricFamily(
            "blockserve_replica_policy_errors",
            "Exceptions a replica's scheduler policy (its config field) raised; vLLM's "
            "answer stood for each", labels=labels + ["policy"])
        itl = ReplicaHistogram("blockserve_replica_inter_token_latency_seconds",
                               "vLLM's own inter-token latency on a replica", "itl")
        ttft = ReplicaHistogram("blockserve_replica_time_to_first_token_seconds",
                                "vLLM's own time to first token on a replica (engine side)", "ttft")
        now = time.time()
        for replica_id, entry in sorted(ledger.replicas.items()):
            snap, states, key = entry.snapshot, entry.blocks, [app, replica_id]
            for state, value in states.by_state().items():
                blocks.add_metric(key + [state], value)
            capacity.add_metric(key, states.total)
            usage.add_metric(key, states.usage)
            growth.add_metric(key, states.growth)
            waiting_blocks.add_metric(key, states.waiting)
            requests.add_metric(key + ["running"], snap.running)
            requests.add_metric(key + ["waiting"], snap.waiting)
            preemptions.add_metric(key, snap.preemptions_total)
            age.add_metric(key, max(0.0, now - entry.received_at))
            prefix_queries.add_metric(key, entry.engine.get("vllm_prefix_cache_queries_total", 0))
            prefix_hits.add_metric(key, entry.engine.get("vllm_prefix_cache_hits_total", 0))
            for family in (itl, ttft):
                family.add_from(key, entry.engine)
            reported = entry.block_policies()
            policies.add_metric(key + [str(reported.get(kind, "")) for kind in BLOCK_POLICY_KINDS],
                                1)
            for effect, family in effects.items():
                family.add_metric(key, reported[effect])
            for field, count in snap.policy_errors().items():
                policy_errors.add_metric(key + [field], count)
        yield from (blocks, capacity, usage, growth, waiting_blocks, requests, preemptions, age,
                    prefix_queries, prefix_hits, itl, ttft, policies, *effects.values(),
                    policy_errors)


class LedgerCollector(Collector):
    """This router's own ledger and queue: its reservations, not the other routers'."""

    def __init__(self, app: str, router: str, queue: AdmissionQueue):
        self.app, self.router = app, router
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        app, router, queue, ledger = self.app, self.router, self.queue, self.queue.ledger
        labels = ["app", "router", "replica"]
        reserved = GaugeMetricFamily("blockserve_ledger_reserved_blocks",
                                     "KV blocks the router reserved for its unfinished "
                                     "requests on a replica", labels=labels)
        available = GaugeMetricFamily("blockserve_ledger_available_blocks",
                                      "KV blocks placement may still give to new work on a "
                                      "replica: total - committed - unreflected",
                                      labels=labels)
        in_flight = GaugeMetricFamily("blockserve_ledger_in_flight_requests",
                                      "Requests the router has dispatched and not finished",
                                      labels=labels)
        drift = GaugeMetricFamily("blockserve_ledger_drift_blocks",
                                  "Predicted minus reported committed blocks at the last report",
                                  labels=labels)
        for replica_id, entry in sorted(ledger.replicas.items()):
            key, states = [app, router, replica_id], entry.blocks
            reserved.add_metric(key, states.reserved)
            available.add_metric(key, states.available)
            in_flight.add_metric(key, entry.ongoing)
            drift.add_metric(key, entry.drift_blocks)
        queue_requests = GaugeMetricFamily("blockserve_queue_requests",
                                           "Requests waiting for admission",
                                           labels=["app", "router"])
        queue_requests.add_metric([app, router], len(queue.waiting))
        queue_blocks = GaugeMetricFamily("blockserve_queue_blocks",
                                         "KV blocks demanded by requests waiting for admission",
                                         labels=["app", "router"])
        queue_blocks.add_metric([app, router], queue.queued_blocks())
        yield from (reserved, available, in_flight, drift, queue_requests, queue_blocks)


class ReplicaHistogram(HistogramMetricFamily):
    """A per-replica histogram rebuilt from the bucket counts a replica reports."""

    def __init__(self, name: str, documentation: str, kind: str):
        super().__init__(name, documentation, labels=["app", "replica"])
        self.kind = kind

    def add_from(self, labels: list[str], engine: dict) -> None:
        counts = engine.get(f"vllm_{self.kind}_buckets")
        if not counts:
            return
        bounds = [str(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
        cumulative = list(itertools.accumulate(counts))
        self.add_metric(labels, list(zip(bounds, cumulative)),
                        engine.get(f"vllm_{self.kind}_sum", 0.0))


class RouterMetrics:
    """This router's series (`router` label: its Serve replica id) and the replicas'."""

    def __init__(self, app: str, policy: str, queue: AdmissionQueue, router: str = "local"):
        self.app, self.policy, self.router = app, policy, router
        self.replicas = ReplicaCollector(app, queue)
        self.registry = CollectorRegistry()  # this router's own series only
        self.registry.register(LedgerCollector(app, router, queue))
        self.decisions = Counter("blockserve_decisions", "Admission decisions by replica",
                                 ["app", "router", "policy", "replica"], registry=self.registry)
        self.rejections = Counter("blockserve_rejections", "Requests rejected by reason",
                                  ["app", "router", "reason"], registry=self.registry)
        self.admission_wait = Histogram("blockserve_admission_wait_seconds",
                                        "Time from arrival to admission", ["app", "router"],
                                        buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.ttft = Histogram("blockserve_time_to_first_token_seconds",
                              "Arrival at the router to the first response bytes",
                              ["app", "router"], buckets=LATENCY_BUCKETS_S,
                              registry=self.registry)
        self.e2e = Histogram("blockserve_request_duration_seconds",
                             "Arrival at the router to the end of the response",
                             ["app", "router", "status"], buckets=LATENCY_BUCKETS_S,
                             registry=self.registry)

        # Routing regret (router/regret.py): per replica, the prompt tokens of answered
        # requests, the prefix hit the router predicted for them and the hit the engine
        # reported; regret sums |predicted - reported| per request.
        self.prefix_tokens = {kind: Counter(
            f"blockserve_prefix_{kind}_tokens", help_text, ["app", "router", "replica"],
            registry=self.registry) for kind, help_text in (
                ("prompt", "Prompt tokens of requests whose engine reported prefix hits"),
                ("predicted_hit", "Prompt tokens the router predicted cached at placement"),
                ("reported_hit", "Prompt tokens the engine reported served from its cache"),
                ("regret", "Sum over requests of |predicted - reported| hit tokens"))}

    def routing_outcome(self, replica_id: str, prompt: int, predicted: int,
                        reported: int) -> None:
        for kind, value in (("prompt", prompt), ("predicted_hit", predicted),
                            ("reported_hit", reported), ("regret", abs(predicted - reported))):
            self.prefix_tokens[kind].labels(self.app, self.router, replica_id).inc(value)

    def first_response(self, arrived: float) -> None:
        """A response's first bytes are ready, `arrived` (time.time()) after its request."""
        self.ttft.labels(self.app, self.router).observe(time.time() - arrived)

    def finished(self, status: int | str, arrived: float) -> None:
        """A response ended with HTTP `status` (499: the client left first)."""
        self.e2e.labels(self.app, self.router, str(status)).observe(time.time() - arrived)

    def admitted(self, replica_id: str, wait_s: float) -> None:
        self.decisions.labels(self.app, self.router, self.policy, replica_id).inc()
        self.admission_wait.labels(self.app, self.router).observe(wait_s)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(self.app, self.router, reason).inc()

    def own(self) -> list[Metric]:
        """This router's series, for its report to the board."""
        return list(self.registry.collect())

    def exposition(self, others: Iterable[list[Metric]] = ()) -> bytes:
        """The replicas' series and every router's: this one's and `others`' reports."""
        families = merged(itertools.chain(self.own(), *others))
        return (generate_latest(Families(list(self.replicas.collect())))
                + generate_latest(Families(families)))
