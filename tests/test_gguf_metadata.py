"""kvflash.gguf_metadata: ggml's GGUF reader from Python -- values as the gguf package
writes them, the prefix filter, and clear ValueErrors (never an abort) for bad files."""
from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")
from kvflash.gguf_metadata import read_gguf_metadata  # noqa: E402


def test_values_and_prefix(tmp_path):
    p = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint32("llama.context_length", 128)
    w.add_float32("llama.rope.freq_base", 0.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["a", "b\u00e9", ""])
    w.add_array("tokenizer.ggml.scores", [0.25, -1.0])
    w.add_array("tokenizer.ggml.token_type", [1, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    md = read_gguf_metadata(p)
    assert md["general.architecture"] == "llama" and md["llama.context_length"] == 128
    assert md["llama.rope.freq_base"] == 0.5 and md["tokenizer.ggml.add_bos_token"] is True
    assert md["tokenizer.ggml.tokens"] == ["a", "b\u00e9", ""]
    assert md["tokenizer.ggml.scores"] == [0.25, -1.0] and md["tokenizer.ggml.token_type"] == [1, 3]
    assert md == read_gguf_metadata(p, use_gguf_reader=True)
    assert set(read_gguf_metadata(p, prefix="tokenizer.")) == {
        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}


@pytest.mark.parametrize("data", [
    b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2,   # absurd counts
    b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"\x05",  # cut short
    b"GGUF" + (99).to_bytes(4, "little") + bytes(16),                           # unknown version
])
def test_bad_files_raise(tmp_path, data):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(ValueError, match="GGUF"):
        read_gguf_metadata(p)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"NOPE" + bytes(12))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(p)
    with pytest.raises(ValueError, match="no such GGUF file"):
        read_gguf_metadata(tmp_path / "missing.gguf")
