"""CLI flags are built from EngineArgs, so none the README promises can go missing again."""

import dataclasses

from octavo.cli import build_parser, engine_kwargs
from octavo.engine_args import EngineArgs


def test_every_engine_arg_is_a_flag_of_serve_generate_and_bench():
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for argv in (["serve"], ["generate"], ["bench", "throughput"]):
        args = build_parser().parse_args(argv)
        assert set(engine_kwargs(args)) == names
        assert EngineArgs(**engine_kwargs(args)) == EngineArgs()  # the flags' defaults are the fields'


def test_scheduling_policy_num_kv_blocks_and_sizes_reach_engine_args():
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority", "--num-kv-blocks", "64",
                                      "--kv-cache-memory", "512MiB", "--no-enable-prefix-caching", "some/dir"])
    got = EngineArgs(**engine_kwargs(args))
    assert (got.scheduling_policy, got.num_kv_blocks, got.kv_cache_memory) == ("priority", 64, 512 << 20)
    assert got.enable_prefix_caching is False and got.model == "some/dir"


def test_gpu_flags_reach_engine_args_and_the_config():
    import pytest
    import torch

    from octavo.engine_args import resolve_device

    args = build_parser().parse_args(["serve", "--device", "cpu", "--gpu-memory-utilization", "0.8",
                                      "--no-enforce-eager", "--attention-backend", "triton", "--dtype", "bfloat16"])
    got = EngineArgs(**engine_kwargs(args))
    assert (got.device, got.gpu_memory_utilization, got.enforce_eager, got.attention_backend, got.dtype) == (
        "cpu", 0.8, False, "triton", "bfloat16")
    assert EngineArgs().enforce_eager is True and EngineArgs().device == "auto"  # graphs stay off by default
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs(gpu_memory_utilization=1.5)
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device.*--device cpu or auto"):
            resolve_device("cuda")


def test_cache_aware_scheduling_flags_reach_the_scheduler_config():
    args = build_parser().parse_args(["serve", "--scheduling-policy", "cache-aware", "--max-wait-steps", "7", "--dtype", "float32",
                                      "--preemption-victim", "newest", "--admission-headroom-steps", "0",
                                      "--pinned-prefix", "a.txt", "b.json", "--pinned-prefix-share", "0.1"])
    got = EngineArgs(**engine_kwargs(args))
    assert got.pinned_prefix == ("a.txt", "b.json") and got.pinned_prefix_share == 0.1
    from tests.test_memory import SMOL

    cfg = got.to_config(SMOL)
    sched = cfg.scheduler
    assert (sched.policy, sched.max_wait_steps, sched.preemption_victim, sched.admission_headroom_steps) == (
        "cache-aware", 7, "newest", 0)
    assert cfg.cache.pinned_prefix_share == 0.1
    import pytest

    with pytest.raises(ValueError, match="need prefix caching"):
        EngineArgs(pinned_prefix=("a.txt",), enable_prefix_caching=False)


def test_every_option_is_checked_for_its_type_and_range_at_construction():
    """A wrong type or an out-of-range value of any option is a ValueError naming it when the
    options are made, before a model loads (a fractional prompt_lookup_max used to pass and kill
    the server at its first request)."""
    import pytest

    from octavo.engine_args import RANGES

    wrong_type = {"int": 2.5, "float": "x", "bool": 1, "str": 3, "tuple[str, ...]": ("a", 1)}
    for f in dataclasses.fields(EngineArgs):
        kind = str(f.type).split(" | ")[0]
        with pytest.raises(ValueError, match=f"^{f.name} must be"):
            EngineArgs(**{f.name: wrong_type[kind]})
    for name, (low, high) in RANGES.items():
        below = low - 1 if isinstance(low, int) else low - 1e-3
        for bad in (below, high + 1, float("nan")) if str(EngineArgs.__dataclass_fields__[name].type).startswith("float") \
                else (below, high + 1):
            with pytest.raises(ValueError, match=f"^{name} must be in"):
                EngineArgs(**{name: bad})
    for conf in ('{"method": "ngram", "prompt_lookup_max": 2.5}', '{"method": "ngram", "num_speculative_tokens": "4"}',
                 '{"method": "ngram", "prompt_lookup_min": 0}', '{"method": 7}'):
        with pytest.raises(ValueError, match="must be"):
            EngineArgs(speculative_config=conf)


def test_serve_refuses_bad_flags_in_one_line_before_loading_anything():
    import subprocess
    import sys

    for flags, expect in ((["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 2.5}'],
                           "prompt_lookup_max must be an integer, got 2.5"),
                          (["--kv-cache-memory", "1e400"], "not a size this machine could hold"),
                          (["--grammar-compile-timeout", "nan"], "--grammar-compile-timeout must be in"),
                          (["--max-waiting-requests", "0"], "--max-waiting-requests must be in")):
        out = subprocess.run([sys.executable, "-m", "octavo.cli", "serve", *flags], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and expect in out.stderr and "Traceback" not in out.stderr, (flags, out.stderr)
