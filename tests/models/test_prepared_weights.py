"""Prepared weights kept for the next start: a converted GGUF's quantized layers, once put in the
layout the kernels read, are written beside its blocks and memory-mapped by later loads (the
kernels' packing is skipped); a damaged or stale file is prepared again, never trusted."""

import gguf
import numpy as np
import pytest
import torch

from octavo.kernels import dispatch
from octavo.models import loader
from octavo.models.layers import QuantLinear


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A tiny Llama GGUF (Q8_0, v in Q4_1: a fused q|k|v of two formats) converted into a fresh cache
    (kernels shared with the usual one: built already)."""
    from octavo.cache import cache_dir
    from tests.models.gguf_writer import hf_model, write_gguf

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels")
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    write_gguf(hf_model("llama"), "llama", tmp_path / "m.gguf", types={"attn_v": gguf.GGMLQuantizationType.Q4_1})
    return loader.resolve_model(tmp_path / "m.gguf")


def _logits(model, ids=(1, 7, 30, 4, 96, 12)):
    """All-position logits of one prefill through the paged path."""
    from octavo.config import CacheConfig
    from octavo.model_runner import ModelRunner
    from tests.models.test_tiny_models import entry, run

    runner = ModelRunner(model.eval(), model.config, CacheConfig(block_size=4, num_blocks=8), eos_token_ids=())
    return run(runner, [entry("a", list(ids), 0, [0, 1], 1)])["a"]


def _no_packing(monkeypatch):
    """Fail if a load packs layers again, or makes the blocks the prepared file replaces (the
    file's fused parts stacked: deferred, and never needed then)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the layers were packed again: the prepared file was not used")

    class Unmade(loader.DeferredBlocks):
        @property
        def parts(self):
            refuse()

        @parts.setter
        def parts(self, value):
            self.__dict__["_parts"] = value

    monkeypatch.setattr(loader, "prepare_quantized_layers", refuse)
    monkeypatch.setattr(dispatch, "prepare_quant_weight", refuse)
    monkeypatch.setattr(loader, "DeferredBlocks", Unmade)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_second_load_maps_the_prepared_layers_and_computes_the_same(model_dir, monkeypatch, activations):
    first, _ = loader.load_model(model_dir, quantization="auto", activation_dtype=activations)
    path = loader.prepared_weights_file(model_dir, activations)
    assert path is not None and path.is_file()
    written = path.stat().st_mtime_ns
    _no_packing(monkeypatch)
    second, _ = loader.load_model(model_dir, quantization="auto", activation_dtype=activations)
    assert path.stat().st_mtime_ns == written
    layers = [m for m in second.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.layout == ("packed_i8" if activations == "int8" else "packed") for m in layers)
    assert torch.equal(_logits(first), _logits(second))


def test_fused_blocks_are_made_only_when_a_load_packs_them(tmp_path, monkeypatch):
    """q and k in Q5_0 beside v in Q8_0 (Gemma 3's Q4_K_M layout): each part of q|k|v keeps its
    own blocks; gate|up one format, stacked. A first load stacks and packs them, a later one maps
    the packed layers without making them; both compute the same."""
    from octavo.cache import cache_dir
    from tests.models.gguf_writer import hf_model, write_gguf

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels")
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(1)
    q5 = gguf.GGMLQuantizationType.Q5_0
    write_gguf(hf_model("llama"), "llama", tmp_path / "m.gguf", types={"attn_q": q5, "attn_k": q5, "ffn_down": q5})
    model_dir = loader.resolve_model(tmp_path / "m.gguf")
    first, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="float32")
    qkv = first.get_submodule("layers.0.self_attn.qkv_proj")
    assert [(p.fmt.name, p.layout) for p in qkv.parts] == [("Q5_0", "packed"), ("Q5_0", "packed"), ("Q8_0", "packed")]
    assert first.get_submodule("layers.0.mlp.down_proj").fmt.name == "Q5_0"
    kept = loader.load_model(model_dir, quantization="auto", prepare_quantized=False)[0]  # (to be sharded)
    gate_up, gguf_gate_up = (m.get_submodule("layers.0.mlp.gate_up_proj") for m in (first, kept))
    assert gguf_gate_up.layout == "gguf" and gguf_gate_up.qweight.shape[0] == gate_up.out_features  # made, not a placeholder
    _no_packing(monkeypatch)
    second, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="float32")
    assert torch.equal(_logits(first), _logits(second))


