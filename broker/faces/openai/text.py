"""A generation's token ids as text while they stream: each new piece is emitted once it is
final. Held back: a character cut between tokens (it decodes as U+FFFD until its last byte
comes) and a tail that may be the start of a stop string. A stop string ends the text before it,
as OpenAI's `stop` does (the stop string is not returned).

Only the last few tokens are decoded at each step (the window from the last emitted piece's
first token, as vLLM and TGI do), so a long generation costs the same per token as a short one,
and a tokenizer whose decoding depends on the previous token (a leading space) still reads it.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    """One choice's text. `feed(ids)` answers the text now final; `stopped` once a stop string
    appeared (the text ends before it); `finish()` the rest at the generation's end."""
    __slots__ = ("tokenizer", "stops", "tokens", "prefix", "read", "pending", "stopped", "text")

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.prefix = self.read = 0   # tokens[prefix:read] decoded last time; tokens[read:] not yet
        self.pending = ""             # decoded, not yet emitted (a possible stop string's start)
        self.stopped = False
        self.text = ""                # the whole text emitted

    def feed(self, ids) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(ids)
        decode = self.tokenizer.decode
        before = decode(self.tokens[self.prefix:self.read])
        now = decode(self.tokens[self.prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):   # a character still being completed
            return ""
        self.pending += now[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, at the generation's end (a cut character stays U+FFFD)."""
        if self.stopped:
            return ""
        decode = self.tokenizer.decode
        self.pending += decode(self.tokens[self.prefix:])[len(decode(self.tokens[self.prefix:self.read])):]
        self.prefix = self.read = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self.pending
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(pending[:cut], "")
        hold = 0   # the longest tail that begins a stop string waits for the next token
        if not final:
            for s in self.stops:
                for k in range(min(len(s) - 1, len(pending)), hold, -1):
                    if pending.endswith(s[:k]):
                        hold = k
                        break
        return self._emit(pending[:len(pending) - hold], pending[len(pending) - hold:])

    def _emit(self, piece: str, keep: str) -> str:
        self.pending = keep
        self.text += piece
        return piece
