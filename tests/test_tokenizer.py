"""Tests for kvflash.tokenizer (GGUF metadata -> tokenizers-library tokenizer).

The modules are loaded from their files (the source tree's); reading a GGUF goes
through the installed extension's ggml reader (kvflash.gguf_metadata).  The reference vocabularies and their expected
tokenizations (ggml-vocab-*.gguf / .gguf.inp / .gguf.out) come from llama.cpp's
models/ directory, fetched via kvflash._registry.vocab_dir().

llama.cpp's test-tokenizer-0 compares .out against
common_tokenize(text, add_special=false, parse_special=false); so do we.
"""
from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "kvflash"


def _load(name: str, filename: str):
    mod_name = f"_kvflash_test_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, PKG / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


tk = _load("tokenizer", "tokenizer.py")
from vocab_cases import VOCAB_DIR, needs_vocab, read_cases  # noqa: E402

VOCABS = ["llama-spm", "llama-bpe", "qwen2", "gpt-2"]
_read_cases = read_cases


def _case_params():
    if VOCAB_DIR is None:
        return [pytest.param("none", 0, "", [], marks=needs_vocab, id="vocab-dir-unavailable")]
    params = []
    for name in VOCABS:
        for i, (text, ids) in enumerate(_read_cases(name)):
            params.append(pytest.param(name, i, text, ids, id=f"{name}-{i:02d}"))
    return params


CASES = _case_params()

_TOKENIZERS: dict[str, object] = {}


def get_tok(name: str):
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = tk.Tokenizer.from_gguf(VOCAB_DIR / f"ggml-vocab-{name}.gguf")
    return _TOKENIZERS[name]


# ---------------------------------------------------------------------------
# llama.cpp reference tokenizations
# ---------------------------------------------------------------------------

@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_reference_files_present(name):
    cases = _read_cases(name)
    assert len(cases) >= 40


@needs_vocab
@pytest.mark.parametrize("name,idx,text,expected", CASES)
def test_encode_matches_llama_cpp(name, idx, text, expected):
    got = get_tok(name).encode(text, add_special=False, parse_special=False)
    assert got == expected, f"{name} case {idx} {text!r}"


@needs_vocab
@pytest.mark.parametrize("name,idx,text,expected", CASES)
def test_decode_roundtrip(name, idx, text, expected):
    tok = get_tok(name)
    # every reference case is plain text, so decoding gives the input back exactly
    assert tok.decode(expected) == text
    assert tok.decode(tok.encode(text, add_special=True), skip_special=True) == text


# ---------------------------------------------------------------------------
# vocabulary facts
# ---------------------------------------------------------------------------

@needs_vocab
def test_llama_spm_properties():
    t = get_tok("llama-spm")
    assert (t.model, t.n_vocab, t.bos_id, t.eos_id) == ("llama", 32000, 1, 2)
    assert t.add_bos and not t.add_eos and t.add_space_prefix
    assert t.eos_id in t.eot_ids
    assert t.encode("Hello world") == [1, 15043, 3186]
    assert t.encode("Hello world", add_special=False) == [15043, 3186]
    assert t.encode("") == [1] and t.encode("", add_special=False) == []
    assert t.token_piece(15043) == " Hello"
    assert t.token_text(15043) == "\u2581Hello"
    assert t.token_piece(t.token_to_id("<0x0A>")) == "\n"
    assert t.decode([1, 15043, 3186]) == "<s> Hello world"
    assert t.decode([1, 15043, 3186], skip_special=True) == "Hello world"
    assert t.decode([3186], strip_leading_space=False) == " world"


@needs_vocab
def test_llama_bpe_properties():
    t = get_tok("llama-bpe")
    assert (t.model, t.n_vocab, t.bos_id, t.eos_id) == ("gpt2", 128256, 128000, 128001)
    assert t.add_bos and not t.add_eos  # llama3 pre-tokenizer family adds BOS
    eot_id = t.token_to_id("<|eot_id|>")
    assert {t.eos_id, eot_id} <= t.eot_ids
    assert t.encode("hi")[0] == t.bos_id


@needs_vocab
def test_qwen2_properties():
    t = get_tok("qwen2")
    assert t.model == "gpt2" and t.pre == "qwen2" and t.n_vocab == 151936
    assert not t.add_bos
    im_end = t.token_to_id("<|im_end|>")
    assert {t.eos_id, im_end} <= t.eot_ids
    # an ordinary text token spelled "</s>" does not end a turn
    plain_eos_text = t.token_to_id("</s>")
    assert plain_eos_text is None or plain_eos_text not in t.eot_ids
    assert t.is_special(im_end) and not t.is_special(t.encode("hi", add_special=False)[0])


@needs_vocab
def test_gpt2_properties():
    t = get_tok("gpt-2")
    assert t.n_vocab == 50257 and t.bos_id == t.eos_id == 50256
    assert not t.add_bos and not t.add_eos
    assert t.encode("Hello world") == [15496, 995]
    assert t.token_piece(995) == " world" and t.token_text(995) == "\u0120world"


# ---------------------------------------------------------------------------
# special tokens
# ---------------------------------------------------------------------------

