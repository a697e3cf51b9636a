"""Tokenizer built from GGUF tokenizer metadata (llama.cpp conventions).

Encoding runs on the HuggingFace ``tokenizers`` library: the GGUF vocabulary is
turned into a ``tokenizers.models.BPE`` model (byte-level BPE for
``tokenizer.ggml.model == "gpt2"``, SentencePiece-style BPE with byte fallback
for ``"llama"``) with the pre-tokenizer split regexes llama.cpp uses for each
``tokenizer.ggml.pre`` family.  Decoding is a direct id -> bytes table, so a
stream of ids can be turned into text incrementally (:class:`StreamDecoder`).

Chat templates (``tokenizer.chat_template``) are rendered with jinja2 in a
sandboxed environment set up the way ``transformers`` does it.

This module does not need the native kvflash extension: it only depends on
numpy, gguf, tokenizers and jinja2.
"""
from __future__ import annotations

import codecs
import json
import mmap
import os
import struct
from datetime import datetime
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "read_gguf_metadata",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

# tokenizer.ggml.token_type values
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

_SPM_SPACE = "\u2581"  # "▁"

# --------------------------------------------------------------------------
# GGUF metadata reading
# --------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"

# GGUF value type id -> (struct code, size); 8 = string, 9 = array
_GGUF_SCALAR = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


def read_gguf_metadata(path: str | os.PathLike, *, prefix: str | None = None,
                       use_gguf_reader: bool = False) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file as plain Python values.

    Only the header's KV section is parsed; tensor infos and tensor data are
    never touched.  Arrays become Python lists.  ``prefix`` keeps only keys that
    start with it.  Raises ValueError for files that are not GGUF.

    ``use_gguf_reader=True`` goes through ``gguf.GGUFReader`` instead (it memory
    maps the file, but builds per-element views for every array, which takes
    seconds for a 150k-token vocabulary; the default parser reads the same bytes
    directly and is ~50x faster).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {_GGUF_MAGIC!r})")
    if use_gguf_reader:
        return _read_metadata_gguf_reader(path, prefix)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse_gguf_kv(view, path, prefix)
            finally:
                view.release()
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from e


