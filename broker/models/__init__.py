"""The models served: registry (entry, checks), routing, placement, residency, rollout, reload, operator."""
