"""Reasoning parsers: a reasoning model's thinking (`<think>...</think>` and its family's other
spellings) split from its answer, whole or as a stream, for `reasoning_content` and reasoning
blocks.

Where the answer starts is read from the output and the prompt together: templates of recent
thinking models (DeepSeek-R1 0528, Qwen3 2507 Thinking, GLM 4.5...) end the prompt with the open
tag, so the output starts inside the reasoning and shows only the close tag; older ones let the
model write the open tag itself; with thinking off (Qwen3's `enable_thinking: false`) the template
writes an empty `<think></think>` and the output is all answer. So: the output starts in reasoning
when the prompt ends with the open tag (`starts_in_reasoning`), or when it opens with the tag
itself; otherwise it is all answer. Reasoning cut off by max_tokens stays reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str


FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek_r1", "<think>", "</think>"),
    ReasoningFormat("qwen3", "<think>", "</think>"),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]"),  # Magistral
    ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>"),
)}
ALIASES = {"deepseek_v3": "deepseek_r1", "glm45": "qwen3", "minimax_m2": "deepseek_r1", "ernie45": "deepseek_r1",
           "hunyuan_a13b": "deepseek_r1", "think": "qwen3"}
REASONING_PARSERS = tuple(sorted([*FORMATS, *ALIASES]))


def reasoning_format(name: str) -> ReasoningFormat:
    """The format a --reasoning-parser name selects; ValueError naming the choices."""
    resolved = ALIASES.get(name, name)
    if resolved not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return FORMATS[resolved]


def prompt_opens_reasoning(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open reasoning block (the template wrote the tag)."""
    tail = prompt_text.rstrip()
    return tail.endswith(fmt.start)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Feeds output piece by piece; `feed` returns (reasoning, answer) text to show now. States:
    "before" (the output could still open with the tag), "reasoning", "answer". The answer's
    leading whitespace after the close tag is dropped (templates put blank lines there)."""

    def __init__(self, fmt: ReasoningFormat, starts_in_reasoning: bool = False) -> None:
        self.fmt = fmt
        self.state = "reasoning" if starts_in_reasoning else "before"
        self._buffer = ""
        self._lead: list[str] = []  # whitespace before anything else, while the tag may still come
        self._trim_answer = False  # the close tag was just seen: drop whitespace until the answer starts
        self.has_reasoning = starts_in_reasoning

    @property
    def reasoning_ended(self) -> bool:
        return self.state == "answer"

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning, answer = [], []
        while True:
            buf = self._buffer
            if self.state == "before":
                stripped = buf.lstrip()
                if stripped.startswith(self.fmt.start):
                    self.state, self.has_reasoning = "reasoning", True
                    self._buffer, self._lead = stripped[len(self.fmt.start):], []
                    continue
                if not finished and not stripped:  # whitespace only: set aside, not rescanned
                    self._lead.append(buf)
                    self._buffer = ""
                    break
                if not finished and self.fmt.start.startswith(stripped):
                    break  # could still be the tag
                self.state = "answer"
                self._buffer, self._lead = "".join(self._lead) + buf, []
                continue
            if self.state == "reasoning":
                end = buf.find(self.fmt.end)
                if end != -1:
                    reasoning.append(buf[:end])
                    self._buffer = buf[end + len(self.fmt.end):]
                    self.state, self._trim_answer = "answer", True
                    continue
                keep = 0 if finished else _partial_suffix(buf, self.fmt.end)
                reasoning.append(buf[: len(buf) - keep])
                self._buffer = buf[len(buf) - keep:]
                break
            if self._trim_answer:
                buf = buf.lstrip()
                if not buf and not finished:
                    self._buffer = ""
                    break
                self._trim_answer = False
            answer.append(buf)
            self._buffer = ""
            break
        return "".join(reasoning), "".join(answer)


def split_reasoning(fmt: ReasoningFormat, text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when the output has none, answer) of a whole output."""
    stream = ReasoningStream(fmt, starts_in_reasoning)
    reasoning, answer = stream.feed(text, finished=True)
    return (reasoning if stream.has_reasoning else None), answer
