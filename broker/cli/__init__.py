"""`tgw-broker`: the command line - start, check-config, status and the other verbs that ask a
running broker (ask.py), models and rollouts (models.py, rollout.py), the embedded demo's
config (demo.py). It builds nothing of the broker itself: `start` calls core.run."""
