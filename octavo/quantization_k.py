"""GGUF block formats beyond Q4_0 / Q4_1 / Q8_0 that today's "Q4_K_M" files mix in: Q5_0, Q5_1
(32-weight blocks) and the K-quants Q4_K, Q5_K, Q6_K (256-weight super-blocks of 8 or 16
sub-blocks with their own scales). Each block is laid out byte for byte as in a GGUF file:

    Q5_0 (22 bytes): fp16 d, 32 high bits (uint32), 16 bytes of nibbles       w = d * (q - 16)
    Q5_1 (24 bytes): fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles        w = d * q + m
    Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
                      128 bytes of nibbles                                    w = (d*sc) * q - dmin*m
    Q5_K (176 bytes): as Q4_K, plus 32 bytes of high bits (bit i: sub-block i) w = (d*sc) * q - dmin*m
    Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (sub-blocks of 16),
                      fp16 d                                                  w = (d*sc) * (q - 32)

`dequantize_k` is their plain definition with gguf-py's arithmetic, float for float (the oracle a
kernel is tested against). Issue 22 builds kernels that read them as they are; until then a GGUF's
tensors in these formats are dequantized at load (octavo.models.loader).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    block_size: int  # weights per block
    block_bytes: int
    gguf_type: int  # GGMLQuantizationType value

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_size * self.block_bytes


Q5_0 = BlockFormat("Q5_0", 32, 22, 6)
Q5_1 = BlockFormat("Q5_1", 32, 24, 7)
Q4_K = BlockFormat("Q4_K", 256, 144, 12)
Q5_K = BlockFormat("Q5_K", 256, 176, 13)
Q6_K = BlockFormat("Q6_K", 256, 210, 14)
K_FORMATS = {f.name: f for f in (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)}
K_BY_GGUF_TYPE = {f.gguf_type: f for f in K_FORMATS.values()}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] float32 (the little-endian fp16 they hold)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 2k]: every byte's low nibbles, then every byte's high nibbles."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _bits(b: torch.Tensor, num: int, width: int = 1) -> torch.Tensor:
    """[..., 4] uint8 (a little-endian uint32) -> [..., 32]: bit j of it, for j in 0..31."""
    word = b.long()
    value = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16) | (word[..., 3] << 24)  # [...]
    shifts = torch.arange(num, device=b.device) * width
    return ((value[..., None] >> shifts) & ((1 << width) - 1)).to(torch.uint8)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes [..., 12] -> (scales, mins) [..., 8] uint8, 6 bits each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q5_low_high(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1: the 32 five-bit values of each block, [..., 32] uint8."""
    low = _nibbles(blocks[..., qh_at + 4 : qh_at + 20])
    return low | (_bits(blocks[..., qh_at : qh_at + 4], 32) << 4)


def _k_sub_blocks(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K low nibbles [..., 128] -> [..., 8, 32]: chunk c of 32 bytes holds sub-block 2c
    in its low nibbles and 2c + 1 in its high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def dequantize_k(qweight: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
    """Blocks [N, row_bytes] -> float32 [N, in_features], with gguf-py's arithmetic."""
    n = qweight.shape[0]
    nb = in_features // fmt.block_size
    blocks = qweight.reshape(n, nb, fmt.block_bytes)
    if fmt is Q5_0:
        q = _q5_low_high(blocks, 2).to(torch.int8) - 16
        w = _f16(blocks[..., 0:2]) * q.float()
    elif fmt is Q5_1:
        w = _f16(blocks[..., 0:2]) * _q5_low_high(blocks, 4).float() + _f16(blocks[..., 2:4])
    elif fmt in (Q4_K, Q5_K):
        sc, mn = _k_scales(blocks[..., 4:16])
        d = (_f16(blocks[..., 0:2]) * sc.float())[..., None]  # [N, nb, 8, 1]
        dm = (_f16(blocks[..., 2:4]) * mn.float())[..., None]
        if fmt is Q4_K:
            q = _k_sub_blocks(blocks[..., 16:144])
        else:
            qh = blocks[..., 16:48]  # [N, nb, 32]: bit i of byte j is sub-block i's weight j
            high = torch.stack([(qh >> i) & 1 for i in range(8)], dim=-2)  # [N, nb, 8, 32]
            q = _k_sub_blocks(blocks[..., 48:176]) | (high << 4)
        w = d * q.float() - dm
    elif fmt is Q6_K:
        ql = blocks[..., 0:128].reshape(n, nb, 2, 64)
        low = torch.stack([ql & 0x0F, ql >> 4], dim=-2).reshape(n, nb, 8, 32)
        qh = blocks[..., 128:192].reshape(n, nb, 2, 32)
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(n, nb, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, nb, 16, 16).float()
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16]
        d = (_f16(blocks[..., 208:210]) * scales)[..., None]  # [N, nb, 16, 1]
        w = d * q
    else:
        raise ValueError(f"unknown format {fmt}")
    return w.reshape(n, in_features)
