"""Alias kept for scripts and docs: `python bench/compare.py ARGS` = `tgw-bench compare ARGS`
(also `python -m tgw.bench.compare ARGS`). See cli.py and comparison.py."""
import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script: drop bench/ from sys.path so its module names (report, wrk, ...) cannot
    # shadow other packages, and import everything through the installed tgw.bench package.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    try:
        import tgw.bench  # noqa: F401
    except ImportError:
        sys.exit("tgw is not installed in this interpreter: run `pip install -e '.[server,bench]'` from "
                 "the repository root first (see bench/README.md)")

if __name__ == "__main__":
    from tgw.bench.cli import main
    sys.exit(main(prog="python bench/compare.py" if not __package__ else "python -m tgw.bench.compare",
                  command="compare"))
