"""Model files and runtime arguments: bad input raises the documented Python
exceptions (ValueError, IndexError) and never crashes the interpreter."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "ok.gguf"
    write_tiny_model(path, "llama", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128)
    return path


def _patched(tmp_path, src, name, old: bytes, new: bytes, count=1):
    data = src.read_bytes()
    assert len(old) == len(new) and data.count(old) == count, (old, data.count(old))
    dst = tmp_path / name
    dst.write_bytes(data.replace(old, new))
    return str(dst)


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return len(b).to_bytes(8, "little") + b


def test_valid_file_loads(llama_file):
    m = core.Model(str(llama_file), n_threads=1)
    hp = m.hparams
    assert (hp["arch"], hp["n_layer"], hp["n_embd"], hp["head_dim"], hp["n_vocab"]) == ("llama", 2, 64, 32, 266)


def test_truncated_file(tmp_path, llama_file):
    data = llama_file.read_bytes()
    for cut in (len(data) // 2, len(data) - 1, 200):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="(?i)truncated|corrupt"):
            core.Model(str(p), n_threads=1)


def test_missing_tensor(tmp_path, llama_file):
    p = _patched(tmp_path, llama_file, "missing.gguf", _gguf_string("blk.1.ffn_up.weight"),
                 _gguf_string("blk.1.ffn_uq.weight"))
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        core.Model(p, n_threads=1)


def test_wrong_tensor_shape(tmp_path, llama_file):
    # feed_forward_length 128 -> 160: every ffn tensor has the wrong shape
    key = _gguf_string("llama.feed_forward_length")
    uint32 = (4).to_bytes(4, "little")
    p = _patched(tmp_path, llama_file, "shape.gguf", key + uint32 + (128).to_bytes(4, "little"),
                 key + uint32 + (160).to_bytes(4, "little"))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate\.weight.*shape"):
        core.Model(p, n_threads=1)


def test_unsupported_architecture(tmp_path, llama_file):
    key = _gguf_string("general.architecture")
    string = (8).to_bytes(4, "little")
    p = _patched(tmp_path, llama_file, "mamba.gguf", key + string + _gguf_string("llama"),
                 key + string + _gguf_string("mamba"))
    with pytest.raises(ValueError, match="mamba"):
        core.Model(p, n_threads=1)


def test_not_gguf(tmp_path):
    for name, blob in [("random.bin", np.random.default_rng(0).bytes(4096)),
                       ("magic.bin", b"GGUF" + np.random.default_rng(1).bytes(4096)),
                       ("huge_counts.bin", b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2),
                       ("empty.bin", b"")]:
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(ValueError):
            core.Model(str(p), n_threads=1)
    with pytest.raises(ValueError):
        core.Model(str(tmp_path / "does-not-exist.gguf"), n_threads=1)
    with pytest.raises(ValueError):
        core.Model(str(tmp_path), n_threads=1)  # a directory


def test_runtime_bad_arguments(llama_file):
    m = core.Model(str(llama_file), n_threads=1)
    n_vocab = 266
    rt = core.Runtime(m, max_ctx=100)
    for bad in ([n_vocab], [-1], [0, 5, n_vocab + 1000]):
        with pytest.raises(ValueError, match="token"):
            rt.eval(np.array(bad, dtype=np.int32))
    assert rt.n_past == 0  # rejected before anything was evaluated
    rt.eval(np.arange(90, dtype=np.int32))
    with pytest.raises(IndexError):
        rt.eval(np.arange(11, dtype=np.int32))
    assert rt.n_past == 90
    rt.eval(np.arange(10, dtype=np.int32))  # exactly max_ctx is fine
    with pytest.raises(IndexError):
        rt.eval(np.array([1], dtype=np.int32))
    with pytest.raises(IndexError):
        rt.eval_sample(np.array([1], dtype=np.int32))
    # pool below the minimum ((1 + 4 + 2) * 64 = 448 -> 512)
    with pytest.raises(ValueError, match="512"):
        core.Runtime(m, max_ctx=4096, pool_tokens=256)
    with pytest.raises(ValueError, match="(?i)q5_9|kv_type"):
        core.Runtime(m, max_ctx=256, kv_type="q5_9")
    with pytest.raises(ValueError):
        rt.eval(np.array([], dtype=np.int32))
