"""The byte tokenizer: text <-> one token id per UTF-8 byte, no vocabulary file and no torch, so
the broker (the OpenAI face's `tokenizer: bytes`), a client and the demo generator
(workers/demo_generator.py, which re-exports it as workers/demo_tokenizer.py) share it.

Token ids are the bytes of the UTF-8 text (1..255); id 0 (a NUL byte, never in text) is the end
token the model learns to emit after a sentence (the config's `generator.end_tokens: [0]`).
"""
from __future__ import annotations

from typing import Iterable

END = 0          # the end token: never emitted by tgw (a stop token), never in a prompt
VOCAB = 256      # one id per byte value


class Tokenizer:
    """Text <-> token ids, one id per UTF-8 byte; `end` is the end token's id."""
    vocab = VOCAB
    end = END

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        if b"\0" in data:
            raise ValueError("a prompt may not contain NUL (U+0000): its byte is the end token")
        return list(data)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (the end token dropped); a sequence cut inside a multi-byte character
        decodes that character as U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < VOCAB:
                raise ValueError(f"token id {i} is not a byte (0..{VOCAB - 1})")
            if i != END:
                out.append(i)
        return out.decode("utf-8", errors="replace")
