"""tgw.bench: the benchmark harness.

* `tgw-bench` (cli.py) drives a running broker: closed loop (--concurrency) or open loop
  (--rate, Poisson arrivals), several generator processes, latency percentiles, errors by code,
  the broker's batch-size distribution and peak RSS of every tgw process.
* `python bench/compare.py` runs the side-by-side comparison (in-process floor, transport floor,
  tgw native, Flask+gunicorn baseline) in one invocation and writes bench/RESULTS.md.

Nothing here is imported by the server; torch is only imported in the floor / Flask processes.
"""
