"""Tokenizer built from GGUF tokenizer metadata: llama.cpp's own.

Encoding is the core's (``_core.Vocab``, csrc/kvflash/tokenizer.h): llama.cpp's
``llama_vocab`` from the pinned sdist, compiled into libkvflash, so the ids are
``llama_tokenize``'s for every vocabulary and pre-tokenizer llama.cpp knows, the
same ids a C program gets from ``kvflash_tokenize``.  It releases the GIL while
it works: a server thread tokenizing a prompt of megabytes leaves the other
threads, its event loop among them, running.

Decoding is a direct id -> bytes table, one path for ``decode``, streaming
(:class:`StreamDecoder`) and byte spans (``bytes_of``); the table is the core's
``token_to_piece`` of every id (llama.cpp's pieces), so only the joining is
written here: bytes concatenated, held back while a UTF-8 character is
incomplete, the one space a SentencePiece encoder prepends removed.

Metadata comes from ggml's GGUF reader (:mod:`kvflash.gguf_metadata`, through the
native extension).  Chat templates: :mod:`kvflash.chat_template`.
"""
from __future__ import annotations

import codecs
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

# Absolute imports: the tokenizer tests load this file directly, outside the package.
from kvflash.chat_template import ChatTemplates
from kvflash.gguf_metadata import md_int, md_list, md_str, read_gguf_metadata

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

