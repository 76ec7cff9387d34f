"""The models served: registry, routing, placement, residency, rollout, reload, operator."""
