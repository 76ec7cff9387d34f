"""tgw.testing: what the tests and the benchmarks share (directory bench/testing/, mapped in
pyproject.toml). The product (broker, workers, shm, client) never imports it, and it never
imports tgw.bench; the benchmarks' harness and scenarios may import it.

| module | what it holds |
|---|---|
| `child.py` | `Proc` and `BrokerProc`: a broker (or any command) in a child process, stopped by PID |
| `demo.py` | the demo models built at run time, the comparison's tgw config, `demo_broker` |
| `lifecycle.py` | the x + k models, `control`, and the swap, canary, unload and residency runs |
| `rollouts.py` | the scorer models, checked closed-loop callers, a guard's decision |
| `memory.py` | the wide on-demand models, the placement run, the fragmentation run |
| `cancellation.py`, `cancel_stage.py` | callers giving up behind a gated batch; the stage that records what it computed |
| `regions.py` | a minimal native caller that sends through a shared-memory region |
| `generators.py` | small deterministic generators (`Counter`, `ToyLM`), their references and config entries (docs/GENERATION.md) |
| `mar_archives.py` | TorchServe `.mar` archives made by the real `torch-model-archiver`: the built-in text classifier's, a custom Pillow image handler's |
| `slow_first.py` | a model slow on its first call per shape (preloaded by workers as `tgw.testing.slow_first`) |
| `triton_repo.py` | a Triton model repository of stand-in models (`simple`, `simple_string`, image classifiers, an ensemble of Python pre/post-processing and a TorchScript model), written at run time |
"""
