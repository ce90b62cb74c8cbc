"""The warm tier: one POSIX shared-memory segment, its on-segment format, extents and checksums."""
