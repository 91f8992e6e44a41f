"""The Hugging Face transformers side of the oracle: greedy tokens and the top-2 logit gap per step,
kept on disk between runs (`cached`): transformers' output on the same file, prompts and versions
is the same every run, and computing it was the suite's largest cost."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Near-ties: where the reference's two best logits are closer than this, float32 summation order
# alone can flip the argmax, so a divergence starting there is accepted (and reported).
TIE_TOLERANCE = 1e-4

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "out of habit. There were one hundred and twelve of them, worn smooth in the middle by a "
    "century of boots. At the top he trimmed the wick, polished the great lens, and watched the "
    "fishing boats turn for home. In the village below, the baker was pulling the last loaves "
    "from the oven while her son practised the violin badly but with enthusiasm. "
    "Photosynthesis converts light energy into chemical energy stored in glucose. Plants absorb "
    "carbon dioxide through small pores called stomata and release oxygen as a by-product. The "
    "process happens mainly in the chloroplasts, where chlorophyll captures red and blue light. "
    "To compute the greatest common divisor of two integers, Euclid's algorithm repeatedly "
    "replaces the larger number by its remainder when divided by the smaller one, stopping when "
    "the remainder is zero. The last non-zero remainder is the answer. "
    "Markets opened higher on Tuesday after the central bank left interest rates unchanged, "
    "although analysts warned that inflation in services remained stubborn. Shares in "
    "shipping companies rose sharply as freight prices recovered. "
    "The recipe calls for two cups of flour, a pinch of salt, three eggs, and enough milk to make "
    "a smooth batter. Let it rest for thirty minutes before cooking the pancakes in a hot pan "
    "with a little butter, turning each one when bubbles appear on the surface. "
    "In 1869 the first transcontinental railroad in the United States was completed when a "
    "golden spike was driven at Promontory Summit in Utah, joining the Central Pacific and Union "
    "Pacific lines and cutting the journey across the continent from months to about a week. "
    "A good night's sleep improves memory, mood and concentration; adults generally need between "
    "seven and nine hours, and keeping a regular schedule helps the body's internal clock. "
    "The committee will meet again next month to review the proposal, consider the feedback "
    "from residents, and decide whether the new library should be built beside the river or "
    "in the old market square, which would require moving the Saturday farmers' market. "
    "Volcanoes form where magma from deep inside the Earth reaches the surface. Some erupt "
    "explosively, throwing ash high into the atmosphere, while others release slow rivers of "
    "lava that can flow for many kilometres before cooling into black rock. "
    "She opened the old letter carefully, recognising her grandmother's handwriting at once, "
    "and began to read about a summer long ago spent on a farm by the sea. "
    "Good software tests fail when the behaviour they describe breaks, run quickly, and explain "
    "what went wrong in words a tired engineer can understand at three in the morning. "
    "The expedition left base camp before sunrise, roped together in teams of three, and reached "
    "the glacier by mid-morning, where the guide tested each snow bridge with a long pole before "
    "letting anyone cross. By afternoon the wind had picked up, and they pitched the tents in the "
    "shelter of a rock wall, melting snow for tea while the light faded over the peaks. "
    "Honeybees communicate the direction and distance of flowers through a waggle dance: the "
    "angle of the run relative to vertical gives the direction relative to the sun, and its "
    "duration tells the other workers how far they must fly. "
    "When the orchestra finally took the stage, the hall fell silent; the conductor raised his "
    "baton, paused for a heartbeat, and the first quiet notes of the cellos filled the room. "
    "Compound interest means that interest is earned on previously earned interest, so a sum "
    "invested at five percent a year roughly doubles in about fourteen years, a rule of thumb "
    "often called the rule of seventy-two when expressed with other rates. "
    "The museum's new wing displays tools, pottery and jewellery found during the excavation of "
    "a Bronze Age settlement, together with a reconstruction of a roundhouse built with the same "
    "materials and techniques its inhabitants would have used three thousand years ago."
)

PROMPT_LENGTHS = (5, 17, 40, 77, 150, 263, 411, 600)
NUM_NEW_TOKENS = 64


def text_token_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= max(PROMPT_LENGTHS), f"oracle text too short: {len(ids)} tokens"
    return ids


def oracle_prompts(tokenizer) -> list[list[int]]:
    """8 prompts from 5 to 600 tokens, each starting at a different point of the text."""
    ids = text_token_ids(tokenizer)
    out = []
    for i, n in enumerate(PROMPT_LENGTHS):
        start = (i * 37) % (len(ids) - n + 1)
        out.append(ids[start : start + n])
    return out


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    """8 prompts sharing a 300-token prefix (two groups of four share 40 more), different tails."""
    ids = text_token_ids(tokenizer)
    prefix = ids[:300]
    out = []
    for i in range(8):
        group_extra = ids[300:340] if i < 4 else ids[340:380]
        tail_start = 400 + 23 * i
        out.append(prefix + group_extra + ids[tail_start : tail_start + 5 + 7 * i])
    return out


@dataclass
class Reference:
    tokens: list[int]
    top2_gaps: list[float]  # at each generated position: best logit minus second best


def hf_greedy(model, prompts: list[list[int]], num_new: int = NUM_NEW_TOKENS) -> list[Reference]:
    """transformers' greedy continuation of each prompt (one at a time: no padding), as Octavo's with
    ignore_eos: no end-of-sequence id at all, so none stops it and none is suppressed
    (`min_new_tokens` would forbid the eos id: a model whose best next token is it would be
    continued with its second best, the raw logits' top-2 gap saying otherwise)."""
    import copy

    generation = copy.deepcopy(model.generation_config)
    generation.eos_token_id = []  # (None: generate() falls back to the model config's)
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # the mask given: without one, generate() masks every prompt token equal to pad_token_id
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=generation, max_new_tokens=num_new,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            gaps = []
            for step_logits in out.logits:
                top2 = torch.topk(step_logits[0].float(), 2).values
                gaps.append(float(top2[0] - top2[1]))
            refs.append(Reference(tokens, gaps))
    return refs


def compare(got: list[int], ref: Reference) -> tuple[bool, str]:
    """(ok, note). Identical is ok; a divergence is ok only if it starts at a near-tie."""
    if got == ref.tokens:
        return True, ""
    first = next((i for i, (a, b) in enumerate(zip(got, ref.tokens)) if a != b), min(len(got), len(ref.tokens)))
    if first < len(ref.top2_gaps) and ref.top2_gaps[first] < TIE_TOLERANCE and len(got) == len(ref.tokens):
        return True, f"accepted divergence at position {first}: reference top-2 gap {ref.top2_gaps[first]:.2e} < {TIE_TOLERANCE}"
    gap = ref.top2_gaps[first] if first < len(ref.top2_gaps) else float("nan")
    return False, (
        f"diverged at position {first} (reference top-2 gap {gap:.3e}): "
        f"got {got[max(0, first - 2) : first + 3]} expected {ref.tokens[max(0, first - 2) : first + 3]}"
    )


# ---- references kept between runs ------------------------------------------------------------

_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def reference_threads() -> int:
    """The torch threads references are computed with: the suite's OMP_NUM_THREADS, fixed for the
    process. (torch's current count moves: an engine's thread governor lowers it while other
    processes keep the cores busy, and a reference keyed by it was computed again on a busy run.)"""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


def environment() -> dict[str, Any]:
    """What else a reference depends on: the libraries that compute it, the threads and the CPU
    (float32 sums are ordered by the kernels each ISA and thread count picks), this file."""
    from importlib import metadata

    import numpy
    import transformers

    from octavo.cpu_features import cpu_flags_line

    return {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": metadata.version("gguf"),
            "numpy": numpy.__version__, "threads": reference_threads(),
            "cpu": hashlib.sha256(cpu_flags_line().encode()).hexdigest()[:16], "reference_py": _SOURCE_DIGEST}


def model_key(gguf_path: Path) -> str:
    """The GGUF's content key (octavo.models.gguf_file): a changed file is another model."""
    from octavo.models.gguf_file import read_header

    return read_header(gguf_path).content_key()


def cached(kind: str, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
    """compute() (JSON-able), or what it returned in an earlier run with the same `key` and
    environment(): kept under the cache directory's test-references/ (OCTAVO_RECOMPUTE_REFERENCES=1
    recomputes). Written whole or not at all."""
    from octavo.cache import cache_dir

    digest = hashlib.sha256(json.dumps({"kind": kind, **key, **environment()}, sort_keys=True).encode()).hexdigest()
    path = cache_dir() / "test-references" / f"{kind}-{digest[:32]}.json"
    if path.is_file() and os.environ.get("OCTAVO_RECOMPUTE_REFERENCES") != "1":
        return json.loads(path.read_text())
    before = torch.get_num_threads()
    torch.set_num_threads(reference_threads())
    try:
        value = compute()
    finally:
        torch.set_num_threads(before)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)
    return value


def cached_greedy(load_model: Callable[[], Any], gguf_path: Path, prompts: list[list[int]],
                  num_new: int = NUM_NEW_TOKENS) -> list[Reference]:
    """hf_greedy on the model `load_model()` returns (called only when the references are not kept
    from an earlier run), keyed by the GGUF's content, the prompts and num_new."""
    key = {"model": model_key(gguf_path), "prompts": prompts, "num_new": num_new}
    raw = cached("greedy", key, lambda: [asdict(r) for r in hf_greedy(load_model(), prompts, num_new)])
    return [Reference(**r) for r in raw]
