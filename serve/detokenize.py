"""Text of a growing list of token ids, decoding a few ids per token instead of all of them.

Decoding every generated id again for each new token costs O(n) per token, O(n^2) per
request. Instead, as vLLM does,
keep two offsets: text up to ``read`` is settled; each new token decodes the window
``ids[prefix:]`` and the window without the new ids, ``ids[prefix:read]``, and the
difference is the new text. The window starts a token or more before ``read`` so that
tokenizers whose pieces depend on their neighbour (a SentencePiece word marker that
decodes to a space only after another piece) decode the new ids as they would in the
whole text. While the new text is empty (a skipped special token, which would leave the
next piece without its neighbour) or ends in an incomplete UTF-8 sequence (U+FFFD), nothing
is settled and the window grows until text comes.

For byte-level BPE, SentencePiece (Metaspace) and raw-byte tokenizers the text equals
``tokenizer.decode(ids)``; tests check it token by token against the full decode.
"""

from __future__ import annotations

INCOMPLETE = "\ufffd"


class IncrementalText:
    """``add(token)`` appends one id; ``text`` is the decode of every id so far."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.settled = ""  # the decode of ids[:read]; only appended to (but for the whole-decode fallback)
        self.pending = ""  # the decode of ids[read:], in the window's context; may change
        self._prefix = 0
        self._read = 0

    @property
    def text(self) -> str:
        return self.settled + self.pending

    def add(self, token: int) -> None:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = self.tokenizer.decode(self.ids[self._prefix:])
        if not window.startswith(before):  # never seen with the tokenizers above; stay exact with a whole decode
            self.settled, self._prefix, self._read = "", 0, 0
            before, window = "", self.tokenizer.decode(self.ids)
        new = window[len(before):]
        if new and not new.endswith(INCOMPLETE):  # text that no later id changes: settle it
            self.settled += new
            self.pending = ""
            self._prefix, self._read = self._read, len(self.ids)
        else:
            self.pending = new
