"""scripts/gpu_check.sh --smoke runs every stage on the CPU (the script is tested here, since it has
never run on a GPU) with its table, results.json (throughput of octavo and transformers included)
and no failed stage, and a stage that dies as a CUDA fault does leaves the other stages, the table
and the results whole, in at most 6 files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = ("kernels", "oracle", "graphs", "decode", "tests")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}


def _table_stages(summary: str) -> set[str]:
    return {line.split()[0] for line in summary.splitlines()[2:] if line.strip()}


def test_smoke_run_of_the_shell_script_is_green_with_every_stage(tmp_path):
    log_dir = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), str(log_dir), "--smoke"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (log_dir / "summary.txt").read_text()
    assert set(STAGES) <= _table_stages(summary), summary
    assert "FAILED" not in summary and "oracle      float32 reference == transformers (sequences)            4/4" in summary
    assert sorted(p.name for p in log_dir.iterdir()) == ["gpu_check.log", "logs.tar.gz", "results.json", "summary.txt"]
    results = json.loads((log_dir / "results.json").read_text())
    assert results["stage_exit"] == {s: 0 for s in STAGES}
    assert set(results["throughput"]) >= {"octavo", "hf"} and results["throughput"]["octavo"]["output_tokens"] == 8 * 8


def test_a_stage_that_aborts_leaves_the_others_the_table_and_the_results(tmp_path):
    log_dir = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check.py"), "--smoke", "--log-dir", str(log_dir),
                           "--stages", "kernels,oracle,decode", "--fault", "oracle"],
                          capture_output=True, text=True, env=_env(), timeout=600, cwd=REPO)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (log_dir / "summary.txt").read_text()
    rows = [line.split(None, 2) for line in summary.splitlines()[2:]]
    failed = [r for r in rows if r[1] == "FAILED"]
    assert [r[0] for r in failed] == ["oracle"] and "exit -6" in failed[0][2], summary
    assert any(r[0] == "oracle" and r[1] == "before" for r in rows)  # the rows it made before dying stay
    assert {"kernels", "decode", "throughput"} <= _table_stages(summary), summary
    results = json.loads((log_dir / "results.json").read_text())
    assert results["stage_exit"] == {"kernels": 0, "oracle": -6, "decode": 0}
    assert "decode_b1" in results and "throughput" in results
    assert len(list(log_dir.iterdir())) <= 6
