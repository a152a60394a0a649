"""An eviction policy on `BlockView.position` and `.tenants` (docs/block-policies.md,
step 6): keep the first blocks of prefixes that several tenants share."""

from blockserve.protocol.policies import BlockView, EvictionPolicy


class KeepSharedHeads(EvictionPolicy):
    """Spare the first `head_blocks` blocks of a prefix that `min_tenants` or more tenants
    hit, once per hit, so that protection runs out when the hits stop.

    A system prompt or a document shared across tenants is worth more than one tenant's
    private prefix, and its head is what every later request hits first.
    """

    def __init__(self, head_blocks: int = 4, min_tenants: int = 2):
        if head_blocks < 1 or min_tenants < 1:
            raise ValueError("head_blocks and min_tenants must be >= 1")
        self.head_blocks = head_blocks
        self.min_tenants = min_tenants

    def may_evict(self, block: BlockView, now: float) -> bool:
        shared_head = (block.position < self.head_blocks
                       and len(block.tenants) >= self.min_tenants)
        return not shared_head or block.spared >= block.hits
