"""The worker side of generation (docs/GENERATION.md): a generator's runner (its class, its slot
pool, its warm-up), the sampling of outputs from logits, the ends of a sequence, and the step loop
that the serving loop runs between its other batches."""
