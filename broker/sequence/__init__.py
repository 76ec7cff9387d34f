"""The sequence wing (docs/SEQUENCES.md): which sequence of a sequence model holds which worker
and state slot, from its start to its end, idle timeout or its worker's death."""
