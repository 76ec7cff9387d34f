"""The broker's core: one assembly (assembly.py) builds every part once, in dependency order;
the Broker (broker.py) holds them; serving.py is the serving core (queues to workers, deaths),
worker_messages.py what workers send, phase.py where the broker is in its life, lifecycle.py
the process over time, run.py the entry function."""
