"""What router/ and replica/ share, below both: the config schema (config.py), the
policies' registry of short names (registry.py), the policy interfaces and views
(policies.py: the common base and the replica's; router_policies.py: the router's), the
queue orders both sides run (queue_orders.py), and the messages of the data path
(snapshot, hints, stream chunks, frames, the block vocabulary). It imports nothing else
of blockserve (tests/test_layering.py)."""
