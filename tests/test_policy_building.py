"""Each configured policy is built once per process that uses it (issue 29).

A deployment parses its config in four processes: the driver (`build_app`, which
validates it and so builds every policy), the router, each replica actor and each
replica's EngineCore. Before, each of them validated it again and then built what it
used: a replica policy was built 5 times (driver, router, replica actor, EngineCore
twice) and a router policy 3 times (driver, router twice). Now the processes after the
driver parse the checked config without building (protocol/config.py `checked`) and
build each policy they use on first use, once."""

from blockserve.controller.app import build_app
from blockserve.protocol.config import ADDITIONAL_CONFIG_KEY, AppConfig, ReplicaConfig, checked
from blockserve.protocol.policies import VllmDefaultGate
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.router.placement import BestFitBlocks
from blockserve.tools.engine_less import EngineLessReplica

BUILT = {"gate": 0, "placement": 0}


class CountingGate(VllmDefaultGate):
    def __init__(self) -> None:
        BUILT["gate"] += 1


class CountingPlacement(BestFitBlocks):
    def __init__(self) -> None:
        super().__init__()
        BUILT["placement"] += 1


def test_each_process_builds_each_policy_it_uses_once(model_dir):
    args = {"replica": {"model": model_dir, "publish_kv_events": False,
                        "scheduler": {"admission_gate": "test_policy_building:CountingGate"}},
            "router": {"placement": "test_policy_building:CountingPlacement",
                       "prefix_index": "approximate"}}
    BUILT.update(gate=0, placement=0)

    build_app(args)  # the driver: validation builds each policy once to check it
    assert BUILT == {"gate": 1, "placement": 1}
    config = AppConfig.model_validate(args)  # what build_app hands on, as a dict
    BUILT.update(gate=0, placement=0)

    router = checked(AppConfig, config.model_dump())  # the router process
    assert router.router.placement.policy is router.router.placement.policy
    replica = checked(ReplicaConfig, config.replica.model_dump())  # a replica actor
    assert BUILT == {"gate": 0, "placement": 1}

    raw = replica.engine_kwargs(None)["additional_config"][ADDITIONAL_CONFIG_KEY]
    engine = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=16,
                               scheduler=raw)  # its EngineCore: vLLM's real scheduler
    assert isinstance(engine.scheduler.admission_gate, CountingGate)
    assert BUILT == {"gate": 1, "placement": 1}  # before: 4 more and 2 more