def test_each_activation_dtype_keeps_its_own_file(model_dir):
    for activations in ("float32", "int8"):
        loader.load_model(model_dir, quantization="auto", activation_dtype=activations)
    files = sorted(p.name for p in (model_dir / "gguf-blocks").glob("prepared-*"))
    assert [f.split("-")[1] for f in files] == ["float32", "int8"]


def test_a_truncated_file_is_prepared_again_and_replaced(model_dir, caplog):
    first, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="int8")
    path = loader.prepared_weights_file(model_dir, "int8")
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    second, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="int8")
    assert "unreadable" in caplog.text
    assert path.stat().st_size == size
    assert torch.equal(_logits(first), _logits(second))


def test_another_kernel_build_prepares_again_and_removes_the_stale_file(model_dir, monkeypatch):
    from octavo.kernels import dispatch

    loader.load_model(model_dir, quantization="auto", activation_dtype="int8")
    old = loader.prepared_weights_file(model_dir, "int8")
    monkeypatch.setattr(dispatch, "packed_layout_key", lambda: "cpu-otherbuild")
    loader.load_model(model_dir, quantization="auto", activation_dtype="int8")
    new = loader.prepared_weights_file(model_dir, "int8")
    assert new != old and new.is_file() and not old.exists()


def test_a_file_made_for_other_layers_is_not_used(model_dir, monkeypatch, tmp_path):
    """Same kernel build, same name, other model (a file copied over): its layers do not match."""
    from safetensors.torch import save_file

    path = loader.prepared_weights_file(model_dir, "int8")
    save_file({"model.layers.0.mlp.down_proj": torch.zeros(4, 8, dtype=torch.uint8)}, str(path),
              metadata={"format": "pt", "layers": '{"model.layers.0.mlp.down_proj": ["Q8_0", "packed_i8", 64]}'})
    model, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="int8")
    _, kept = loader.map_safetensors(path)
    assert set(kept) == {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def test_map_safetensors_reads_what_save_file_wrote_without_copying(tmp_path):
    from safetensors.torch import save_file

    tensors = {"f": torch.randn(3, 5), "b": torch.randn(4).to(torch.bfloat16), "u": torch.arange(7, dtype=torch.uint8),
               "e": torch.zeros(0, 3), "h": torch.randn(2, 2).half()}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"k": "v"})
    metadata, mapped = loader.map_safetensors(tmp_path / "t.safetensors")
    assert metadata == {"k": "v"}
    for name, t in tensors.items():
        assert mapped[name].dtype == t.dtype and torch.equal(mapped[name], t)
    mapped["f"].zero_()  # copy-on-write: the file keeps its bytes
    assert torch.equal(loader.map_safetensors(tmp_path / "t.safetensors")[1]["f"], tensors["f"])
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 10])
    with pytest.raises(ValueError, match="outside the file"):
        loader.map_safetensors(tmp_path / "cut.safetensors")
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    with pytest.raises(ValueError, match="truncated"):
        loader.map_safetensors(tmp_path / "head.safetensors")
    assert np.frombuffer(data[:8], "<u8")[0] < len(data)


