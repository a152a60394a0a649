"""What a block policy sees of a block (protocol/policies.py `BlockView`): its position in
its request's block table, the tenants whose requests hit it, and `on_hit` once per hit
block, in block order, before the request's new blocks are taken. On vLLM's REAL
scheduler and block pool, engine-less."""

import re
from pathlib import Path

from blockserve.protocol.hints import Hints
from blockserve.protocol.policies import BlockView, EvictionPolicy, RequestView
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.tools.engine_less import EngineLessReplica

PREFIX = list(range(1, 161))  # 5 full blocks of 32
EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


class Recorder(EvictionPolicy):
    """vLLM's order; records what each hit and each eviction saw."""

    def __init__(self):
        self.calls: list[tuple] = []

    def may_evict(self, block: BlockView, now: float) -> bool:
        self.calls.append(("may_evict", block.block_id))
        return True

    def on_hit(self, block: BlockView, request: RequestView) -> None:
        self.calls.append(("on_hit", request.request_id, block.position,
                               set(block.tenants)))

    def on_evict(self, block: BlockView) -> None:
        self.calls.append(("on_evict", block.block_id, block.position, set(block.tenants)))


def replica(model_dir, num_blocks=33):
    return EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=num_blocks,
                             block_size=32,
                             scheduler={"block_eviction": "tests.test_block_view:Recorder"})


def serve(rep, request_id, prompt, tenant, max_tokens=4):
    rep.add(request_id, prompt, max_tokens, hints=Hints(tenant=tenant))
    rep.run_until_idle()


def calls(rep) -> list[tuple]:
    return rep.scheduler.block_policies.policies.eviction.calls


def hits(rep, request_id):
    return [c[2:] for c in calls(rep) if c[0] == "on_hit" and c[1] == request_id]


def test_on_hit_comes_per_block_in_block_order_with_the_tenants_so_far(model_dir):
    rep = replica(model_dir)
    serve(rep, "first", PREFIX + [900, 901], "a")
    assert hits(rep, "first") == []
    serve(rep, "second", PREFIX + [902], "b")
    assert [position for position, _ in hits(rep, "second")] == [0, 1, 2, 3, 4]
    assert all(tenants == {"b"} for _, tenants in hits(rep, "second"))  # this hit counted first
    serve(rep, "third", PREFIX[:96] + [903], "c")
    assert hits(rep, "third") == [(0, {"b", "c"}), (1, {"b", "c"}), (2, {"b", "c"})]


def test_on_hit_comes_before_the_request_takes_its_new_blocks(model_dir):
    rep = replica(model_dir, num_blocks=12)  # 11 blocks
    serve(rep, "first", PREFIX + [900], "a")
    serve(rep, "filler", list(range(3000, 3097)), "a")  # 3 more cached blocks, 3 left empty
    calls(rep).clear()
    serve(rep, "second", PREFIX + list(range(2000, 2160)), "b")  # 5 new blocks: evicts 2
    kinds = [c[0] for c in calls(rep)]
    assert kinds[:5] == ["on_hit"] * 5 and "may_evict" in kinds[5:]


def test_a_freed_block_keeps_its_position_and_an_evicted_one_forgets_its_tenants(model_dir):
    rep = replica(model_dir, num_blocks=9)  # 8 blocks
    serve(rep, "first", PREFIX + [900], "a")
    serve(rep, "second", PREFIX + [901], "b")
    records = rep.scheduler.block_policies.records.values()
    held = [r for r in records if r.request_id == "second"]
    assert sorted(r.position for r in held) == list(range(len(held)))
    prefix_records = [r for r in held if r.position < 5]
    assert all(r.tenants == {"b"} for r in prefix_records)
    prefix_ids = {r.block_id for r in prefix_records}
    serve(rep, "scan", list(range(3000, 3000 + 7 * 32)), "c")  # takes every block
    evicted = [c for c in calls(rep) if c[0] == "on_evict"]
    assert {c[2] for c in evicted} >= set(range(5))  # positions, as they were cached
    assert all(c[3] == {"b"} for c in evicted if c[1] in prefix_ids)  # seen before reset
    scanned = [r for r in records if r.request_id == "scan"]
    assert prefix_ids <= {r.block_id for r in scanned} and not any(r.tenants for r in scanned)


def test_the_guides_shared_heads_policy_keeps_a_prefix_two_tenants_hit(model_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def prefix_kept(**scheduler) -> int:
        """P (3 blocks) hit by tenants b and c, then a private prompt cached after it,
        then a prompt that must evict one cached block: LRU takes P's, the policy the
        private one. Returns the tokens of P a probe still finds cached."""
        rep = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=9, block_size=32,
                                scheduler=scheduler)
        shared = list(range(1, 97))
        for request_id, tenant in (("first", "a"), ("b", "b"), ("c", "c")):
            serve(rep, request_id, shared + [5], tenant, max_tokens=1)
        serve(rep, "private", list(range(300, 364)), "a", max_tokens=1)
        serve(rep, "filler", list(range(500, 627)), "a", max_tokens=1)
        rep.add("probe", shared + [5], 1, hints=Hints(tenant="d"))
        return 97 - rep.run_until_idle()[0].scheduled["probe"]

    assert prefix_kept(block_eviction="vllm") < 96
    assert prefix_kept(block_eviction="keep_shared_heads:KeepSharedHeads") == 96


def test_the_guides_engine_less_example_runs_as_written(monkeypatch, capsys):
    """docs/block-policies.md, "2. Test it engine-less": every name it uses is defined."""
    guide = (EXAMPLES.parent / "block-policies.md").read_text()
    section = guide.split("### 2. Test it engine-less", 1)[1]
    code = re.search(r"```\n(.*?)```", section, re.S).group(1)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    exec(compile(code, "docs/block-policies.md", "exec"), {})
    cached, errors = capsys.readouterr().out.split(" ", 1)
    assert int(cached) > 0 and "'block_eviction': 0" in errors
