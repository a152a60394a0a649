"""A retention policy of my own, outside the blockserve repo: a freed block deep in its
request's block table goes to the front of the free queue (reused next)."""

from blockserve.protocol.policies import BlockView, RetentionPolicy


class HeadsStayTailsGo(RetentionPolicy):
    """Keep the first `keep_positions` blocks of every request in vLLM's LRU order and
    send the rest to the front when freed.

    A prefix hit needs a prefix's blocks from the first one on, so a tail block outlives
    its use once its head is gone, and the tails (a request's own question, its output)
    are what later prompts repeat least. `fail_every` > 0 raises on every n-th call: a
    deliberate bug, to see the engine survive it.
    """

    def __init__(self, keep_positions: int = 8, fail_every: int = 0):
        if keep_positions < 0 or fail_every < 0:
            raise ValueError("keep_positions and fail_every must be >= 0")
        self.keep_positions = keep_positions
        self.fail_every = fail_every
        self.calls = 0

    def retain(self, block: BlockView) -> bool:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError(f"deliberate bug on call {self.calls}")
        return block.position < self.keep_positions
