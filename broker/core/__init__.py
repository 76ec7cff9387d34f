"""The broker's core: one assembly (assembly.py) builds every part once, in dependency order;
the Broker (broker.py) holds them; serving.py is the serving core (queues to workers, what
workers send, deaths), phase.py where the broker is in its life, lifecycle.py the process over
time, run.py the entry function."""
