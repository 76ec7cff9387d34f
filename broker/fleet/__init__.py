"""The workers' lives: supervisor, handshake, hangs, leaks, snapshots, GPUs."""
