"""The KV tiers: sessions, hot slots, the shared-memory pool, the spill directory, shared prefixes."""