@needs_vocab
def test_parse_special_qwen2():
    t = get_tok("qwen2")
    text = "<|im_start|>user\nhi<|im_end|>"
    im_start, im_end = t.token_to_id("<|im_start|>"), t.token_to_id("<|im_end|>")
    parsed = t.encode(text, parse_special=True)
    assert parsed[0] == im_start and parsed[-1] == im_end
    assert parsed == [im_start] + t.encode("user\nhi", add_special=False) + [im_end]
    plain = t.encode(text)
    assert im_start not in plain and im_end not in plain
    assert t.decode(plain) == text and t.decode(parsed) == text
    assert t.decode(parsed, skip_special=True) == "user\nhi"


@needs_vocab
def test_parse_special_spm_space_prefix():
    t = get_tok("llama-spm")
    ids = t.encode("<s>Hi</s>", add_special=False, parse_special=True)
    # text after a special token gets the SentencePiece space prefix, as in llama.cpp
    assert ids == [1] + t.encode("Hi", add_special=False) + [2]
    assert 1 not in t.encode("<s>Hi", add_special=False)


@needs_vocab
def test_user_defined_tokens_always_match():
    t = get_tok("qwen2")
    pad = t.token_to_id("[PAD151646]")
    assert t.token_types[pad] == tk.TOKEN_TYPE_USER_DEFINED
    assert t.encode("a[PAD151646]b", add_special=False) == [64, pad, 65]
    assert t.encode("a[PAD151646]b", add_special=False, parse_special=True) == [64, pad, 65]


# ---------------------------------------------------------------------------
# streaming detokenization
# ---------------------------------------------------------------------------

UNICODE_TEXT = ("Grüße, naïve café — 日本語のテキスト, 한국어, Ελληνικά, עברית, "
                "emoji 🦙🚀👩‍👩‍👧 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ ½ \u00a0\t\n end")


@needs_vocab
@pytest.mark.parametrize("name", VOCABS)
def test_stream_decode_equals_full_decode(name):
    t = get_tok(name)
    ids = t.encode(UNICODE_TEXT)
    for skip in (False, True):
        dec = t.stream_decoder(skip_special=skip)
        pieces = [dec.push(i) for i in ids]
        pieces.append(dec.flush())
        assert all("\ufffd" not in p for p in pieces)  # nothing emitted half-done
        assert "".join(pieces) == t.decode(ids, skip_special=skip)
        assert "".join(t.decode_stream(ids, skip_special=skip)) == t.decode(ids, skip_special=skip)
    assert t.decode(ids, skip_special=True) == UNICODE_TEXT


@needs_vocab
@pytest.mark.parametrize("name", ["llama-spm", "gpt-2"])
def test_bytes_of_matches_token_bytes(name):
    t = get_tok(name)
    ids = t.encode(UNICODE_TEXT, add_special=True)
    for skip in (False, True):
        data, ends = t.bytes_of(ids, skip_special=skip)
        pieces = [t.token_bytes(i, skip) for i in ids]
        assert data == b"".join(pieces)
        assert ends.tolist() == list(itertools.accumulate(len(p) for p in pieces))
    assert t.bytes_of([])[0] == b"" and len(t.bytes_of([])[1]) == 0
    with pytest.raises(IndexError, match="out of range"):
        t.bytes_of([0, t.n_vocab])


@needs_vocab
@pytest.mark.parametrize("name", ["llama-spm", "gpt-2"])
def test_stream_holds_back_partial_utf8(name):
    t = get_tok(name)
    ids = t.encode("🦙", add_special=False)
    assert len(ids) > 1  # the 4-byte character spans several tokens in both vocabs
    dec = t.stream_decoder()
    out = [dec.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1)
    assert out[-1] == "🦙" and not dec.pending
    # a truncated sequence: held back, then flushed as U+FFFD exactly like decode()
    dec = t.stream_decoder()
    assert dec.push_many(ids[:-1]) == "" and dec.pending
    assert dec.flush() == t.decode(ids[:-1]) == "\ufffd"


# ---------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi, how can I help?"}]


@needs_vocab
def test_chat_template_qwen2():
    t = get_tok("qwen2")
    assert t.chat_template and "<|im_start|>" in t.chat_template
    s = t.apply_chat_template(MESSAGES)
    assert s.startswith("<|im_start|>system\n")  # default system prompt of this template
    assert "<|im_start|>user\nHello!<|im_end|>\n" in s
    assert "<|im_start|>assistant\nHi, how can I help?<|im_end|>\n" in s
    assert s.endswith("<|im_start|>assistant\n")
    s2 = t.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert s2.endswith("Hi, how can I help?<|im_end|>\n")
    ids = t.encode(s, parse_special=True)
    assert ids.count(t.token_to_id("<|im_start|>")) == 4
    assert t.decode(ids) == s


