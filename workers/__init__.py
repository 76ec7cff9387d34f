"""tgw.workers: one process per device running batched TorchScript on the shared-memory ring.

The only package that imports torch.
"""
