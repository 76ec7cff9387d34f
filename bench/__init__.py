"""tgw.bench: the benchmark harness, one entry: `tgw-bench` (cli.py). `load` drives a running
broker; `compare` (alias `python bench/compare.py`) measures the floors, tgw and Flask+gunicorn
side by side. The server never imports it; bench/README.md has the layout and the why."""
