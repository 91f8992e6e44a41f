"""Structured outputs: grammars compiled with xgrammar and cached by their spec, one matcher per
generated sequence, and each step's token bitmask for the rows that sample under a grammar.

Compiling runs on the caller's thread (`compile`; `compile_many` spreads a batch over a pool), or,
for the server, in a child process with a deadline (`structured/isolated.py`) whose result is
`insert`ed here, so the engine thread only finds cached grammars. The cache is bounded in bytes
(`max_bytes`, the compiled grammars' own sizes); a grammar a request still needs is held
(`hold` / `release`) and never evicted, so the engine never recompiles one mid-request.
Matchers follow each sequence's output tokens rather than being told about them: before a mask
is filled the matcher accepts whatever tokens the sequence gained since, and a matcher that is
ahead (a sequence whose tokens were dropped) is rolled back or rebuilt. So forks (n > 1),
preemption (recompute keeps the output tokens) and finished sequences need no hooks beyond
`forget`.
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

from octavo.outputs import ScheduledRequest
from octavo.request import Request
from octavo.sampling.params import StructuredOutputsParams
from octavo.structured.schema import SchemaError, check_json_schema
from octavo.tokenizer import hf_tokenizer

logger = logging.getLogger("octavo.structured")

MAX_ROLLBACK_TOKENS = 16  # a matcher further ahead than this is rebuilt from the output instead


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong with it."""


class GrammarCacheFull(RuntimeError):
    """The grammars held by requests in flight fill the cache; a new one must wait (HTTP 429)."""


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:  # a dependency of octavo; only a broken install lacks it
        raise GrammarError("structured outputs need the xgrammar package (pip install xgrammar)") from exc
    return xgrammar


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler: Any, params: StructuredOutputsParams) -> Any:
    """`params` compiled by an xgrammar GrammarCompiler. Raises GrammarError naming the problem: an
    invalid schema, a keyword the grammar would not enforce, a bad regex or EBNF. JSON is written
    on one line with ", " and ": " (xgrammar's any_whitespace=False): with whitespace allowed
    between tokens a small model pads its output with newlines (issue 20)."""
    try:
        if params.kind == "json":
            check_json_schema(json.loads(params.json))
            compiled = compiler.compile_json_schema(params.json, any_whitespace=False, strict_mode=True)
        elif params.kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        elif params.kind == "regex":
            compiled = compiler.compile_regex(params.regex)
        elif params.kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(params.choice))
        else:
            compiled = compiler.compile_grammar(params.grammar)
    except SchemaError as exc:
        raise GrammarError(f"structured_outputs.json: {exc}") from None
    except RecursionError:
        raise GrammarError(f"structured_outputs.{params.kind}: nested too deeply") from None
    except Exception as exc:  # xgrammar's parse errors (RuntimeError; UnicodeDecodeError when its
        # message quotes non-UTF-8 bytes of the input): keep the message, drop its source location
        text = str(exc).strip().splitlines()
        message = text[0] if text else type(exc).__name__
        message = message.split(": ", 1)[1] if ".cc:" in message else message
        raise GrammarError(f"structured_outputs.{params.kind}: {message}") from None
    if not _allows_a_first_token(compiled):
        raise GrammarError(f"structured_outputs.{params.kind}: no output satisfies this constraint (not even an "
                           "empty one): no token of the vocabulary can start it")
    return compiled


def _allows_a_first_token(compiled: Any) -> bool:
    """Whether a fresh matcher of `compiled` allows some token (EOS included, where the empty
    output is in its language): a regex or grammar whose language is empty, or needs what no
    token spells, allows none. Dead ends later in an output cannot be seen this cheaply."""
    xgr = _xgr()
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return bool((mask != 0).any()) or matcher.is_terminated()


@dataclass(slots=True)
class _Matcher:
    matcher: Any
    num_accepted: int = 0
    failed: bool = False  # a token the grammar did not allow was appended: only EOS is allowed now


@dataclass(slots=True)
class _Cached:
    grammar: Any
    num_bytes: int
    num_holds: int = 0


