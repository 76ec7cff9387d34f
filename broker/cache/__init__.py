"""Response caches: answers the broker gives again without a worker. Imports config/ and state/."""
