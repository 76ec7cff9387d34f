"""tgw.broker: the uvloop broker, supervisor and config. Never imports torch."""
