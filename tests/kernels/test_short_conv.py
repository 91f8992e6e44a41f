"""LFM2's short convolution over the paged cache (kernels/reference.short_conv) against a plain
causal depthwise Conv1d over the whole sequence: in chunks, through scattered blocks, with a
token's inputs split over several K/V tensors, and two sequences in one step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import reference


def dense(bx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, H] -> [T, H]: out[t] = sum_k weight[:, k] * bx[t - (L - 1) + k], zeros before 0."""
    kernel = weight.shape[1]
    return F.conv1d(bx.t()[None], weight[:, None, :], padding=kernel - 1, groups=bx.shape[1])[0, :, : bx.shape[0]].t()


def test_chunks_through_scattered_blocks_equal_one_dense_convolution():
    g = torch.Generator().manual_seed(0)
    hidden, kernel, bs = 24, 4, 4
    # 4 tensors of [blocks, 4, 1, 8]: 8 values a slot each, so a token's 24 are split (and padded);
    # NaN wherever nothing was written: a read of such a slot would show
    cache = tuple(torch.full((20, bs, 1, 8), float("nan")) for _ in range(4))
    weight = torch.randn(hidden, kernel, generator=g)
    seqs = {"a": (torch.randn(23, hidden, generator=g), [7, 2, 11, 5, 9, 14]),
            "b": (torch.randn(9, hidden, generator=g), [3, 16, 1])}
    done = {"a": 0, "b": 0}
    out = {"a": [], "b": []}
    for chunk in (5, 1, 6, 3, 8, 1):  # both sequences step together, each `chunk` tokens (or what is left)
        step = [(k, min(chunk, len(seqs[k][0]) - done[k])) for k in ("a", "b") if done[k] < len(seqs[k][0])]
        if not step:
            break
        bx = torch.cat([seqs[k][0][done[k] : done[k] + n] for k, n in step])
        positions = torch.cat([torch.arange(done[k], done[k] + n) for k, n in step])
        width = max(len(seqs[k][1]) for k, _ in step)
        tables = torch.tensor([seqs[k][1] + [0] * (width - len(seqs[k][1])) for k, _ in step], dtype=torch.int32)
        seq_of = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(step)])
        slots = tables[seq_of, positions // bs].long() * bs + positions % bs
        lens = torch.tensor([n for _, n in step], dtype=torch.int32)
        got = reference.short_conv(bx, cache, slots, tables, lens, positions, weight)
        offset = 0
        for k, n in step:
            out[k].append(got[offset : offset + n])
            done[k] += n
            offset += n
    for k, (bx, _) in seqs.items():
        torch.testing.assert_close(torch.cat(out[k]), dense(bx, weight), atol=1e-5, rtol=1e-5)


def test_a_token_at_position_zero_sees_nothing_before_it():
    cache = (torch.full((4, 2, 1, 4), 5.0), torch.full((4, 2, 1, 4), 5.0))  # stale values in every slot
    weight = torch.ones(8, 3)
    bx = torch.ones(1, 8)
    got = reference.short_conv(bx, cache, torch.tensor([2]), torch.tensor([[1, 0]], dtype=torch.int32),
                               torch.tensor([1], dtype=torch.int32), torch.tensor([0]), weight)
    assert torch.equal(got, torch.ones(1, 8))  # the own tap only
