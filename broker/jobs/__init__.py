"""The jobs wing: polled jobs, answered at once with an id and read later (docs/JOBS.md)."""
