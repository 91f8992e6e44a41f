"""Incremental detokenisation with stop-string detection, one instance per generated sequence.

Decoding token by token breaks in two ways: a multi-byte UTF-8 character split over tokens
decodes to U+FFFD until its last byte arrives, and SentencePiece/BPE tokenizers drop or add a
leading space depending on what precedes a token. So each step decodes a short window that
starts a few tokens back (`_prefix_offset`) and emits only the text beyond what that window
produced before the new tokens (`_read_offset`); text ending in U+FFFD is held until complete.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for correct spacing


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
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Add one generated token; returns the new text (possibly ""). Sets `stop_reason` and cuts
        `text` at the stop string when one appears (the stop string is kept only if asked)."""
        if self.stop_reason is not None:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""  # nothing printable yet (incomplete character, or a skipped special token)
        new_text = window[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        old_len = len(self.text)
        self.text += new_text
        if self.stop:
            self._check_stop(old_len)
        return self.text[old_len:]

    def _check_stop(self, old_len: int) -> None:
        for stop in self.stop:
            # a stop string may straddle the previous text and the new text
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.text = self.text[:end]
                self.stop_reason = stop
                return

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: while running, a tail that could still grow into a stop
        string is held back, so a streamed client never sees part of a stop string."""
        if finished or not self.stop:
            return self.text
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return self.text[: len(self.text) - hold] if hold else self.text
