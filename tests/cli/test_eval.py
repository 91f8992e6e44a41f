"""`octavo eval`: int8 activations scored against the exact path end to end on the embedded model;
a text too short for one window is refused in one line."""

import json

from tests.cli.test_generate import run


def test_eval_scores_int8_against_float32(tmp_path):
    out = run("eval", "--ctx", "256", "--max-windows", "2", "--json", str(tmp_path / "eval.json"))
    assert out.returncode == 0, out.stderr
    assert "int8" in out.stdout and "same top" in out.stdout
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["ctx"] == 256 and result["num_tokens"] == 2 * (256 // 2 - 1)
    exact, int8 = result["scores"]
    assert (exact["mode"], int8["mode"]) == ("float32", "int8")
    assert exact["mean_kl"] == 0 and exact["same_top_token"] == 1
    assert 0 < int8["mean_kl"] < 0.1 and 0.8 < int8["same_top_token"] < 1
    assert abs(int8["perplexity"] / exact["perplexity"] - 1) < 0.1


def test_eval_refuses_a_text_shorter_than_a_window(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("Too short to score.")
    out = run("eval", "--text", str(text))
    assert out.returncode == 2
    assert "fewer than one window of 512" in out.stderr and "Traceback" not in out.stderr
