"""Safe change: shadow versions that compare outputs, and guarded rollouts (docs/ROLLOUT.md)."""
