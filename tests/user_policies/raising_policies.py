"""A user's policy module with a bug, outside the blockserve package: tests ship it to a
deployment through Ray's runtime_env (tests/test_user_module.py) and hand it to
`blockserve check` (tests/test_check.py). Only blockserve's public policy API is used."""

from blockserve.protocol.policies import BlockView, EvictionPolicy, RequestView


class RaisingEviction(EvictionPolicy):
    """vLLM's LRU order, but each method named in `raise_in` raises (a bug)."""

    def __init__(self, raise_in: list[str] | None = None):
        self.raise_in = frozenset(raise_in or ["may_evict"])

    def _bug(self, method: str) -> None:
        if method in self.raise_in:
            raise ZeroDivisionError(f"a bug in RaisingEviction.{method}")

    def may_evict(self, block: BlockView, now: float) -> bool:
        self._bug("may_evict")
        return True

    def on_hit(self, block: BlockView, request: RequestView) -> None:
        self._bug("on_hit")

    def on_free(self, block: BlockView) -> None:
        self._bug("on_free")
