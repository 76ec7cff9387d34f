"""A generation's token ids as text while they stream: each new piece is emitted once it is
final. Held back: a character cut between tokens (it decodes as U+FFFD until its last byte
comes) and a tail that may be the start of a stop string. A stop string ends the text before it,
as OpenAI's `stop` does (the stop string is not returned)."""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    """One choice's text. `feed(ids)` answers the text now final; `stopped` once a stop string
    appeared (the text ends before it); `finish()` the rest at the generation's end."""
    __slots__ = ("tokenizer", "stops", "tokens", "sent", "stopped", "text")

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = 0            # characters of the text emitted so far
        self.stopped = False
        self.text = ""           # the whole text emitted

    def feed(self, ids) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(ids)
        full = self.tokenizer.decode(self.tokens)
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(full, max(cut, self.sent))
        safe = len(full)
        while safe > self.sent and full[safe - 1] == REPLACEMENT:   # a character still being completed
            safe -= 1
        hold = 0   # the longest tail that begins a stop string waits for the next token
        for s in self.stops:
            for k in range(min(len(s) - 1, safe - self.sent), hold, -1):
                if full.endswith(s[:k], 0, safe):
                    hold = k
                    break
        return self._emit(full, safe - hold)

    def finish(self) -> str:
        """The text still held back, at the generation's end (a cut character stays U+FFFD)."""
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.tokens), None)

    def _emit(self, full: str, upto: int | None) -> str:
        piece = full[self.sent:upto]
        self.sent += len(piece)
        self.text += piece
        return piece
