"""Records every wing shares: requests, versions, workers, counters. Imports no wing."""
