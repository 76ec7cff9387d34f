"""The demo generator's tokenizer (workers/demo_generator.py): the byte tokenizer, which lives in
tgw.shm.byte_tokenizer so the broker can use it without importing the workers."""
from tgw.shm.byte_tokenizer import END, VOCAB, Tokenizer

__all__ = ["END", "VOCAB", "Tokenizer"]
