"""tgw.bench: the benchmark harness, one entry: `tgw-bench` (cli.py).

* `tgw-bench load` drives a running broker (closed or open loop) and reports throughput,
  latency percentiles, errors by code, the broker's batch sizes and every tgw process's RSS/CPU.
* `tgw-bench compare` (alias: `python bench/compare.py`) puts the in-process floor, the transport
  floor, tgw native and Flask+gunicorn side by side and writes bench/RESULTS.md.

One pipeline: cli -> comparison -> measure (loadgen or wrk) -> report; bench/README.md has the
layout and why this package ships in the wheel. The server never imports it; torch is imported
only by the floor's copies, the demo-model builder and the Flask workers.
"""
