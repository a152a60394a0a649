"""router/admin.py without an engine: /admin/state from the real queue and ledger, and
live policy switching through the config's validation (tests/router_parts.py)."""

import asyncio
import json

import pytest

from blockserve.protocol.config import Slo
from blockserve.router.admin import Admin
from blockserve.router.board import RouterBoard
from blockserve.router.predictors import FixedPredictor
from blockserve.router.shared_lengths import SharedLengths
from router_parts import InProcess, http_request, router_parts


def admin(slo: Slo = Slo()):
    parts = router_parts(replicas=("a", "b"))
    return Admin(parts.config, slo, parts.queue, parts.ledger, parts.failover,
                 parts.metrics, kv_events=None, lengths=SharedLengths(FixedPredictor()),
                 board=InProcess(RouterBoard())), parts


def switch(admin_api, body: bytes):
    return asyncio.run(admin_api.switch(http_request(body)))


def test_state_shows_the_policies_the_queue_and_each_replicas_blocks():
    state, _ = admin()
    shown = state.state()
    assert shown["policies"]["placement"]["cls"] == "cache_aware"  # the default
    assert shown["queue"] == {"requests": 0, "blocks": 0, "tokens": 0}
    assert [r["replica_id"] for r in shown["replicas"]] == ["a", "b"]
    assert shown["replicas"][0]["blocks"]["total"] == 100 and shown["kv_events"] is None


def test_a_switch_installs_the_named_policies_at_once():
    admin_api, parts = admin()
    response = switch(admin_api, json.dumps({"placement": {"cls": "balanced", "kwargs": {
        "prefix_weight": 2}}, "queue_order": "priority"}).encode())
    assert response.status_code == 200
    assert type(parts.queue.placement).__name__ == "BalancedBlocks"
    assert parts.queue.placement.prefix_weight == 2
    assert type(parts.queue.order).__name__ == "Priority"
    assert parts.metrics.policy == "balanced"
    assert json.loads(response.body)["policies"]["queue_order"]["cls"] == "priority"
    # posted for the other routers, numbered; this router's own part of the state says so
    assert admin_api.peers.board.instance.version == 1
    [own] = json.loads(response.body)["routers"]
    assert own["policies_version"] == 1 and own["policies"]["placement"]["cls"] == "balanced"


def test_a_switched_in_policy_is_given_the_deployments_slo_as_the_config_is():
    admin_api, parts = admin(Slo(ttft_s=2.0))
    assert switch(admin_api, b'{"queue_order": "on_time_first"}').status_code == 200
    assert parts.queue.order.ttft_s == 2.0
    switch(admin_api, b'{"queue_order": {"cls": "on_time_first", "kwargs": {"ttft_s": 3}}}')
    assert parts.queue.order.ttft_s == 3


@pytest.mark.parametrize("body, message", [
    (b"not json", "Invalid policy switch"),
    (b"[]", "give 'placement' and/or 'queue_order'"),
    (b'{"placement": "no_such_placement"}', "unknown router.placement 'no_such_placement'"),
    (b'{"queue_order": {"cls": "shortest_demand", "kwargs": {"max_wait_s": -1}}}',
     "max_wait_s must be positive"),
])
def test_a_bad_switch_is_a_400_and_changes_nothing(body, message):
    admin_api, parts = admin()
    before = (parts.queue.placement, parts.queue.order)
    response = switch(admin_api, body)
    assert response.status_code == 400
    assert message in json.loads(response.body)["error"]["message"]
    assert (parts.queue.placement, parts.queue.order) == before