def _parse_gguf_kv(buf: memoryview, path: str, prefix: str | None) -> dict[str, Any]:
    version = struct.unpack_from("<I", buf, 4)[0]
    endian = "<"
    if version & 0xFFFF == 0 and version != 0:  # a big-endian file read little-endian
        endian = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in (1, 2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    # v1 used 32-bit counts and string lengths, v2+ 64-bit
    len_code = endian + ("I" if version == 1 else "Q")
    len_size = 4 if version == 1 else 8
    pos = 8
    _n_tensors, n_kv = struct.unpack_from(endian + ("II" if version == 1 else "QQ"), buf, pos)
    pos += 2 * len_size
    u32 = struct.Struct(endian + "I")
    lens = struct.Struct(len_code)
    out: dict[str, Any] = {}

    def read_str(p: int) -> tuple[str, int]:
        (n,) = lens.unpack_from(buf, p)
        p += len_size
        return bytes(buf[p:p + n]).decode("utf-8", errors="surrogateescape"), p + n

    def read_value(t: int, p: int) -> tuple[Any, int]:
        if t == _GGUF_STRING:
            return read_str(p)
        if t in _GGUF_SCALAR:
            code, size = _GGUF_SCALAR[t]
            return struct.unpack_from(endian + code, buf, p)[0], p + size
        if t == _GGUF_ARRAY:
            (et,) = u32.unpack_from(buf, p)
            (n,) = lens.unpack_from(buf, p + 4)
            p += 4 + len_size
            if et in _GGUF_SCALAR:
                code, size = _GGUF_SCALAR[et]
                dt = np.dtype("bool" if code == "?" else endian + code)
                end = p + n * size
                if end > len(buf):
                    raise ValueError(f"{path}: truncated GGUF array")
                return np.frombuffer(bytes(buf[p:end]), dtype=dt).tolist(), end
            if et == _GGUF_STRING:
                items = []
                append = items.append
                unpack = lens.unpack_from
                for _ in range(n):
                    (m,) = unpack(buf, p)
                    p += len_size
                    append(bytes(buf[p:p + m]).decode("utf-8", errors="surrogateescape"))
                    p += m
                return items, p
            items = []
            for _ in range(n):
                v, p = read_value(et, p)
                items.append(v)
            return items, p
        raise ValueError(f"{path}: unknown GGUF value type {t}")

    for _ in range(n_kv):
        key, pos = read_str(pos)
        (t,) = u32.unpack_from(buf, pos)
        pos += 4
        if prefix is not None and not key.startswith(prefix) and t == _GGUF_ARRAY:
            # still have to walk the array to find the next key
            val, pos = read_value(t, pos)
            continue
        val, pos = read_value(t, pos)
        if prefix is None or key.startswith(prefix):
            out[key] = val
    return out


def _read_metadata_gguf_reader(path: str, prefix: str | None) -> dict[str, Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises plain ValueError/struct errors
        raise ValueError(f"{path}: cannot read GGUF metadata ({e})") from e
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if prefix is not None and not key.startswith(prefix):
            continue
        types = field.types
        if not types:
            continue
        if types[0] == gguf.GGUFValueType.ARRAY:
            if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape")
                            for i in field.data]
            else:
                out[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(field.parts[-1]).decode("utf-8", errors="surrogateescape")
        else:
            out[key] = field.parts[-1].tolist()[0]
    return out


# --------------------------------------------------------------------------
# Pre-tokenizer families (tokenizer.ggml.pre), after llama.cpp's llama-vocab.cpp
# --------------------------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_RE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_RE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3_RE = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# written with escapes: some of these code points have canonical equivalents
# that editors like to normalize (which would change the ranges)
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_DEEPSEEK3 = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_PORO_RE = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# family -> split regexes, applied one after the other (each splits every piece
# the previous left, keeping matches and the text between them), and options.
_PRE_FAMILIES: dict[str, dict[str, Any]] = {
    "default": {"regex": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"]},
    "llama3": {"regex": [_LLAMA3_RE], "ignore_merges": True, "add_bos": True},
    "dbrx": {"regex": [_LLAMA3_RE]},
    "chatglm4": {"regex": [_LLAMA3_RE]},
    "glm4": {"regex": [_LLAMA3_RE], "ignore_merges": True},
    "deepseek-llm": {"regex": ["[\r\n]", "\\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
                               "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_DEEPSEEK, r"\p{N}+"]},
    "deepseek-coder": {"regex": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DEEPSEEK, r"\p{N}"]},
    "deepseek-v3": {"regex": [r"\p{N}{1,3}", _CJK_DEEPSEEK3, _DEEPSEEK3_RE]},
    "falcon": {"regex": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]"]},
    "starcoder": {"regex": [r"\p{N}", _GPT2_RE]},
    "gpt2": {"regex": [_GPT2_RE]},
    "qwen2": {"regex": [_QWEN2_RE]},
    "qwen35": {"regex": [_QWEN35_RE]},
    "poro": {"regex": [_PORO_RE]},
    "viking": {"regex": [_PORO_RE, r"\p{N}"]},
    "tekken": {"regex": [_TEKKEN_RE], "ignore_merges": True, "add_bos": True},
    "gpt4o": {"regex": [_GPT4O_RE]},
    "minicpm5": {"regex": [r"\p{N}{1,3}", _TEKKEN_RE], "ignore_merges": True},
    "seed-coder": {"regex": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                             r"|\s*[\r\n]+|\s+(?!\S)|\s+"]},
    "bailingmoe": {"regex": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"]},
    "kimi-k2": {"regex": [r"\p{Han}+"]},
    "chameleon": {"regex": [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                            r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2_RE],
                  "add_bos": True},
    "whitespace": {"regex": [r"\S+"], "byte_encode": False},
}

# tokenizer.ggml.pre value -> family
_PRE_ALIASES: dict[str, str] = {
    "default": "default",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "falcon-h1": "llama3", "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3",
    "jina-v5-nano": "llama3",
    "dbrx": "dbrx", "smaug-bpe": "dbrx",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
    "deepseek-v3": "deepseek-v3", "hunyuan-dense": "deepseek-v3", "joyai-llm": "deepseek-v3",
    "hy_v4": "deepseek-v3",
    "falcon": "falcon",
    "starcoder": "starcoder", "refact": "starcoder", "command-r": "starcoder", "smollm": "starcoder",
    "codeshell": "starcoder", "exaone": "starcoder", "minerva-7b": "starcoder", "mellum2": "starcoder",
    "gpt-2": "gpt2", "phi-2": "gpt2", "jina-es": "gpt2", "jina-de": "gpt2", "gigachat": "gpt2",
    "jina-v2-es": "gpt2", "jina-v2-de": "gpt2", "a.x-4.0": "gpt2", "mellum": "gpt2",
    "modern-bert": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "trillion": "gpt2",
    "granite-docling": "gpt2", "exaone4": "gpt2", "jina-v1-en": "gpt2", "jina-v2-code": "gpt2",
    "roberta-bpe": "gpt2",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "f2llmv2": "qwen2",
    "stablelm2": "qwen2", "hunyuan": "qwen2", "solar-open": "qwen2", "megrez": "qwen2",
    "grok-2": "qwen2",
    "qwen35": "qwen35",
    "poro-chat": "poro", "bloom": "poro", "gpt3-finnish": "poro",
    "viking": "viking",
    "chatglm-bpe": "chatglm4", "glm4": "glm4", "glm5": "glm4",
    "tekken": "tekken",
    "gpt-4o": "gpt4o", "llama4": "gpt4o", "kanana2": "gpt4o", "talkie": "gpt4o", "minimax-m2": "gpt4o",
    "minicpm5": "minicpm5",
    "seed-coder": "seed-coder",
    "bailingmoe": "bailingmoe", "bailingmoe2": "bailingmoe", "llada-moe": "bailingmoe",
    "kimi-k2": "kimi-k2",
    "chameleon": "chameleon",
    "whitespace": "whitespace",
}

# token texts that end a turn (besides eos), as llama.cpp's end-of-generation list
_EOT_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[", "<|END_OF_TURN_TOKEN|>",
})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_token_value(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _md_list(v: Any) -> list:
    if v is None:
        return []
    if isinstance(v, np.ndarray):
        return v.tolist()
    return list(v)


def _md_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        v = _md_list(v)
        if len(v) != 1:
            raise ValueError(f"expected a scalar, got {v!r}")
        v = v[0]
    return int(v)


def _md_str(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray, np.ndarray)):
        return bytes(v).decode("utf-8")
    return str(v)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

class Tokenizer:
    """Tokenizer described by GGUF ``tokenizer.*`` metadata.

    Attributes: ``n_vocab``, ``bos_id``, ``eos_id``, ``eot_ids`` (eos and every
    token that ends a turn), ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``model`` ("gpt2" or "llama"), ``pre`` (the ``tokenizer.ggml.pre`` value),
    ``tokens`` (vocabulary strings), ``token_types``, ``chat_template``.
    """

    def __init__(self, md: Mapping[str, Any]):
        from tokenizers import AddedToken

        model = _md_str(md.get("tokenizer.ggml.model"))
        if model is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.model: no tokenizer in this file")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
        self.model = model
        tokens = [_md_str(t) if not isinstance(t, str) else t
                  for t in _md_list(md.get("tokenizer.ggml.tokens"))]
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        types = [int(x) for x in _md_list(md.get("tokenizer.ggml.token_type"))] or [TOKEN_TYPE_NORMAL] * n
        if len(types) < n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        types = types[:n]
        self.tokens: list[str] = tokens
        self.token_types: list[int] = types
        self.n_vocab: int = n

        self.bos_id = _md_int(md.get("tokenizer.ggml.bos_token_id"))
        self.eos_id = _md_int(md.get("tokenizer.ggml.eos_token_id"))
        self.unk_id = _md_int(md.get("tokenizer.ggml.unknown_token_id"))
        self.pad_id = _md_int(md.get("tokenizer.ggml.padding_token_id"))
        for name in ("bos_id", "eos_id", "unk_id", "pad_id"):
            v = getattr(self, name)
            if v is not None and not (0 <= v < n):
                setattr(self, name, None)
        self.chat_template: str | None = _md_str(md.get("tokenizer.chat_template"))

        token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):  # later duplicates win, as in llama.cpp
            token_to_id[t] = i
        self._token_to_id = token_to_id

        pre = _md_str(md.get("tokenizer.ggml.pre"))
        self.pre = pre
        if model == "gpt2":
            family_name = _PRE_ALIASES.get(pre or "default")
            if family_name is None:
                raise ValueError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) "
                                 "for tokenizer model 'gpt2'")
            family = _PRE_FAMILIES[family_name]
            self._byte_encode = family.get("byte_encode", True)
            default_add_bos = family.get("add_bos", False)
            default_space_prefix = False
            hf = self._build_bpe(md, family)
        else:
            self._byte_encode = False
            default_add_bos = True
            default_space_prefix = True
            hf = None  # built below, after add_space_prefix is known

        def md_bool(key: str, default: bool) -> bool:
            v = md.get(key)
            return default if v is None else bool(_md_int(v) if not isinstance(v, bool) else v)

        self.add_bos: bool = md_bool("tokenizer.ggml.add_bos_token", default_add_bos)
        self.add_eos: bool = md_bool("tokenizer.ggml.add_eos_token", False)
        self.add_space_prefix: bool = md_bool("tokenizer.ggml.add_space_prefix", default_space_prefix)
        if model == "llama":
            hf = self._build_spm(md)

        # Added tokens.  User-defined tokens are always matched in text (llama.cpp
        # does the same); control and unknown tokens only with parse_special=True,
        # which uses a second tokenizer that knows them.
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
        if user:
            hf.add_tokens(user)
        specials = [AddedToken(t, normalized=False, special=True)
                    for t, ty in zip(tokens, types) if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)]
        self._hf_plain = hf
        self._hf_special_tokens = specials
        self._hf_special = None if specials else hf

        # end-of-turn ids
        eot = set()
        if self.eos_id is not None:
            eot.add(self.eos_id)
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            v = _md_int(md.get(key))
            if v is not None and 0 <= v < n:
                eot.add(v)
        # by text, as llama.cpp does, but only tokens that are not plain text
        # (Qwen2's vocabulary has an ordinary "</s>" token, for instance)
        typed = bool(_md_list(md.get("tokenizer.ggml.token_type")))
        for t in _EOT_TEXTS:
            i = token_to_id.get(t)
            if i is not None and (not typed or types[i] != TOKEN_TYPE_NORMAL):
                eot.add(i)
        self.eot_ids: set[int] = eot

        # id -> bytes for decoding; special (control/unknown) ids flagged separately
        self._special = np.zeros(n, dtype=bool)
        pieces: list[bytes] = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                self._special[i] = True
                pieces.append(t.encode("utf-8", "surrogateescape"))
            elif ty == TOKEN_TYPE_USER_DEFINED:
                pieces.append(t.encode("utf-8", "surrogateescape"))
            elif ty == TOKEN_TYPE_BYTE and _byte_token_value(t) is not None:
                pieces.append(bytes([_byte_token_value(t)]))
            elif ty == TOKEN_TYPE_NORMAL:
                if model == "llama" or not self._byte_encode:
                    pieces.append(t.replace(_SPM_SPACE, " ").encode("utf-8", "surrogateescape"))
                else:
                    pieces.append(self._byte_level_decode(t))
            else:  # undefined / unused: renders as nothing, like llama.cpp
                pieces.append(b"")
        self._pieces = pieces
        self._jinja_env = None
        self._jinja_templates: dict[str, Any] = {}

    # -- construction -------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a GGUF file's metadata (tensor data is never read)."""
        md = read_gguf_metadata(path, prefix="tokenizer.")
        if "tokenizer.ggml.model" not in md:
            raise ValueError(f"{os.fspath(path)}: GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        return cls(md)

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF key -> value mapping (``read_gguf_metadata`` output)."""
        return cls(md)

    @staticmethod
    def _byte_level_decode(t: str) -> bytes:
        out = bytearray()
        for ch in t:
            b = _BYTE_DECODER.get(ch)
            if b is None:
                out += ch.encode("utf-8", "surrogateescape")
            else:
                out.append(b)
        return bytes(out)

    def _build_bpe(self, md: Mapping[str, Any], family: Mapping[str, Any]):
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        vocab = self._token_to_id
        merges = []
        for m in _md_list(md.get("tokenizer.ggml.merges")):
            m = m if isinstance(m, str) else _md_str(m)
            pos = m.find(" ", 1)
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1:]
            # tokenizers rejects merges whose parts or result are not in the vocab
            if a in vocab and b in vocab and (a + b) in vocab:
                merges.append((a, b))
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=bool(family.get("ignore_merges")),
                         fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(bpe)
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
                 for r in family["regex"]]
        if family.get("byte_encode", True):
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return tok

    def _build_spm(self, md: Mapping[str, Any]):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, normalizers

        tokens, vocab = self.tokens, self._token_to_id
        scores = [float(s) for s in _md_list(md.get("tokenizer.ggml.scores"))]
        if len(scores) < len(tokens):
            scores = scores + [0.0] * (len(tokens) - len(scores))
        # SentencePiece BPE as merges: every way to split a piece into two pieces
        # is a merge, ranked by the merged piece's score (higher merges first),
        # which is the order llama.cpp's SPM tokenizer applies them in.
        ranked = []
        for i, t in enumerate(tokens):
            if vocab.get(t) != i or len(t) < 2:
                continue
            s = scores[i]
            for k in range(1, len(t)):
                a, b = t[:k], t[k:]
                if a in vocab and b in vocab:
                    ranked.append((-s, i, k, a, b))
        ranked.sort()
        merges = [(a, b) for _, _, _, a, b in ranked]
        unk = tokens[self.unk_id] if self.unk_id is not None else None
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False,
                         byte_fallback=True)
        tok = HFTokenizer(bpe)
        norm = [normalizers.Replace(" ", _SPM_SPACE)]
        if self.add_space_prefix:
            norm.insert(0, normalizers.Prepend(_SPM_SPACE))
        tok.normalizer = normalizers.Sequence(norm)
        return tok

    def _hf_with_specials(self):
        if self._hf_special is None:
            from tokenizers import Tokenizer as HFTokenizer

            tok = HFTokenizer.from_str(self._hf_plain.to_str())
            tok.add_special_tokens(self._hf_special_tokens)
            self._hf_special = tok
        return self._hf_special

    # -- encode / decode ------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``.

        ``add_special`` adds BOS/EOS as the model asks (``add_bos``/``add_eos``);
        ``parse_special`` lets control tokens written in the text (e.g.
        ``<|im_start|>``) become their ids.  User-defined tokens always match.
        """
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        if text:
            hf = self._hf_with_specials() if parse_special else self._hf_plain
            ids.extend(hf.encode(text, add_special_tokens=False).ids)
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _strips_leading_space(self) -> bool:
        return self.model == "llama" and self.add_space_prefix

    def token_bytes(self, id: int, skip_special: bool = False) -> bytes:
        """The bytes token ``id`` stands for (control tokens render their text)."""
        id = int(id)
        if not 0 <= id < self.n_vocab:
            raise IndexError(f"token id {id} out of range [0, {self.n_vocab})")
        if skip_special and self._special[id]:
            return b""
        return self._pieces[id]

    def bytes_of(self, ids, skip_special: bool = False) -> tuple[bytes, np.ndarray]:
        """The bytes of a token sequence and each token's end offset in them (one lookup table
        per ``skip_special``, built on first use: the cross-tokenizer bridge maps every rescore)."""
        key = bool(skip_special)
        tabs = self.__dict__.setdefault("_bytes_tables", {})
        if key not in tabs:
            pieces = [b"" if key and self._special[i] else self._pieces[i] for i in range(self.n_vocab)]
            tabs[key] = (pieces, np.fromiter((len(x) for x in pieces), dtype=np.int64, count=self.n_vocab))
        pieces, lens = tabs[key]
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            bad = int(ids[(ids < 0) | (ids >= self.n_vocab)][0])
            raise IndexError(f"token id {bad} out of range [0, {self.n_vocab})")
        return b"".join([pieces[i] for i in ids.tolist()]), np.cumsum(lens[ids])

    def token_piece(self, id: int) -> str:
        """Text of one token as it appears in decoded output (control tokens as
        their text, byte tokens as U+FFFD when not valid UTF-8 on their own)."""
        return self.token_bytes(id).decode("utf-8", errors="replace")

    def token_text(self, id: int) -> str:
        """The raw vocabulary string of token ``id`` (e.g. ``"Ġworld"``, ``"▁the"``)."""
        return self.tokens[int(id)]

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary string ``text``, or None."""
        return self._token_to_id.get(text)

    def is_special(self, id: int) -> bool:
        """True for control/unknown tokens (those ``skip_special`` drops)."""
        return bool(self._special[int(id)])

    def decode(self, ids: Iterable[int], skip_special: bool = False,
               strip_leading_space: bool | None = None) -> str:
        """Text for ``ids``: the token bytes concatenated, decoded as UTF-8
        (invalid sequences become U+FFFD).

        For SentencePiece vocabularies with ``add_space_prefix`` the one space
        the encoder prepends is removed from the start of the text (as
        ``transformers`` does); pass ``strip_leading_space=False`` when decoding
        a continuation.
        """
        data = b"".join(self.token_bytes(i, skip_special) for i in ids)
        text = data.decode("utf-8", errors="replace")
        if strip_leading_space is None:
            strip_leading_space = self._strips_leading_space()
        if strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self, skip_special: bool = False,
                       strip_leading_space: bool | None = None) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special, strip_leading_space=strip_leading_space)

    def decode_stream(self, ids: Iterable[int], skip_special: bool = False,
                      strip_leading_space: bool | None = None) -> Iterator[str]:
        """Yield non-empty text pieces for ``ids`` as they complete."""
        dec = self.stream_decoder(skip_special, strip_leading_space)
        for i in ids:
            s = dec.push(i)
            if s:
                yield s
        s = dec.flush()
        if s:
            yield s

    # -- chat templates -------------------------------------------------------

    def _env(self):
        if self._jinja_env is None:
            self._jinja_env = _make_jinja_env()
        return self._jinja_env

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            *, chat_template: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (jinja2, sandboxed).

        Template variables: ``messages``, ``add_generation_prompt``,
        ``bos_token``, ``eos_token``, plus any extra keyword arguments (e.g.
        ``tools``); helpers ``raise_exception`` and ``strftime_now`` and the
        ``tojson`` filter behave as in ``transformers``.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("this model has no chat template (tokenizer.chat_template); pass chat_template=")
        tmpl = self._jinja_templates.get(source)
        if tmpl is None:
            tmpl = self._env().from_string(source)
            self._jinja_templates[source] = tmpl
        variables = {
            "bos_token": self.tokens[self.bos_id] if self.bos_id is not None else "",
            "eos_token": self.tokens[self.eos_id] if self.eos_id is not None else "",
            "unk_token": self.tokens[self.unk_id] if self.unk_id is not None else "",
            "pad_token": self.tokens[self.pad_id] if self.pad_id is not None else "",
        }
        variables.update(kwargs)
        return tmpl.render(messages=[dict(m) for m in messages],
                           add_generation_prompt=add_generation_prompt, **variables)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


def _make_jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class StreamDecoder:
    """Incremental detokenizer.

    Feed ids one at a time with :meth:`push`; each call returns the text that is
    now complete (possibly ``""`` while a multi-byte UTF-8 character is split
    across tokens).  :meth:`flush` returns what is left at the end.  The pieces
    concatenate exactly to ``tokenizer.decode(all_ids, ...)`` with the same
    arguments.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False,
                 strip_leading_space: bool | None = None):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        if strip_leading_space is None:
            strip_leading_space = tokenizer._strips_leading_space()
        self._strip = strip_leading_space
        self._started = False  # emitted any text yet
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _emit(self, s: str) -> str:
        if s and not self._started:
            self._started = True
            if self._strip and s.startswith(" "):
                s = s[1:]
        return s

    def push(self, id: int) -> str:
        return self._emit(self._dec.decode(self.tokenizer.token_bytes(id, self.skip_special)))

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Text held back at the end (incomplete UTF-8 becomes U+FFFD); resets."""
        s = self._emit(self._dec.decode(b"", final=True))
        self._dec.reset()
        return s

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._dec.getstate()[0])