# Texts at least this long are encoded with the GIL released (every text is, since the core took
# over encoding; kept for callers that read it).
GIL_FREE_CHARS = 1 << 15


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table (tests build byte-level vocabularies with it)."""
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


def _core():
    from kvflash import _core
    return _core


# Scalar keys llama.cpp reads as uint32 / bool (its loader checks a key's type exactly).
_BOOL_KEYS = ("add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix", "remove_extra_whitespaces",
              "normalizer_lowercase", "normalizer_strip_accents")


def _write_vocab_gguf(md: Mapping[str, Any], path: Path) -> None:
    """md's keys as a metadata-only GGUF, typed as llama.cpp reads them."""
    import gguf
    arch = md_str(md.get("general.architecture")) or "unknown"
    w = gguf.GGUFWriter(str(path), arch)
    for key, v in md.items():
        if key == "general.architecture":
            continue
        name = key.rsplit(".", 1)[-1]
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if isinstance(v, (list, tuple)):
            v = [md_str(x) if isinstance(x, (bytes, bytearray)) else x for x in v]
            if key.endswith(".scores"):
                w.add_array(key, [float(x) for x in v])
            elif key.endswith(".token_type"):
                w.add_array(key, [int(x) for x in v])
            elif v:
                w.add_array(key, list(v))
        elif isinstance(v, bool) or name in _BOOL_KEYS:
            w.add_bool(key, bool(md_int(v) if not isinstance(v, bool) else v))
        elif isinstance(v, (int, np.integer)):
            (w.add_uint32 if 0 <= int(v) < 1 << 32 else w.add_int64)(key, int(v))
        elif isinstance(v, (float, np.floating)):
            w.add_float32(key, float(v))
        elif isinstance(v, (str, bytes, bytearray)):
            w.add_string(key, md_str(v) if not isinstance(v, str) else v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _vocab_from_metadata(md: Mapping[str, Any]):
    if md_str(md.get("tokenizer.ggml.model")) is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.model: no tokenizer in this file")
    with tempfile.TemporaryDirectory(prefix="kvflash-vocab-") as d:
        p = Path(d) / "vocab.gguf"
        _write_vocab_gguf(md, p)
        try:
            return _core().Vocab.load(str(p))
        except ValueError as e:
            raise ValueError(str(e).replace(str(p) + ": ", "")) from None


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


class Tokenizer:
    """Tokenizer described by GGUF ``tokenizer.*`` metadata: llama.cpp's (see the module docstring).

    Attributes: ``n_vocab``, ``bos_id``, ``eos_id``, ``unk_id``, ``pad_id`` (None when absent), ``eot_ids``
    (the ids that end generation: llama.cpp's end-of-generation set), ``add_bos``, ``add_eos``,
    ``add_space_prefix``, ``model`` ("llama", "gpt2" or "gemma4"), ``pre`` (the ``tokenizer.ggml.pre``
    value), ``tokens`` (vocabulary strings), ``token_types``, ``chat_template``.
    """

    def __init__(self, md: Mapping[str, Any], vocab: Any = None):
        """md: the GGUF's ``tokenizer.*`` metadata; vocab: its ``_core.Vocab`` (built from md when None)."""
        self._vocab = vocab if vocab is not None else _vocab_from_metadata(md)
        self._read_vocab(md)
        self._build_piece_table()
        self._chat_templates = ChatTemplates()

    def _read_vocab(self, md: Mapping[str, Any]) -> None:
        """The vocabulary strings and types (metadata), the special ids and flags (llama.cpp's, from the core)."""
        v = self._vocab
        self.model: str = v.model
        self.pre: str | None = md_str(md.get("tokenizer.ggml.pre"))
        n = v.n_vocab
        tokens = [md_str(t) if not isinstance(t, str) else t for t in md_list(md.get("tokenizer.ggml.tokens"))]
        if len(tokens) != n:  # the metadata given is not the vocabulary's: take the core's strings
            tokens = [v.token_text(i) for i in range(n)]
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = [int(x) for x in md_list(md.get("tokenizer.ggml.token_type"))][:n]
        if len(types) != n:
            types = [TOKEN_TYPE_NORMAL] * n
        self.tokens: list[str] = tokens
        self.token_types: list[int] = types
        self.n_vocab: int = n
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = v.bos_id, v.eos_id, v.unk_id, v.pad_id
        self.add_bos: bool = v.add_bos
        self.add_eos: bool = v.add_eos
        self.add_space_prefix: bool = v.add_space_prefix
        self.eot_ids: set[int] = self._end_of_turn_ids(md)
        self.chat_template: str | None = md_str(md.get("tokenizer.chat_template"))
        self._token_to_id = {t: i for i, t in enumerate(tokens)}

    def _end_of_turn_ids(self, md: Mapping[str, Any]) -> set[int]:
        """llama.cpp's end-of-generation ids, less the tokens the GGUF types as plain text that llama.cpp adds
        by their text alone (Qwen2's vocabulary has an ordinary "</s>" token, which llama.cpp at the pinned
        sdist makes a control token that ends generation): eos and the eot/eom ids always stay."""
        keep = {self.eos_id, md_int(md.get("tokenizer.ggml.eot_token_id")), md_int(md.get("tokenizer.ggml.eom_token_id"))}
        typed = bool(md_list(md.get("tokenizer.ggml.token_type")))
        return {i for i in self._vocab.eog_ids
                if i in keep or not typed or self.token_types[i] != TOKEN_TYPE_NORMAL}

    def _build_piece_table(self) -> None:
        """id -> bytes for decoding: llama.cpp's token_to_piece of every id; special (control/unknown) ids flagged."""
        v = self._vocab
        self._pieces: list[bytes] = v.pieces(True)
        self._special = np.fromiter((v.is_special(i) for i in range(self.n_vocab)), dtype=bool, count=self.n_vocab)
        self._has_specials = bool(self._special.any())

    # -- construction -------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a GGUF file's metadata (tensor data is never read)."""
        md = read_gguf_metadata(path, prefix="tokenizer.")
        if "tokenizer.ggml.model" not in md:
            raise ValueError(f"{os.fspath(path)}: GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        return cls(md, _core().Vocab.load(os.fspath(path)))

    @classmethod
    def from_model(cls, model: Any) -> "Tokenizer":
        """The tokenizer of a loaded ``_core.Model`` (the core builds it from the metadata it holds)."""
        md = read_gguf_metadata(model.path, prefix="tokenizer.")
        return cls(md, _core().Vocab.from_model(model))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF key -> value mapping (``read_gguf_metadata`` output, or one written by hand)."""
        return cls(md)

    # -- encode / decode ------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``, as llama.cpp's ``llama_tokenize`` gives them.

        ``add_special`` adds BOS/EOS as the model asks (``add_bos``/``add_eos``);
        ``parse_special`` lets control tokens written in the text (e.g.
        ``<|im_start|>``) become their ids.  User-defined tokens always match.
        """
        return self._vocab.encode(text, bool(add_special), bool(parse_special))

    def _strips_leading_space(self) -> bool:
        return self.add_space_prefix

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
        variables = {
            "bos_token": self.tokens[self.bos_id] if self.bos_id is not None else "",
            "eos_token": self.tokens[self.eos_id] if self.eos_id is not None else "",
            "unk_token": self.tokens[self.unk_id] if self.unk_id is not None else "",
            "pad_token": self.tokens[self.pad_id] if self.pad_id is not None else "",
        }
        variables.update(kwargs)
        return self._chat_templates.render(source, messages, add_generation_prompt, variables)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    *, chat_template: str | None = None, **kwargs: Any) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result, messages' content as text.

        The template's own markers (``<|im_start|>``, ``<|eot_id|>``, ...) become their special
        tokens; a special token's text written inside a message's ``content`` stays ordinary text
        tokens, so a message cannot close its turn or open another role's.  Where content holds no
        special-token text, the ids are ``encode(text, parse_special=True)``'s for the rendered text.
        BOS/EOS are added as ``encode(add_special=True)`` adds them, unless the rendered text
        already starts with the BOS token's text.

        How content is found in the rendered text: the template is rendered a second time with each
        content replaced by a unique marker, and the content put back where the markers landed must
        give the first rendering (content inserted as given, or stripped as Llama-3's ``| trim``
        does).  A template that changes content otherwise (``split``, a branch on the content's
        text) cannot be matched; then, when some content holds special-token text, the second
        rendering with the raw content in the markers' places is tokenized instead.
        """
        msgs = [dict(m) for m in messages]
        text = self.apply_chat_template(msgs, add_generation_prompt, chat_template=chat_template, **kwargs)
        bos = self.tokens[self.bos_id] if self.bos_id is not None else None
        add_special = not (bos is not None and text.startswith(bos))
        if not text or not self._has_specials:   # no special tokens in this vocabulary
            return self.encode(text, add_special=add_special)
        found = self._content_spans(msgs, text, add_generation_prompt, chat_template, kwargs)
        ids = self.encode(text, add_special=False, parse_special=True)
        if found is None or found[0] != text:
            # where the content is in the first rendering is unknown: keep it when no content holds a
            # special token's text, else tokenize the second rendering with the raw content put back
            contents = [m["content"] for m in msgs if isinstance(m.get("content"), str)]
            marks = {self.tokens[t] for _, _, t in self._special_marks(text, ids)}
            if found is None or not any(mk in c for mk in marks for c in contents):
                return self._wrap(ids, add_special)
            text, spans = found
            ids = self.encode(text, add_special=False, parse_special=True)
        else:
            spans = found[1]
        return self._wrap(self._ids_outside(text, spans, ids), add_special)

    def _special_marks(self, text: str, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """(start, end, id) in text of each special token of ``ids`` (text's parse_special encoding).

        llama.cpp cuts every occurrence of a special token's text out of the text before it tokenizes
        the rest, in order: the first occurrence past the previous special token is this one."""
        out, pos = [], 0
        for t in ids:
            if self._special[t]:
                s = self.tokens[t]
                a = text.find(s, pos)
                if a < 0:   # not written in the text (none is, today): no span to give
                    continue
                out.append((a, a + len(s), t))
                pos = a + len(s)
        return out

    def _wrap(self, ids: list[int], add_special: bool) -> list[int]:
        """BOS / EOS around ids, as encode(add_special=True) puts them."""
        out = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        out.extend(ids)
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _content_spans(self, msgs, text, add_generation_prompt, chat_template, kwargs):
        """(text, [(start, end), ...]): a rendering whose content spans are known, found as
        encode_chat says; the first rendering when it can be matched.  None when the second
        rendering fails or lost a marker."""
        import re
        import secrets
        nonce = secrets.token_hex(6)
        which = [i for i, m in enumerate(msgs) if isinstance(m.get("content"), str) and m["content"]]
        if not which:
            return text, []
        ws = set(which)
        marked = [dict(m, content=f"\ue000{nonce}:{i}\ue001") if i in ws else m for i, m in enumerate(msgs)]
        try:
            s = self.apply_chat_template(marked, add_generation_prompt, chat_template=chat_template, **kwargs)
        except Exception:
            return None
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", s)
        if len(pieces) == 1:
            return None

        def build(fix):
            out, spans, pos = [], [], 0
            for k, p in enumerate(pieces):
                if k % 2:
                    p = fix(msgs[int(p)]["content"])
                    spans.append((pos, pos + len(p)))
                out.append(p)
                pos += len(p)
            return "".join(out), spans

        raw = build(lambda c: c)
        if raw[0] == text:
            return raw
        stripped = build(str.strip)
        return stripped if stripped[0] == text else raw

    def _ids_outside(self, text: str, spans, ids) -> list[int]:
        """Ids for text where only the special tokens outside the content spans are special: the
        encoding as it is when none falls inside a span, else the text between the template's own
        special tokens encoded with the plain tokenizer."""
        def in_content(a, b):
            return any(a < e and s < b for s, e in spans)

        marks, injected = [], False
        for a, b, t in self._special_marks(text, ids):
            if in_content(a, b):
                injected = True
            else:
                marks.append((a, b, t))
        if not injected:
            return list(ids)
        out, pos = [], 0
        for a, b, t in marks:
            if a > pos:
                out.extend(self.encode(text[pos:a], add_special=False))
            out.append(t)
            pos = b
        if pos < len(text):
            out.extend(self.encode(text[pos:], add_special=False))
        return out

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


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
