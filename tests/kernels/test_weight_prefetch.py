"""The quantized kernels' software prefetch of weights: the rule that turns it off (measured per CPU
kind, octavo.cpu_features.weight_prefetch), its override, and that it changes no result."""

from __future__ import annotations

import pytest
import torch

from octavo.cpu_features import cpu_identity, weight_prefetch
from octavo.kernels import cpu
from octavo.quantization import FORMATS
from tests.kernels.test_quant_linear_i8 import random_blocks

ZEN5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
ZEN2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\n"
XEON = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"


def test_identity_reads_vendor_and_family():
    assert cpu_identity(ZEN5) == ("AuthenticAMD", 26)
    assert cpu_identity(XEON) == ("GenuineIntel", 6)
    assert cpu_identity("") == ("", 0)


def test_rule_turns_prefetch_off_only_where_measured():
    assert weight_prefetch(ZEN5, env="") is False
    assert weight_prefetch(ZEN2, env="") is True  # not measured: kept on
    assert weight_prefetch(XEON, env="") is True
    assert weight_prefetch("", env="") is True


def test_override_and_bad_value():
    assert weight_prefetch(ZEN5, env="1") is True
    assert weight_prefetch(XEON, env="0") is False
    with pytest.raises(ValueError, match="OCTAVO_WEIGHT_PREFETCH must be 0 or 1"):
        weight_prefetch(XEON, env="yes")


@pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_prefetch_changes_no_bit(name):
    lib = cpu.load()
    fmt, n, k = FORMATS[name], 48, 1024
    q = random_blocks(name, n, k, seed=3)
    packed, packed_i8 = cpu.pack(q, fmt), cpu.pack_i8(q, fmt)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    before = lib.weight_prefetch()
    try:
        results = []
        for on in (True, False):
            lib.set_weight_prefetch(on)
            assert lib.weight_prefetch() is on
            results.append((cpu.quant_linear(x, packed, fmt, n), cpu.quant_linear_i8(x, packed_i8, fmt, n)))
    finally:
        lib.set_weight_prefetch(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert before is weight_prefetch()  # the load set the rule's value
