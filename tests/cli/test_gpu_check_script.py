"""scripts/gpu_check.py runs end to end before its first GPU run: every stage on tiny shapes on the
CPU (--smoke), with a summary table, results.json and no failed stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_runs_every_stage(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--smoke", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "FAILED" not in summary
    for stage in ("kernels", "oracle", "decode", "throughput"):
        assert f"\n{stage}" in summary, stage
    oracle = next(line for line in summary.splitlines() if "float32 reference == transformers" in line)
    assert "4/4" in oracle
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["throughput"]) >= {"octavo", "hf"}
    assert results["throughput"]["octavo"]["output_tokens"] == 8 * 8
