"""Weight-only quantization formats: GGML's blocks, byte for byte as in a GGUF file, their plain
dequantization (the kernels' oracle), and quantizing float weights into Q4_0 / Q4_1 / Q8_0.

A quantized weight is a uint8 tensor [out_features, in_features / block_size * block_bytes]: every
row is a run of blocks laid out as in a GGUF file, so a GGUF's tensors are used as they are and a
Hugging Face model quantized at load uses the very same kernels:

    Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles          w = d * (q - 8)          symmetric
    Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m            zero point (min)
    Q8_0 (34 bytes): fp16 d, 32 int8                       w = d * q                symmetric

In a Q4 block byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
Today's "Q4_K_M"-style files mix in Q5_0, Q5_1 and the K-quants (256-weight super-blocks of 8 or
16 sub-blocks with their own scales):

    Q5_0 (22 bytes): fp16 d, 32 high bits (uint32), 16 bytes of nibbles       w = d * (q - 16)
    Q5_1 (24 bytes): fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles        w = d * q + m
    Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
                      128 bytes of nibbles                                    w = (d*sc) * q - dmin*m
    Q5_K (176 bytes): as Q4_K, plus 32 bytes of high bits (bit i: sub-block i) w = (d*sc) * q - dmin*m
    Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (sub-blocks of 16),
                      fp16 d                                                  w = (d*sc) * (q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, in every format here


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str
    code: int  # the kernels' format number
    block_bytes: int
    gguf_type: int  # GGMLQuantizationType value
    block_size: int = BLOCK  # weights per block

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_size * self.block_bytes


Q4_0 = QuantFormat("Q4_0", 0, 18, 2)
Q4_1 = QuantFormat("Q4_1", 1, 20, 3)
Q8_0 = QuantFormat("Q8_0", 2, 34, 8)
Q5_0 = QuantFormat("Q5_0", 3, 22, 6)
Q5_1 = QuantFormat("Q5_1", 4, 24, 7)
Q4_K = QuantFormat("Q4_K", 5, 144, 12, 256)
Q5_K = QuantFormat("Q5_K", 6, 176, 13, 256)
Q6_K = QuantFormat("Q6_K", 7, 210, 14, 256)
# MXFP4 (gpt-oss's experts in llama.cpp's files): 32 weights share an E8M0 exponent e, each weight a
# 4-bit e2m1 code; gguf-py rebuilds w = 2^(e - 128) * k[code], k the doubled e2m1 values (17 bytes).
MXFP4 = QuantFormat("MXFP4", 8, 17, 39)
K_FORMATS = {f.name: f for f in (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4)}  # read from files, never made here
FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q8_0, *K_FORMATS.values())}
BY_GGUF_TYPE = {f.gguf_type: f for f in FORMATS.values()}

# --quantization int8 / int4: the format every linear layer gets. The token embedding (and a tied
# LM head) always gets Q8_0, as llama.cpp's own Q4 files do.
HF_SCHEMES = {"int8": Q8_0, "int4": Q4_1}


def can_quantize(in_features: int) -> bool:
    return in_features % BLOCK == 0


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., 1] float -> [..., 2] uint8: the fp16 value's little-endian bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Float weight [N, K] (K a multiple of 32) -> GGML blocks uint8 [N, K / 32 * block_bytes].

    Round to nearest, as ggml's reference quantizers do: Q8_0 and Q4_0 scale by the block's
    largest magnitude; Q4_1 spans [min, max] with 16 levels.
    """
    if weight.dim() != 2 or not can_quantize(weight.shape[1]):
        raise ValueError(f"can only quantize [N, K] weights with K a multiple of {BLOCK}, got {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)  # [N, blocks, 32]
    if fmt is Q8_0:
        d = w.abs().amax(-1, keepdim=True) / 127
        d16 = d.to(torch.float16).float()
        q = torch.where(d16 > 0, torch.round(w / d16), torch.zeros_like(w)).clamp(-127, 127).to(torch.int8)
        blocks = torch.cat([_fp16_bytes(d), q.view(torch.uint8)], dim=-1)
    elif fmt is Q4_0:
        # ggml: d = (signed value of largest magnitude) / -8, so that value maps to q = 0 exactly.
        idx = w.abs().argmax(-1, keepdim=True)
        d = torch.gather(w, -1, idx) / -8
        d16 = d.to(torch.float16).float()
        q = torch.where(d16 != 0, torch.round(w / d16) + 8, torch.full_like(w, 8)).clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([_fp16_bytes(d), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    elif fmt is Q4_1:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        d16, m16 = d.to(torch.float16).float(), lo.to(torch.float16).float()
        q = torch.where(d16 > 0, torch.round((w - m16) / d16), torch.zeros_like(w)).clamp(0, 15).to(torch.uint8)
        blocks = torch.cat([_fp16_bytes(d), _fp16_bytes(lo), q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    else:
        raise ValueError(f"unknown format {fmt}")
    return blocks.reshape(n, k // BLOCK * fmt.block_bytes).contiguous()


def dequantize(qweight: torch.Tensor, fmt: QuantFormat, in_features: int) -> torch.Tensor:
    """GGML blocks [N, row_bytes] -> float32 [N, in_features], with gguf-py's arithmetic (the
    plain definition of each format; the kernels' oracle)."""
    if fmt.name in K_FORMATS:
        return dequantize_k(qweight, fmt, in_features)
    n = qweight.shape[0]
    nb = in_features // BLOCK
    blocks = qweight.reshape(n, nb, fmt.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if fmt is Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        w = q * d
    else:
        packed = blocks[..., (4 if fmt is Q4_1 else 2):]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [N, nb, 32] uint8
        if fmt is Q4_0:
            w = d * (q.to(torch.int8) - 8).float()
        else:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            w = d * q.float() + m
    return w.reshape(n, in_features)


_MXFP4_K = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) as float32, as ggml's e8m0_to_fp32_half (e < 2: subnormal)."""
    e = e.to(torch.int64)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


# ---- Q5_0, Q5_1 and the K-quants: read from files, dequantized with gguf-py's arithmetic ----


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


def dequantize_k(qweight: torch.Tensor, fmt: QuantFormat, in_features: int) -> torch.Tensor:
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
    elif fmt is MXFP4:
        d = _e8m0_half(blocks[..., 0:1])  # [N, nb, 1]
        w = d * _MXFP4_K[_nibbles(blocks[..., 1:]).long()]
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
