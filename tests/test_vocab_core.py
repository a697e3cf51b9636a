"""The core tokenizer (``_core.Vocab``: llama.cpp's llama_vocab compiled into libkvflash) through the bindings.

Every vocabulary the pinned sdist ships test vectors for and the core loads, against llama.cpp's own
expected ids (ggml-vocab-*.gguf.inp / .out, as llama.cpp's test-tokenizer-0 checks them: add_special
and parse_special off); kvflash.tokenizer.Tokenizer (which encodes through the core) on the families
the next issue needs; and bad input, which must be an exception, never an abort.  The same vectors
through the C API: tests/test_capi.py.
"""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from kvflash import _core
from kvflash.tokenizer import Tokenizer
from vocab_cases import VOCAB_DIR, needs_vocab, read_cases

CORE_VOCABS = ["llama-spm", "llama-bpe", "qwen2", "gpt-2", "qwen35", "gemma-4", "phi-3", "command-r",
               "deepseek-coder", "deepseek-llm", "falcon", "mpt", "refact", "starcoder"]


def cases(name: str) -> list[tuple[str, list[int]]]:
    cs = read_cases(name)
    assert len(cs) >= 40
    return cs


_VOCABS: dict[str, object] = {}


def vocab(name: str):
    if name not in _VOCABS:
        _VOCABS[name] = _core.Vocab.load(str(VOCAB_DIR / f"ggml-vocab-{name}.gguf"))
    return _VOCABS[name]


@needs_vocab
@pytest.mark.parametrize("name", CORE_VOCABS)
def test_core_matches_llama_cpp_vectors(name):
    v = vocab(name)
    for i, (text, want) in enumerate(cases(name)):
        assert v.encode(text, False, False) == want, f"{name} case {i} {text!r}"
        assert v.encode(text.encode("utf-8"), False, False) == want   # bytes take the same road


@needs_vocab
@pytest.mark.parametrize("name", ["qwen35", "gemma-4", "phi-3", "command-r", "deepseek-llm"])
def test_tokenizer_class_on_the_coming_families(name):
    """kvflash.tokenizer.Tokenizer on vocabularies its former encoder did not know: ids and byte-exact decode."""
    t = Tokenizer.from_gguf(VOCAB_DIR / f"ggml-vocab-{name}.gguf")
    for i, (text, want) in enumerate(cases(name)):
        assert t.encode(text, add_special=False) == want, f"{name} case {i}"
        assert t.decode(want) == text
        assert "".join(t.decode_stream(want)) == text


@needs_vocab
def test_gemma4_facts():
    t = Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-gemma-4.gguf")
    assert t.model == "gemma4" and t.n_vocab == 262144
    assert t.add_bos and t.encode("hi")[0] == t.bos_id        # llama.cpp adds BOS for Gemma 4
    assert t.eot_ids and t.eos_id in t.eot_ids


@needs_vocab
def test_pieces_and_specials_are_llama_cpp_s():
    v = vocab("qwen2")
    im_end = v.encode("<|im_end|>", False, True)
    assert len(im_end) == 1 and v.is_special(im_end[0]) and v.is_eog(im_end[0]) and v.is_control(im_end[0])
    assert v.token_to_piece(im_end[0], True) == b"<|im_end|>" and v.token_to_piece(im_end[0], False) == b""
    assert v.decode(v.encode("héllo wörld", False, False)) == "héllo wörld".encode()
    pieces = v.pieces(True)
    assert len(pieces) == v.n_vocab and pieces[im_end[0]] == b"<|im_end|>"
    assert im_end[0] in v.eog_ids and v.eog_ids == sorted(v.eog_ids)
    assert v.token_text(im_end[0]) == "<|im_end|>"
    assert (v.bos_id, v.add_bos) == (151643, False)
    assert "llama" in _core.Vocab.supported_models


@needs_vocab
def test_encode_from_threads_at_once():
    """The GIL is released around llama.cpp's tokenize: threads encode at once, each getting its own ids."""
    v = vocab("llama-bpe")
    texts = [("word%d " % i) * 20000 for i in range(4)]
    want = [v.encode(t, False, False) for t in texts]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda t: v.encode(t, False, False), texts))
    assert got == want


@needs_vocab
def test_bad_input_is_an_exception():
    v = vocab("gpt-2")
    with pytest.raises(ValueError, match="not valid UTF-8 \\(byte 2\\)"):
        v.encode(b"ab\xff", False, False)
    for bad in (b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"):   # overlong, surrogate, > U+10FFFF, cut
        with pytest.raises(ValueError, match="UTF-8"):
            v.encode(bad, False, False)
    with pytest.raises(ValueError, match="surrogate"):
        v.encode("a\ud800b", False, False)
    with pytest.raises(TypeError):
        v.encode(12, False, False)
    for bad in (-1, v.n_vocab, 2**31 - 1):
        with pytest.raises(IndexError, match="out of range"):
            v.token_to_piece(bad)
        with pytest.raises(IndexError, match="out of range"):
            v.decode([0, bad])
        with pytest.raises(IndexError):
            v.is_special(bad)
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        _core.Vocab.load(str(VOCAB_DIR / "ggml-vocab-bert-bge.gguf"))


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no such GGUF file"):
        _core.Vocab.load(str(tmp_path / "missing.gguf"))
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ValueError, match="not a GGUF file"):
        _core.Vocab.load(str(p))


def _tiny_spm(**extra):
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a", "a"],
          "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0], "tokenizer.ggml.token_type": [2, 3, 3, 1, 1]}
    md.update(extra)
    return md


def test_hostile_metadata_is_an_exception_not_an_abort():
    # llama.cpp asserts (aborts) on a duplicate token string: refused before it looks
    with pytest.raises(ValueError, match="duplicate"):
        Tokenizer.from_metadata(_tiny_spm(**{"tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "a"]}))
    # scores shorter than the tokens: llama.cpp's own error
    with pytest.raises(ValueError, match="scores"):
        Tokenizer.from_metadata(_tiny_spm(**{"tokenizer.ggml.scores": [0.0]}))
    # a vocabulary that asks for a BOS it does not have: llama.cpp asserts when add_special puts it
    t = Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>"],
                                 "tokenizer.ggml.scores": [0.0], "tokenizer.ggml.token_type": [2],
                                 "tokenizer.ggml.add_bos_token": True})
    assert t.bos_id is None and t.add_bos
    with pytest.raises(ValueError, match="BOS"):
        t.encode("a")
    # and text it has no token for, not even its bytes': llama.cpp's byte fallback throws from a map lookup
    with pytest.raises(ValueError, match="cannot encode"):
        t.encode("a", add_special=False)


def test_vocab_from_a_loaded_model(tmp_path):
    from tinygguf import write_tiny_model
    p = tmp_path / "tiny.gguf"
    write_tiny_model(str(p), "llama", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, seed=1)
    m = _core.Model(str(p), 1)
    v = _core.Vocab.from_model(m)
    assert v is _core.Vocab.from_model(m)      # built once, shared
    text = "the other thing <|bos|>"
    assert v.encode(text, True, True) == _core.Vocab.load(str(p)).encode(text, True, True)
    assert Tokenizer.from_model(m).encode(text) == Tokenizer.from_gguf(p).encode(text)
