"""The generate wing: the broker's half of generation (docs/GENERATION.md): requests that
answer many times. `admit.py` checks a request's `generate` at admission; `stream.py` is one
sequence as the broker keeps it; `streams.py` the table of live sequences: outputs to their
callers, cancellation, slow readers, a worker's death, and the counters status reads."""
