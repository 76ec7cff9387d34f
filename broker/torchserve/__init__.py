"""TorchServe users' side of the broker: the model store of .mar archives, each served as a stage, and TorchServe's inference and management APIs (docs/MIGRATING.md, from TorchServe)."""
