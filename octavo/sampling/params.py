"""SamplingParams: how one request's tokens are chosen and when it stops; validated, pure Python."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

from octavo.json_limits import loads_bounded

_GREEDY_EPS = 1e-5
# Limits that keep one request's cost bounded (documented in docs/RELIABILITY.md).
MAX_N = 128  # completions per request (the engine also refuses n > max_num_seqs)
MAX_STOP_STRINGS = 16  # OpenAI allows 4
MAX_STOP_STRING_CHARS = 256  # the streamed text is held back by the longest one - 1 characters
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids entries (more than any vocabulary here)
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: -100 (ban) to 100 (force)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as torch generators take


MAX_CHOICES = 256  # structured_outputs.choice entries
MAX_GRAMMAR_CHARS = 64 * 1024  # a JSON schema (serialised), a regex or an EBNF grammar


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names); exactly one of the fields is set.

    json: a JSON schema (dict or JSON text) the output must validate against; json_object: any
    JSON object; regex: the whole output matches it; choice: the output is one of these strings;
    grammar: an EBNF grammar (xgrammar's GBNF dialect). JSON is always written on one line with
    ", " and ": " between items (what vLLM's disable_any_whitespace gives; accepted for its
    clients, it changes nothing here). The schema is stored as JSON text (property order kept: it is the output order), so equal schemas share one
    compiled grammar (see `key`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    # the text that ends a reasoning model's thinking ("</think>"): the constraint applies to the
    # output after its first appearance (the answer), not to the reasoning; None: from the start
    after_text: str | None = None

    def __post_init__(self) -> None:
        if self.after_text is not None and not (isinstance(self.after_text, str) and 0 < len(self.after_text) <= 64):
            raise ValueError("structured_outputs.after_text must be 1 to 64 characters")
        if isinstance(self.json, dict):
            try:
                object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
            except RecursionError:
                raise ValueError("structured_outputs.json is nested too deeply") from None
        elif isinstance(self.json, str):
            try:
                schema = loads_bounded(self.json, "structured_outputs.json")
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema (an object)")
                object.__setattr__(self, "json", json.dumps(schema, ensure_ascii=False))
            except RecursionError:  # JSON text nested ~1,000 deep: no schema is
                raise ValueError("structured_outputs.json is nested too deeply") from None
            except ValueError as exc:
                if "JSON schema" in str(exc) or "nested deeper" in str(exc):
                    raise
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif self.json is not None:
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or JSON text), got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not 1 <= len(self.choice) <= MAX_CHOICES or not all(self.choice):
                raise ValueError(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar or json_object; "
                             f"got {', '.join(kinds) or 'none'}")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{kinds[0]} is longer than {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text (a choice list as JSON)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return json.dumps(list(value), ensure_ascii=False)
        return "" if value is True else value

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by."""
        return self.kind, self.spec


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries: everything so far (CUMULATIVE, O(length) per
    step), only what is new since the previous output (DELTA, what a stream needs), or nothing
    until the request has finished (FINAL_ONLY)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request (vLLM's pooling runner): the prompt's final hidden states (after the
    model's last norm) pooled into one vector, instead of generated tokens. `pooling_type`: the
    last token's state ("last", what decoder models' embedding variants use), the mean over every
    prompt token ("mean"; every position is computed: no prefix-cache hits) or the first token's
    ("cls"; likewise). `normalize`: scaled to unit length. `dimensions`: the first d of them
    (Matryoshka), renormalised when normalized."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position's state is read (then no prefix-cache hit may skip one)."""
        return self.pooling_type != "last"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ValueError naming the field and the range.

    temperature 0 is greedy. top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs.
    `seed` makes the request's random choices reproducible whatever else is in the batch.
    `logprobs=k` returns the sampled token's logprob and the k most likely tokens at each step.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted
    prompt_logprobs: int | None = None  # logprob of each prompt token and its k most likely alternatives
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    pooling: PoolingParams | None = None  # an embedding request: pooled prompt states, no tokens
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only among these tokens
    # vLLM's: with logprobs, these tokens' logprobs (and the sampled one's) instead of the top k
    logprob_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the tuple fields; store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logprob_token_ids is not None:
            object.__setattr__(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        bias = self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple(sorted((bias.items() if isinstance(bias, dict) else bias))))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "must be a finite number")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"must be an integer in [1, {MAX_N}]")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an integer: -1 or 0 to disable, or >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", self.seed, f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64) or None")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers (token ids of the vocabulary)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for token, value in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", token, "keys must be token ids (integers >= 0)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_LOGIT_BIAS_VALUE <= value <= MAX_LOGIT_BIAS_VALUE:
                raise bad("logit_bias", value, f"values must be numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (integers >= 0)")
        if self.logprob_token_ids is not None and (
                not 1 <= len(self.logprob_token_ids) <= MAX_LOGIT_BIAS
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logprob_token_ids)):
            raise ValueError(f"logprob_token_ids must be 1 to {MAX_LOGIT_BIAS} token ids (integers >= 0)")
        if self.logprob_token_ids is not None and self.logprobs is None:
            raise ValueError("logprob_token_ids needs logprobs")
        if self.pooling is not None and (self.n != 1 or self.logprobs is not None or self.prompt_logprobs is not None
                                         or self.structured_outputs is not None):
            raise ValueError("an embedding request (pooling) takes n 1 and no logprobs, prompt_logprobs or structured outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "must be a RequestOutputKind")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam hands the search its 2 x beam_width best next tokens


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Beam search settings (vLLM's names). The best `beam_width` hypotheses are returned, scored
    by cumulative logprob / generated_length ** length_penalty as transformers scores them.

    early_stopping (transformers' meaning): True stops once beam_width hypotheses are finished;
    False stops when the best running beam, at its current length, cannot beat the worst finished
    one; "never" only when no running beam could at any length up to max_tokens.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")

    @property
    def n(self) -> int:
        """Completions returned per prompt (the beams), as SamplingParams.n counts them."""
        return self.beam_width

    @property
    def logprobs(self) -> None:
        """Per-token logprobs are not returned for beams (their cumulative logprob is)."""
        return None

    def sequence_params(self) -> SamplingParams:
        """What each beam's sequence is run with: its 2 x beam_width most likely next tokens with
        their logprobs (the search decides stops itself, so EOS never ends a beam by itself)."""
        return SamplingParams(
            temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, logprobs=2 * self.beam_width,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