@needs_vocab
def test_chat_template_phi3_uses_bos_token():
    t = tk.Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-phi-3.gguf")
    s = t.apply_chat_template(MESSAGES)
    # this template opens the assistant turn right after each user message
    assert s == "<s><|user|>\nHello!<|end|>\n<|assistant|>\nHi, how can I help?<|end|>\n"
    assert t.apply_chat_template(MESSAGES[:1]).endswith("<|user|>\nHello!<|end|>\n<|assistant|>\n")
    # the rendered prompt already starts with BOS: encode it without adding another
    ids = t.encode(s, add_special=False, parse_special=True)
    assert ids[0] == t.bos_id and ids.count(t.bos_id) == 1
    assert t.token_to_id("<|end|>") in t.eot_ids


def _tiny_md(**extra):
    """A byte-level BPE vocabulary: the 256 byte symbols, two merges, two control tokens."""
    byte_chars = list(tk._bytes_to_unicode().values())
    tokens = byte_chars + ["ab", "abc", "<|bos|>", "<|eot|>"]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 258 + [3, 3],
        "tokenizer.ggml.merges": ["a b", "ab c"],
        "tokenizer.ggml.bos_token_id": 258,
        "tokenizer.ggml.eos_token_id": 259,
    }
    md.update(extra)
    return md


def test_from_metadata_tiny_bpe():
    t = tk.Tokenizer.from_metadata(_tiny_md())
    a, b, c = (t.token_to_id(x) for x in "abc")
    ab, abc = t.token_to_id("ab"), t.token_to_id("abc")
    assert t.encode("abc", add_special=False) == [abc]
    assert t.encode("abcab ba", add_special=False) == [abc, ab, t.token_to_id("\u0120"), b, a]
    assert t.encode("<|eot|>", parse_special=True, add_special=False) == [259]
    assert t.eot_ids == {259} and t.bos_id == 258 and not t.add_bos
    t2 = tk.Tokenizer.from_metadata(_tiny_md(**{"tokenizer.ggml.add_bos_token": True}))
    assert t2.encode("ab") == [258, ab]
    assert t2.decode([258, abc, c], skip_special=True) == "abcc"


def test_chat_template_helpers_and_sandbox():
    import jinja2

    tmpl = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}"
            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
            "{{ strftime_now('%Y') | length }}")
    t = tk.Tokenizer.from_metadata(_tiny_md(**{"tokenizer.chat_template": tmpl}))
    out = t.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert out == '<|bos|>[user]"héllo"[assistant]4'
    bad = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    with pytest.raises(jinja2.TemplateError, match="need a system message"):
        t.apply_chat_template(MESSAGES, chat_template=bad)
    with pytest.raises(jinja2.exceptions.SecurityError):
        t.apply_chat_template(MESSAGES, chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="no chat template"):
        tk.Tokenizer.from_metadata(_tiny_md()).apply_chat_template(MESSAGES)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

def test_non_gguf_file_raises(tmp_path):
    p = tmp_path / "not-a-model.gguf"
    p.write_text("this is not a GGUF file\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        tk.Tokenizer.from_gguf(p)
    with pytest.raises(ValueError, match="no such GGUF file"):
        tk.Tokenizer.from_gguf(tmp_path / "missing.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        tk.Tokenizer.from_gguf(empty)


@needs_vocab
def test_truncated_gguf_raises(tmp_path):
    p = tmp_path / "truncated.gguf"
    p.write_bytes((VOCAB_DIR / "ggml-vocab-gpt-2.gguf").read_bytes()[:4096])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        tk.Tokenizer.from_gguf(p)


def test_unknown_tokenizer_model_raises():
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        tk.Tokenizer.from_metadata(_tiny_md(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        tk.Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'no-such-pre'"):
        tk.Tokenizer.from_metadata(_tiny_md(**{"tokenizer.ggml.pre": "no-such-pre"}))


@needs_vocab
def test_unknown_tokenizer_model_in_gguf_raises():
    # a real vocab-only GGUF whose tokenizer (WordPiece) is not supported
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        tk.Tokenizer.from_gguf(VOCAB_DIR / "ggml-vocab-bert-bge.gguf")


def test_gguf_without_tokenizer_raises(tmp_path):
    gguf = pytest.importorskip("gguf")
    p = tmp_path / "no-tokenizer.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint32("llama.context_length", 128)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert tk.read_gguf_metadata(p)["llama.context_length"] == 128
    with pytest.raises(ValueError, match="no tokenizer"):
        tk.Tokenizer.from_gguf(p)


# ---------------------------------------------------------------------------
# metadata reader
# ---------------------------------------------------------------------------

@needs_vocab
def test_metadata_reader_matches_gguf_reader():
    path = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"
    fast = tk.read_gguf_metadata(path)
    ref = tk.read_gguf_metadata(path, use_gguf_reader=True)
    assert fast.keys() == ref.keys()
    for k in fast:
        assert fast[k] == pytest.approx(ref[k]) if isinstance(fast[k], float) else fast[k] == ref[k], k
    assert fast["tokenizer.ggml.model"] == "llama" and len(fast["tokenizer.ggml.tokens"]) == 32000
    only_tok = tk.read_gguf_metadata(path, prefix="tokenizer.")
    assert only_tok and all(k.startswith("tokenizer.") for k in only_tok)
