"""An eviction policy written against blockserve's block-policy API alone
(docs/block-policies.md walks through it): no vLLM import, no vLLM internals."""

from blockserve.protocol.policies import BlockView, EvictionPolicy


class KeepPromptBlocks(EvictionPolicy):
    """Reuse output blocks first; spare a prompt block once for every prefix hit it had.

    Later prompts often repeat earlier prompts (system prompts, few-shot examples, a
    document asked about twice) and rarely repeat generated text, so blocks holding
    output are the cheapest to lose.
    """

    def __init__(self, spares_per_hit: int = 1):
        if spares_per_hit < 0:
            raise ValueError("spares_per_hit must be >= 0")
        self.spares_per_hit = spares_per_hit

    def may_evict(self, block: BlockView, now: float) -> bool:
        if not block.is_prompt:
            return True
        return block.spared >= self.spares_per_hit * block.hits
