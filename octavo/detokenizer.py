"""Incremental detokenisation with stop-string detection, one instance per generated sequence.

Decoding token by token breaks in two ways: a multi-byte UTF-8 character split over tokens
decodes to U+FFFD until its last byte arrives, and SentencePiece/BPE tokenizers drop or add a
leading space depending on what precedes a token. So each step decodes a short window that
starts a few tokens back (`_prefix_offset`) and emits only the text beyond what that window
produced before the new tokens (`_read_offset`); text ending in U+FFFD is held until complete
(at most `_MAX_HELD_TOKENS` tokens, so a model that emits invalid UTF-8 cannot grow the window).

Stop strings. The last `max(len(stop)) - 1` characters are held back ("pending"): they could be
the start of a stop string that the next token completes. Everything before them is committed and
can be shown. Each token costs O(len(new text) + max stop length) for every stop string, never
O(text so far), and `take_delta` hands out only what is new.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for correct spacing
_MAX_HELD_TOKENS = 8  # tokens that may decode to an incomplete character before it is emitted as is


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._max_hold = max((len(s) for s in stop), default=1) - 1
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._committed: list[str] = []  # text that can no longer be cut by a stop string
        self._num_taken = 0  # pieces of _committed already handed out by take_delta
        self._pending = ""  # the held-back tail
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text so far (held-back tail included); O(length): for final or cumulative outputs."""
        return "".join(self._committed) + self._pending

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Add one generated token; returns the text it added (possibly ""). Sets `stop_reason` and
        cuts the text at the stop string when one appears (the stop string is kept only if asked)."""
        if self.stop_reason is not None:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        num_held = len(self._ids) - self._read_offset
        if len(window) <= len(before):
            # Nothing printable (skipped special tokens): move on, keeping a short spacing context.
            self._read_offset = len(self._ids)
            if self._read_offset - self._prefix_offset > 2 * _CONTEXT_TOKENS:
                self._prefix_offset = self._read_offset - _CONTEXT_TOKENS
            return ""
        if window.endswith("\ufffd") and num_held < _MAX_HELD_TOKENS:
            return ""  # an incomplete character: wait for its last byte
        new_text = window[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(new_text)

    def _append(self, new_text: str) -> str:
        if not self.stop:
            self._committed.append(new_text)
            return new_text
        searched = self._pending + new_text  # a stop string may straddle the held tail and new text
        found = [(idx, stop) for stop in self.stop if (idx := searched.find(stop)) != -1]
        if found:
            idx, stop = min(found)
            end = idx + len(stop) if self.include_stop else idx
            added = searched[:end][len(self._pending) :] if end > len(self._pending) else ""
            self._committed.append(searched[:end])
            self._pending = ""
            self.stop_reason = stop
            return added
        cut = max(0, len(searched) - self._max_hold)
        self._committed.append(searched[:cut])
        self._pending = searched[cut:]
        return new_text

    def _flush_held(self) -> None:
        """At the end: tokens held for an incomplete character (cut by max_tokens mid-character)
        are decoded as they are (U+FFFD for the missing bytes), as decoding all the tokens gives."""
        if self.stop_reason is None and self._read_offset < len(self._ids):
            before = self._decode(self._ids[self._prefix_offset : self._read_offset])
            window = self._decode(self._ids[self._prefix_offset :])
            self._prefix_offset = self._read_offset = len(self._ids)
            if len(window) > len(before):
                self._append(window[len(before) :])

    def visible_text(self, finished: bool) -> str:
        """All text safe to show now: while running, the held-back tail is not."""
        if finished:
            self._flush_held()
        return self.text if finished else "".join(self._committed)

    def take_delta(self, finished: bool) -> str:
        """Text safe to show that was not handed out before; on finish, the held tail too."""
        if finished:
            self._flush_held()
        if finished and self._pending:
            self._committed.append(self._pending)
            self._pending = ""
        new = self._committed[self._num_taken :]
        self._num_taken = len(self._committed)
        return "".join(new)
