"""Admission and batching: queues, cost model, tenants, concurrency, breakers."""
