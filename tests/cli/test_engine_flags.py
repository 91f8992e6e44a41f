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
