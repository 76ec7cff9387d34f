"""tgw.bench: the benchmarks - a harness and scenarios behind one entry, `tgw-bench NAME` (cli.py).

* `harness/` (tgw.bench.harness): what several scenarios share - load generators, measurement,
  the baselines (floors, Flask + gunicorn), the comparison's servers and ratios, reports, plots.
* `scenarios/` (tgw.bench.scenarios): one module per scenario, each exposing `NAME`, `HELP`,
  `add_arguments(parser)` and `run(args) -> int` (scenarios/__init__.py); cli.py dispatches by name.
* `testing/` is a package of its own, tgw.testing (pyproject.toml maps it): what the tests and the
  benchmarks share (a broker in a child process, the demo models, control calls, test models).

The product never imports tgw.bench or tgw.testing. bench/README.md has the layout and the why,
bench/results/ the committed results, bench/results/RETIRED.md the scenarios retired to them.
"""