class StructuredOutputManager:
    """Owns the compiler, the compiled-grammar cache and the per-sequence matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_bytes: int = 256 << 20) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._held_bytes = 0  # of grammars some request holds (kept here: summing the cache is O(cache))
        self._lock = threading.Lock()
        self._info: Any = None
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, _Cached] = OrderedDict()  # least recently used first
        self._holders: dict[str, tuple] = {}  # holder (a request id) -> the key it holds
        self._matchers: dict[str, _Matcher] = {}
        # constraints that start after a reasoning model's closing tag: per sequence, how many of its
        # tokens were scanned and the text's tail (no tag yet), or where the answer starts
        self._scanned: dict[str, tuple[int, str]] = {}
        self._answer_starts: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._batch: Any = None

    # ---- compiling and the cache (any thread) ------------------------------------------------

    def tokenizer_info(self) -> Any:
        """xgrammar's view of the vocabulary (~150 ms to build, once)."""
        with self._lock:
            if self._info is None:
                self._info = _xgr().TokenizerInfo.from_huggingface(
                    hf_tokenizer(self.tokenizer), vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None)
            return self._info

    def _get_compiler(self) -> Any:
        info = self.tokenizer_info()
        with self._lock:
            if self._compiler is None:  # its own cache off: this class bounds what is kept
                self._compiler = _xgr().GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def lookup(self, params: StructuredOutputsParams) -> Any | None:
        """The cached grammar of `params`, or None."""
        with self._lock:
            entry = self._cache.get(params.key)
            if entry is None:
                return None
            self._cache.move_to_end(params.key)
            return entry.grammar

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params`, from the cache or compiled here on the caller's thread
        (no time limit: the server compiles in `isolated.py` first). Raises GrammarError."""
        grammar = self.lookup(params)
        if grammar is None:
            grammar = compile_spec(self._get_compiler(), params)
            self.insert(params, grammar)
        return grammar

    def insert(self, params: StructuredOutputsParams, grammar: Any, holder: str | None = None) -> None:
        """Cache a grammar compiled elsewhere, held by `holder` if given (then GrammarCacheFull if
        the grammars held already fill the cache), evicting the least recently used unheld ones
        to stay within `max_bytes`."""
        with self._lock:
            entry = self._cache.get(params.key)
            if entry is None:
                size = int(grammar.memory_size_bytes)
                if holder is not None and self._held_bytes + size > self.max_bytes:
                    raise GrammarCacheFull(
                        f"the compiled grammars of requests in flight fill the grammar cache ({self.max_bytes >> 20} MiB); "
                        "retry when some have finished")
                entry = self._cache[params.key] = _Cached(grammar, size)
                self.num_bytes += size
            self._cache.move_to_end(params.key)
            if holder is not None:
                self._hold(holder, params.key, entry)
            self._evict()

    def hold(self, holder: str, params: StructuredOutputsParams) -> None:
        """Keep `params`' grammar cached until `release(holder)` (compiling it if needed)."""
        grammar = self.compile(params)
        with self._lock:
            entry = self._cache.get(params.key)
            if entry is None:  # evicted between compile and here: put it back
                entry = self._cache[params.key] = _Cached(grammar, int(grammar.memory_size_bytes))
                self.num_bytes += entry.num_bytes
            self._hold(holder, params.key, entry)

    def release(self, holder: str) -> None:
        """Drop `holder`'s hold (no-op if it holds nothing); the grammar stays cached while there is room."""
        with self._lock:
            key = self._holders.pop(holder, None)
            entry = None if key is None else self._cache.get(key)
            if entry is not None:
                entry.num_holds -= 1
                if entry.num_holds == 0:
                    self._held_bytes -= entry.num_bytes
            self._evict()

    def _hold(self, holder: str, key: tuple, entry: _Cached) -> None:
        if holder in self._holders:
            raise ValueError(f"{holder!r} already holds a grammar")
        self._holders[holder] = key
        if entry.num_holds == 0:
            self._held_bytes += entry.num_bytes
        entry.num_holds += 1

    def _evict(self) -> None:
        """Under the lock: drop unheld grammars, least recently used first, while over max_bytes
        (O(1) when under it: this runs at every insert and release)."""
        if self.num_bytes <= self.max_bytes:
            return
        for key in [k for k, e in self._cache.items() if e.num_holds == 0]:
            if self.num_bytes <= self.max_bytes:
                return
            self.num_bytes -= self._cache.pop(key).num_bytes

    def stats(self) -> dict[str, int]:
        """Cache counts: grammars kept, their bytes, the bound, how many are held by requests."""
        with self._lock:
            return {"num_cached": len(self._cache), "num_bytes": self.num_bytes, "max_bytes": self.max_bytes,
                    "num_held": sum(1 for e in self._cache.values() if e.num_holds > 0), "num_holders": len(self._holders)}

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

    def constrained_part(self, seq_id: str, params: StructuredOutputsParams, output_token_ids: list[int]) -> list[int] | None:
        """The output tokens the constraint applies to: all of them, or with `after_text` those
        after its first appearance; None while it has not appeared (the reasoning is free). Scans
        each token once (its text decoded alone: the tag is ASCII)."""
        if params.after_text is None:
            return output_token_ids
        start = self._answer_starts.get(seq_id)
        if start is not None and start <= len(output_token_ids):
            return output_token_ids[start:]
        num, tail = self._scanned.get(seq_id, (0, ""))
        if num > len(output_token_ids):  # rolled back (speculative decoding): scan again
            num, tail = 0, ""
        tag = params.after_text
        for i in range(num, len(output_token_ids)):
            tail = (tail + self.tokenizer.decode([output_token_ids[i]]))[-(len(tag) + 32):]
            if tag in tail:
                self._answer_starts[seq_id] = i + 1
                self._scanned.pop(seq_id, None)
                return output_token_ids[i + 1:]
        self._scanned[seq_id] = (len(output_token_ids), tail)
        return None

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

    def draft_prefix(self, seq_id: str, params: StructuredOutputsParams, output_token_ids: list[int],
                     drafts: list[int]) -> list[int]:
        """Speculative decoding: the longest prefix of `drafts` the sequence's grammar accepts
        after its output so far (drafts it would reject are cut before they are verified). The
        matcher is rolled back to the output afterwards."""
        answer = self.constrained_part(seq_id, params, output_token_ids)
        if answer is None:
            return []  # reasoning: no drafts until the constrained answer starts (the tag could be in them)
        state = self._matcher(seq_id, params, answer)
        if state.failed:
            return []
        num = 0
        while num < len(drafts) and not state.matcher.is_terminated() and state.matcher.accept_token(drafts[num]):
            num += 1
        if num:
            state.matcher.rollback(num)
        return drafts[:num]

    def bitmask(self, rows: list[tuple[str, StructuredOutputsParams, list[int]]],
                drafts: dict[str, list[int]] | None = None) -> torch.Tensor:
        """[len(rows), ceil(vocab / 32)] int32: bit t of row i set = token t allowed next for the
        sequence rows[i] = (seq_id, its constraint, its output token ids so far). A sequence with
        k drafts (`drafts`, speculative decoding; accepted by its grammar: `draft_prefix`) has
        k + 1 consecutive rows, the j-th for its output followed by its first j drafts."""
        xgr = _xgr()
        mask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        live, live_rows = [], []
        for i, (seq_id, params, output) in enumerate(rows):
            ahead = drafts.get(seq_id) if drafts else None
            if ahead is not None and i and rows[i - 1][0] == seq_id:
                continue  # filled with the sequence's first row
            answer = self.constrained_part(seq_id, params, output)
            if answer is None:  # still reasoning: every token allowed
                for j in range(len(ahead or ()) + 1):
                    mask[i + j] = -1
                continue
            state = self._matcher(seq_id, params, answer)
            if state.failed or state.matcher.is_terminated():
                mask[i] = self._eos_row(mask.shape[1])
                for j in range(1, len(ahead or ()) + 1):
                    mask[i + j] = mask[i]
            elif ahead:
                self._fill_ahead(state, ahead, mask, i)
            else:
                live.append(state.matcher)
                live_rows.append(i)
        if live:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(live, mask, live_rows)
        return mask

    def _fill_ahead(self, state: _Matcher, drafts: list[int], mask: torch.Tensor, first: int) -> None:
        """Rows first .. first + len(drafts): the allowed tokens after each prefix of the drafts
        (only EOS after one the grammar refuses); the matcher ends where it started."""
        num = 0
        for j in range(len(drafts) + 1):
            if state.matcher.is_terminated() or (j and num < j):
                mask[first + j] = self._eos_row(mask.shape[1])
                continue
            state.matcher.fill_next_token_bitmask(mask, first + j)
            if j < len(drafts) and state.matcher.accept_token(drafts[j]):
                num += 1
        if num:
            state.matcher.rollback(num)

    def _eos_row(self, num_words: int) -> torch.Tensor:
        """A bitmask row allowing only the EOS tokens."""
        words = [0] * num_words
        for t in self.eos_token_ids:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def step_bitmask(self, scheduled: list[ScheduledRequest]) -> tuple[list[str], torch.Tensor] | None:
        """The token bitmask of every sequence that samples in a step under a structured-output
        grammar (an n > 1 request's new sequences start from the prompt, with no output yet), as
        (sequence id per row, bitmask); a sequence verifying k drafts has k + 1 rows, one per
        position. None when no sequence of the step has a grammar."""
        rows = [
            (sample.seq_id, e.sampling_params.structured_outputs, sample.output_token_ids)
            for e in scheduled if e.sampling_params.structured_outputs is not None
            for sample in e.samples for _ in range(len(sample.draft_token_ids) + 1)
        ]
        if not rows:
            return None
        drafts = {sample.seq_id: sample.draft_token_ids for e in scheduled
                  if e.sampling_params.structured_outputs is not None for sample in e.samples if sample.draft_token_ids}
        return [sid for sid, _, _ in rows], self.bitmask(rows, drafts)

    def request_draft_prefix(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts a request may verify: all of them, or under a structured-output grammar the
        prefix its grammar accepts (speculative decoding's grammar filter)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return drafts
        return self.draft_prefix(request.request_id, params, request.output_token_ids, drafts)

    def forget(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            self._matchers.pop(sid, None)
            self._scanned.pop(sid, None)
            self._answer_starts.pop(sid, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
