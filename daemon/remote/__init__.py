"""The cross-node tier: session checkpoints in Redis (redis-py), leases, roaming between nodes (docs/remote.md)."""
