"""A GGUF of random weights at a real model's shape, for timing (timing does not depend on the
values): written in F16 tensor by tensor (never whole in memory), then quantized by llama.cpp's own
`llama-quantize`, so that the file holds the types a downloaded one holds (Q4_K_M: Q4_K with Q6_K
for half the down projections and the head, as llama.cpp picks them).

    .venv/bin/python tools/random_gguf.py qwen3-30b-a3b --layers 12 --out /tmp/q3moe-12l.gguf
    .venv/bin/python tools/random_gguf.py llama-3.2-1b --out /tmp/llama1b.gguf
    .venv/bin/python tools/random_gguf.py lfm2-1.2b --out /tmp/lfm2-1.2b.gguf
    .venv/bin/python tools/random_gguf.py llama-3.1-8b --out /tmp/llama8b.gguf

The vocabulary is byte-level (the 256 byte symbols, one merge, fillers up to the model's size):
the benchmark workloads send token ids. Needs tools/build_llama_server.sh's llama-quantize (found
next to llama-server); --type F16 keeps the unquantized file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Each family's shape (the published config.json's), and its GGUF architecture.
SHAPES = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ff=6144,
                          vocab=151936, experts=128, experts_used=8, ff_exp=768, tied=False, theta=1e6, qk_norm=True),
    "llama-3.2-1b": dict(arch="llama", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ff=8192,
                         vocab=128256, tied=True, theta=500000.0, rope_freqs=True),
    "llama-3.2-3b": dict(arch="llama", layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ff=8192,
                         vocab=128256, tied=True, theta=500000.0, rope_freqs=True),
    # Llama-3.1-8B: its own head (not tied), RoPE scaled by 8 (Llama 3.2's by 32)
    "llama-3.1-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ff=14336,
                         vocab=128256, tied=False, theta=500000.0, rope_freqs=True, rope_factor=8.0),
    # LFM2-1.2B: 10 short-convolution layers (kernel 3) and 6 attention layers (q/k norm)
    "lfm2-1.2b": dict(arch="lfm2", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ff=8192,
                      vocab=65536, tied=True, theta=1e6, qk_norm=True, attention_layers=(2, 5, 8, 10, 12, 14),
                      conv_kernel=3),
}


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def llama3_rope_freqs(head_dim: int, theta: float, factor: float = 32.0) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for Llama 3's scaling (factor 32 for 3.2, 8
    for 3.1; low 1, high 4, original context 8192): the tests' converter formula (tests/models/gguf_writer.py)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models.gguf_writer import llama3_rope_freqs as converter_factors

    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return converter_factors(SimpleNamespace(rope_parameters=rope), head_dim)


def tensors(s: dict) -> list[tuple[str, tuple[int, ...], type]]:
    """(GGUF name, numpy shape, dtype) of every tensor, in llama.cpp's order."""
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = [("token_embd.weight", (s["vocab"], h), np.float16)]
    if s.get("rope_freqs"):
        out.append(("rope_freqs.weight", (s["head_dim"] // 2,), np.float32))
    for i in range(s["layers"]):
        b = f"blk.{i}."
        if i not in s.get("attention_layers", range(s["layers"])):  # LFM2's short convolution
            out += [(b + "attn_norm.weight", (h,), np.float32), (b + "shortconv.conv.weight", (h, s["conv_kernel"]), np.float32),
                    (b + "shortconv.in_proj.weight", (3 * h, h), np.float16),
                    (b + "shortconv.out_proj.weight", (h, h), np.float16), (b + "ffn_norm.weight", (h,), np.float32),
                    (b + "ffn_gate.weight", (s["ff"], h), np.float16), (b + "ffn_up.weight", (s["ff"], h), np.float16),
                    (b + "ffn_down.weight", (h, s["ff"]), np.float16)]
            continue
        out += [(b + "attn_norm.weight", (h,), np.float32), (b + "attn_q.weight", (q, h), np.float16),
                (b + "attn_k.weight", (kv, h), np.float16), (b + "attn_v.weight", (kv, h), np.float16),
                (b + "attn_output.weight", (h, q), np.float16), (b + "ffn_norm.weight", (h,), np.float32)]
        if s.get("qk_norm"):
            out += [(b + "attn_q_norm.weight", (s["head_dim"],), np.float32),
                    (b + "attn_k_norm.weight", (s["head_dim"],), np.float32)]
        if s.get("experts"):
            e, f = s["experts"], s["ff_exp"]
            out += [(b + "ffn_gate_inp.weight", (e, h), np.float32), (b + "ffn_gate_exps.weight", (e, f, h), np.float16),
                    (b + "ffn_up_exps.weight", (e, f, h), np.float16), (b + "ffn_down_exps.weight", (e, h, f), np.float16)]
        else:
            out += [(b + "ffn_gate.weight", (s["ff"], h), np.float16), (b + "ffn_up.weight", (s["ff"], h), np.float16),
                    (b + "ffn_down.weight", (h, s["ff"]), np.float16)]
    out.append(("token_embd_norm.weight" if s["arch"] == "lfm2" else "output_norm.weight", (h,), np.float32))
    if not s["tied"]:
        out.append(("output.weight", (s["vocab"], h), np.float16))
    return out


def write_f16(name: str, s: dict, path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), s["arch"])
    w.add_name(f"{name} (random weights)")
    w.add_block_count(s["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    if s.get("attention_layers"):  # LFM2: a KV head count per layer, 0 for a convolution
        w.add_head_count_kv([s["kv_heads"] if i in s["attention_layers"] else 0 for i in range(s["layers"])])
        w.add_shortconv_l_cache(s["conv_kernel"])
    else:
        w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s.get("experts"):
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["experts_used"])
        w.add_expert_feed_forward_length(s["ff_exp"])
    symbols = byte_symbols()
    vocab = symbols + [f"<r{i}>" for i in range(s["vocab"] - len(symbols) - 1)] + ["tt"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([1] * len(vocab))
    w.add_token_merges(["t t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(len(vocab) - 2)
    rng = np.random.default_rng(0)
    specs = tensors(s)
    for tname, shape, dtype in specs:
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = time.time()
    for n, (tname, shape, dtype) in enumerate(specs):
        if tname == "rope_freqs.weight":
            data = llama3_rope_freqs(s["head_dim"], s["theta"], s.get("rope_factor", 32.0))
        elif tname.endswith("norm.weight"):
            data = np.ones(shape, dtype=np.float32)
        elif len(shape) == 3:  # experts: one at a time, so memory holds one expert's matrix
            data = np.empty(shape, dtype=dtype)
            for e in range(shape[0]):
                data[e] = (rng.standard_normal(shape[1:], dtype=np.float32) * 0.02).astype(dtype)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
        w.write_tensor_data(data)
        if n % 20 == 0:
            print(f"\r  {n + 1}/{len(specs)} tensors, {time.time() - start:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    w.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer layers than the model has (the same per-layer shape)")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (F16: keep the written file)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    s = dict(SHAPES[args.shape])
    if args.layers:
        s["layers"] = args.layers
    f16 = args.out if args.type == "F16" else args.out.with_name(args.out.stem + ".f16.gguf")
    if not f16.exists():
        print(f"writing {f16} ({s['layers']} layers)", file=sys.stderr)
        write_f16(args.shape, s, f16)
    if args.type != "F16":
        server = subprocess.run(["bash", "tools/build_llama_server.sh"], capture_output=True, text=True, check=True)
        quantize = Path(server.stdout.strip()).with_name("llama-quantize")
        threads = str(os.cpu_count() or 1)
        subprocess.run([str(quantize), str(f16), str(args.out), args.type, threads], check=True)
        f16.unlink()
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
