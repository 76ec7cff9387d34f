"""Test tools that run on their own too: the front-door fuzzer and the soak (scripts/fuzz.sh,
scripts/soak.sh). Not benchmarks: they judge correctness under hostile input and long load."""
