"""Alias kept for scripts and docs: `python bench/compare.py ARGS` = `tgw-bench compare ARGS`
(also `python -m tgw.bench.compare ARGS`)."""
import os
import sys

if __name__ == "__main__":
    if not __package__:
        # run as a script: bench/'s module names (report, measure, ...) must not shadow others;
        # everything comes from the installed tgw.bench (`pip install -e '.[server,bench]'`)
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from tgw.bench.cli import main
    sys.exit(main(prog="python -m tgw.bench.compare" if __package__ else "python bench/compare.py", command="compare"))
