"""What operators see: status, counters, latency statistics, Prometheus exposition, logs."""
