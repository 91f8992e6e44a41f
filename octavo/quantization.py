"""Weight-only quantization formats (GGML's Q4_0, Q4_1, Q8_0 blocks) and quantizing float weights into them.

A quantized weight is a uint8 tensor [out_features, in_features / 32 * block_bytes]: every row is a
run of 32-weight blocks laid out byte for byte as in a GGUF file, so a GGUF's tensors are used as
they are and a Hugging Face model quantized at load uses the very same kernels:

    Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles          w = d * (q - 8)          symmetric
    Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles  w = d * q + m            zero point (min)
    Q8_0 (34 bytes): fp16 d, 32 int8                       w = d * q                symmetric

In a Q4 block byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
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

    def row_bytes(self, in_features: int) -> int:
        return in_features // BLOCK * self.block_bytes


Q4_0 = QuantFormat("Q4_0", 0, 18, 2)
Q4_1 = QuantFormat("Q4_1", 1, 20, 3)
Q8_0 = QuantFormat("Q8_0", 2, 34, 8)
FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q8_0)}
BY_GGUF_TYPE = {f.gguf_type: f for f in FORMATS.values()}

# --quantization int8 / int4 (engine_args.QUANTIZATION_CHOICES owns the list of choices): the
# format every linear layer gets. The token embedding (and a tied LM head) always gets Q8_0, as
# llama.cpp's own Q4 files do.
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