def test_write_safetensors_is_read_back_by_safetensors_and_by_the_map(tmp_path):
    """The loader's own writer (bytes straight from the tensors' memory) makes files safetensors'
    reader takes as its own, every dtype kept, and leaves no temporary behind."""
    from safetensors import safe_open

    from octavo.models.weight_files import write_safetensors

    tensors = {"f": torch.randn(3, 5), "b": torch.randn(4).to(torch.bfloat16), "u": torch.arange(7, dtype=torch.uint8),
               "e": torch.zeros(0, 3), "h": torch.randn(2, 2).half(), "i": torch.arange(6, dtype=torch.int8),
               "t": torch.randn(4, 6).t()}  # not contiguous
    write_safetensors(tmp_path / "t.safetensors", tensors, {"k": "v"})
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as fh:
        assert fh.metadata() == {"k": "v"}
        for name, t in tensors.items():
            assert torch.equal(fh.get_tensor(name), t), name
    metadata, mapped = loader.map_safetensors(tmp_path / "t.safetensors")
    assert metadata == {"k": "v"} and all(torch.equal(mapped[n], t) for n, t in tensors.items())


def test_an_engine_start_writes_its_prepared_layers_while_it_serves(model_dir, monkeypatch):
    """An engine's first start returns before its prepared layers are written (a thread writes
    them); a second load in the same process waits for that write and maps the file, packing
    nothing."""
    import threading

    from octavo.models import weight_files

    path = loader.prepared_weights_file(model_dir, "int8")
    release = threading.Event()
    real = weight_files.write_safetensors

    def held(*args, **kwargs):  # the write cannot finish before the test lets it
        assert release.wait(60), "the test never released the write"
        real(*args, **kwargs)

    monkeypatch.setattr(weight_files, "write_safetensors", held)
    first, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="int8", write_in_background=True)
    assert not path.exists()  # returned with the write still held
    release.set()
    _no_packing(monkeypatch)
    second, _ = loader.load_model(model_dir, quantization="auto", activation_dtype="int8")
    assert path.is_file()
    assert all(m.layout == "packed_i8" for m in second.modules() if isinstance(m, QuantLinear))
    assert torch.equal(_logits(first), _logits(second))


def test_a_write_waits_for_the_first_answer(tmp_path, monkeypatch, make_llm):
    """A first start's files are written once the engine has answered its first request (the
    write slowed that answer), not before; the engine releases them then."""
    import threading
    import time

    from octavo.models import weight_files
    from octavo.sampling.params import SamplingParams

    monkeypatch.setattr(weight_files, "_released", threading.Event())
    monkeypatch.setattr(weight_files, "WRITE_HOLD_S", 600.0)
    path = tmp_path / "w.safetensors"
    weight_files.write_later(path, {"t": torch.arange(64, dtype=torch.int32)}, {})
    llm = make_llm()
    time.sleep(0.5)
    assert not path.exists()  # held while nothing has been answered
    llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:  # (not wait_for_write: it releases writes itself)
        time.sleep(0.05)
    assert path.exists(), "the engine's first answer did not release the held write within 60 s"
    weight_files.wait_for_write(path)
    assert torch.equal(loader.map_safetensors(path)[1]["t"], torch.arange(64, dtype=torch.int32))


def test_a_write_started_from_a_daemon_thread_is_finished_before_the_process_exits(tmp_path):
    """An engine loads in a daemon thread, whose flag a thread inherits: a process that exits
    while the write is under way must still leave the whole file (it once left the temporary
    and aborted in C++ teardown). The write is slowed so that the exit always comes first, and
    held as before a first answer: the exit releases it (else the run passes its timeout)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import threading, time, torch
        from pathlib import Path
        from octavo.models import weight_files
        real = weight_files.write_safetensors
        def slow(*args, **kwargs):
            time.sleep(1.0)
            real(*args, **kwargs)
        weight_files.write_safetensors = slow
        weight_files.WRITE_HOLD_S = 600.0  # held: the interpreter's exit must release it
        loader = threading.Thread(target=lambda: weight_files.write_later(
            Path({str(tmp_path / 'w.safetensors')!r}), {{"t": torch.arange(1 << 20, dtype=torch.int32)}}, {{}}), daemon=True)
        loader.start(); loader.join()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    _, tensors = loader.map_safetensors(tmp_path / "w.safetensors")
    assert torch.equal(tensors["t"], torch.arange(1 << 20, dtype=torch.int32))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
