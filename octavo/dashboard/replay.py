"""The dashboard without a model: snapshots recorded from `octavo simulate`'s runs (the real
scheduler and block manager under a step-cost model), written into one self-contained HTML file
that plays them on the live page's code (`octavo simulate --dashboard FILE.html`)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from octavo.dashboard.snapshot import build_snapshot
from octavo.outputs import StepLog, StepRecord

MAX_FRAMES = 150  # per policy: a file of a few MB, opened by any browser
REPLAY_REQUESTS = 24  # requests a frame lists
REPLAY_STEPS = 80  # steps a frame's timeline shows


class ReplayRecorder:
    """`simulate(..., on_step=recorder)`: a snapshot after every step (thinned to MAX_FRAMES)."""

    def __init__(self) -> None:
        self.steps = StepLog(maxlen=REPLAY_STEPS)
        self.frames: list[dict[str, Any]] = []

    def __call__(self, scheduler: Any, out: Any, clock: float, seconds: float) -> None:
        num_prompt = sum(max(0, min(e.start_pos + e.num_tokens, len(e.prompt_token_ids)) - e.start_pos)
                         for e in out.scheduled)
        self.steps.add(StepRecord(len(self.frames) + 1, clock, seconds, num_prompt,
                                  out.num_scheduled_tokens - num_prompt, len(out.scheduled),
                                  len(out.preempted_request_ids)))
        snap = build_snapshot(scheduler, self.steps)
        snap["time"] = clock
        snap["running"], snap["waiting"] = snap["running"][:REPLAY_REQUESTS], snap["waiting"][:REPLAY_REQUESTS]
        self.frames.append(snap)

    def thinned(self, max_frames: int = MAX_FRAMES) -> list[dict[str, Any]]:
        """At most `max_frames` frames, evenly spaced, the last one always kept."""
        if len(self.frames) <= max_frames:
            return self.frames
        stride = len(self.frames) / max_frames
        picked = [self.frames[int(i * stride)] for i in range(max_frames - 1)]
        return picked + [self.frames[-1]]


def replay_html(runs: dict[str, list[dict[str, Any]]], title: str) -> str:
    """The dashboard page with its CSS and script inlined and `runs` (policy -> frames) embedded:
    one file, no server."""
    static = resources.files("octavo.dashboard").joinpath("static")
    page = static.joinpath("dashboard.html").read_text()
    css = static.joinpath("dashboard.css").read_text()
    script = static.joinpath("dashboard.js").read_text()
    data = json.dumps({"title": title, "runs": runs}, separators=(",", ":")).replace("</", "<\\/")
    page = page.replace('<link rel="stylesheet" href="/dashboard/static/dashboard.css">', f"<style>\n{css}</style>")
    return page.replace('<script src="/dashboard/static/dashboard.js"></script>',
                        f"<script>window.OCTAVO_REPLAY = {data};</script>\n<script>\n{script}</script>")
