"""What the broker tells: metrics, status, tracing, logs."""
