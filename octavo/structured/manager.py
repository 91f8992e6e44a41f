"""Structured outputs: grammars compiled with xgrammar and cached by their spec, one matcher per
generated sequence, and each step's token bitmask for the rows that sample under a grammar.

Compiling runs on the caller's thread (the server calls `compile` from its worker pool before a
request reaches the engine; `compile_many` spreads a batch over a pool), so the engine thread only
finds cached grammars. Matchers follow each sequence's output tokens rather than being told about
them: before a mask is filled the matcher accepts whatever tokens the sequence gained since, and
a matcher that is ahead (a sequence whose tokens were dropped) is rolled back or rebuilt. So forks
(n > 1), preemption (recompute keeps the output tokens) and finished sequences need no hooks
beyond `forget`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from octavo.sampling.params import StructuredOutputsParams
from octavo.structured.schema import SchemaError, check_json_schema

logger = logging.getLogger("octavo.structured")

MAX_CACHED_GRAMMARS = 256
MAX_ROLLBACK_TOKENS = 16  # a matcher further ahead than this is rebuilt from the output instead
# Whitespace characters allowed between JSON tokens. Unbounded, a small model sampling at
# temperature 1 can emit newlines until max_tokens (vLLM users hit this with xgrammar); 8 keeps
# indented output possible.
MAX_JSON_WHITESPACE = 8


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong with it."""


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:  # a dependency of octavo; only a broken install lacks it
        raise GrammarError("structured outputs need the xgrammar package (pip install xgrammar)") from exc
    return xgrammar


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(slots=True)
class _Matcher:
    matcher: Any
    num_accepted: int = 0
    failed: bool = False  # a token the grammar did not allow was appended: only EOS is allowed now


class StructuredOutputManager:
    """Owns the compiler, the compiled-grammar cache and the per-sequence matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._matchers: dict[str, _Matcher] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._batch: Any = None

    # ---- compiling (any thread) --------------------------------------------------------------

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (cached by its spec). Raises GrammarError naming the
        problem: an invalid schema, a keyword the grammar would not enforce, a bad regex or EBNF."""
        key = params.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        compiler = self._get_compiler()
        any_ws = not params.disable_any_whitespace
        try:
            if params.kind == "json":
                schema = json.loads(params.json)
                check_json_schema(schema)
                grammar = compiler.compile_json_schema(params.json, any_whitespace=any_ws, strict_mode=True,
                                                      max_whitespace_cnt=MAX_JSON_WHITESPACE if any_ws else None)
            elif params.kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws, strict_mode=False,
                                                      max_whitespace_cnt=MAX_JSON_WHITESPACE if any_ws else None)
            elif params.kind == "regex":
                grammar = compiler.compile_regex(params.regex)
            elif params.kind == "choice":
                grammar = compiler.compile_grammar(choice_grammar(params.choice))
            else:
                grammar = compiler.compile_grammar(params.grammar)
        except SchemaError as exc:
            raise GrammarError(f"structured_outputs.json: {exc}") from None
        except Exception as exc:  # xgrammar's parse errors (RuntimeError; UnicodeDecodeError when its
            # message quotes non-UTF-8 bytes of the input): keep the message, drop its source location
            text = str(exc).strip().splitlines()
            message = text[0] if text else type(exc).__name__
            message = message.split(": ", 1)[1] if ".cc:" in message else message
            raise GrammarError(f"structured_outputs.{params.kind}: {message}") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def compile_many(self, params: list[StructuredOutputsParams]) -> None:
        """Compile distinct constraints concurrently (xgrammar releases the GIL); raises the first error."""
        distinct = list({p.key: p for p in params}.values())
        if len(distinct) <= 1:
            for p in distinct:
                self.compile(p)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="octavo-grammar")
        for future in [self._pool.submit(self.compile, p) for p in distinct]:
            future.result()

    # ---- matchers (engine thread) ------------------------------------------------------------

    def _matcher(self, seq_id: str, params: StructuredOutputsParams, output_token_ids: list[int]) -> _Matcher:
        """The sequence's matcher, brought to the end of its output tokens."""
        state = self._matchers.get(seq_id)
        num = len(output_token_ids)
        if state is not None and state.num_accepted > num:
            back = state.num_accepted - num
            if back <= MAX_ROLLBACK_TOKENS and not state.failed:
                state.matcher.rollback(back)
                state.num_accepted = num
            else:
                state = None
        if state is None:
            xgr = _xgr()
            state = _Matcher(xgr.GrammarMatcher(self.compile(params)))
            self._matchers[seq_id] = state
        for token in output_token_ids[state.num_accepted:]:
            if not state.failed and not state.matcher.is_terminated() and not state.matcher.accept_token(token):
                logger.warning("sequence %s: token %d is outside its grammar; only EOS is allowed from here", seq_id, token)
                state.failed = True
        state.num_accepted = num
        return state

    def bitmask(self, rows: list[tuple[str, StructuredOutputsParams, list[int]]]) -> torch.Tensor:
        """[len(rows), ceil(vocab / 32)] int32: bit t of row i set = token t allowed next for the
        sequence rows[i] = (seq_id, its constraint, its output token ids so far)."""
        xgr = _xgr()
        mask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        live, live_rows = [], []
        for i, (seq_id, params, output) in enumerate(rows):
            state = self._matcher(seq_id, params, output)
            if state.failed or state.matcher.is_terminated():
                mask[i] = self._eos_row(mask.shape[1])
            else:
                live.append(state.matcher)
                live_rows.append(i)
        if live:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(live, mask, live_rows)
        return mask

    def _eos_row(self, num_words: int) -> torch.Tensor:
        """A bitmask row allowing only the EOS tokens."""
        words = [0] * num_words
        for t in self.eos_token_ids:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def forget(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            self._matchers.pop(sid, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
