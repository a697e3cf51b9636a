"""Tokenizer built from GGUF tokenizer metadata (llama.cpp conventions).

Encoding runs on the HuggingFace ``tokenizers`` library: the GGUF vocabulary is
turned into a ``tokenizers.models.BPE`` model (byte-level BPE for
``tokenizer.ggml.model == "gpt2"``, SentencePiece-style BPE with byte fallback
for ``"llama"``) with the pre-tokenizer split regexes llama.cpp uses for each
``tokenizer.ggml.pre`` family (:mod:`kvflash.pretokenizers`).

Decoding is a direct id -> bytes table, one path for ``decode``, streaming
(:class:`StreamDecoder`) and byte spans (``bytes_of``).  It stays hand-written
because ``tokenizers``' decoders do not reproduce llama.cpp: they return text,
never bytes (a token holding part of a UTF-8 character has no text of its own);
ByteFallback turns a run of byte tokens with one invalid byte into all U+FFFD where
llama.cpp keeps the valid bytes; ByteLevel byte-decodes user-defined tokens that
llama.cpp emits as written (deepseek's ``ü``); DecodeStream neither flushes nor
reports held-back bytes.

Metadata comes from ggml's GGUF reader (:mod:`kvflash.gguf_metadata`, through the
native extension); :meth:`Tokenizer.from_metadata` needs only numpy, tokenizers
and jinja2.  Chat templates: :mod:`kvflash.chat_template`.
"""
from __future__ import annotations

import codecs
import os
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

# Absolute imports: the tokenizer tests load this file directly, outside the package.
from kvflash.chat_template import ChatTemplates
from kvflash.gguf_metadata import md_int, md_list, md_str, read_gguf_metadata
from kvflash.pretokenizers import EOT_TEXTS, PRE_ALIASES, PRE_FAMILIES

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

# The longest SentencePiece piece whose merges are derived (see Tokenizer._build_spm).
SPM_MAX_PIECE_CHARS = 256

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


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

# Texts longer than this are encoded through encode_batch, which releases the GIL while it works (encode
# holds it): a server thread tokenizing a prompt of megabytes leaves the other threads, its event loop among
# them, running.  The same ids either way.
GIL_FREE_CHARS = 1 << 15


def _hf_encode(hf, text: str):
    if len(text) > GIL_FREE_CHARS:
        return hf.encode_batch([text], add_special_tokens=False)[0]
    return hf.encode(text, add_special_tokens=False)


class Tokenizer:
    """Tokenizer described by GGUF ``tokenizer.*`` metadata.

    Attributes: ``n_vocab``, ``bos_id``, ``eos_id``, ``eot_ids`` (eos and every
    token that ends a turn), ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``model`` ("gpt2" or "llama"), ``pre`` (the ``tokenizer.ggml.pre`` value),
    ``tokens`` (vocabulary strings), ``token_types``, ``chat_template``.
    """

    def __init__(self, md: Mapping[str, Any]):
        self._read_vocab(md)
        self._build_encoders(md)
        self.eot_ids: set[int] = self._end_of_turn_ids(md)
        self._build_piece_table()
        self._chat_templates = ChatTemplates()

    def _read_vocab(self, md: Mapping[str, Any]) -> None:
        """The vocabulary, its token types and the special ids."""
        model = md_str(md.get("tokenizer.ggml.model"))
        if model is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.model: no tokenizer in this file")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
        self.model = model
        tokens = [md_str(t) if not isinstance(t, str) else t
                  for t in md_list(md.get("tokenizer.ggml.tokens"))]
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        types = [int(x) for x in md_list(md.get("tokenizer.ggml.token_type"))] or [TOKEN_TYPE_NORMAL] * n
        if len(types) < n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        types = types[:n]
        self.tokens: list[str] = tokens
        self.token_types: list[int] = types
        self.n_vocab: int = n

        self.bos_id = md_int(md.get("tokenizer.ggml.bos_token_id"))
        self.eos_id = md_int(md.get("tokenizer.ggml.eos_token_id"))
        self.unk_id = md_int(md.get("tokenizer.ggml.unknown_token_id"))
        self.pad_id = md_int(md.get("tokenizer.ggml.padding_token_id"))
        for name in ("bos_id", "eos_id", "unk_id", "pad_id"):
            v = getattr(self, name)
            if v is not None and not (0 <= v < n):
                setattr(self, name, None)
        self.chat_template: str | None = md_str(md.get("tokenizer.chat_template"))

        token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):  # later duplicates win, as in llama.cpp
            token_to_id[t] = i
        self._token_to_id = token_to_id

    def _build_encoders(self, md: Mapping[str, Any]) -> None:
        """The ``tokenizers`` encoder for the model type and pre-tokenizer family, and the BOS/EOS/space flags."""
        from tokenizers import AddedToken

        model, tokens, types = self.model, self.tokens, self.token_types
        pre = md_str(md.get("tokenizer.ggml.pre"))
        self.pre = pre
        if model == "gpt2":
            family_name = PRE_ALIASES.get(pre or "default")
            if family_name is None:
                raise ValueError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) "
                                 "for tokenizer model 'gpt2'")
            family = PRE_FAMILIES[family_name]
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
            return default if v is None else bool(md_int(v) if not isinstance(v, bool) else v)

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

    def _end_of_turn_ids(self, md: Mapping[str, Any]) -> set[int]:
        """eos, the eot/eom ids, and the typed tokens whose text ends a turn."""
        n, types = self.n_vocab, self.token_types
        eot = set()
        if self.eos_id is not None:
            eot.add(self.eos_id)
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            v = md_int(md.get(key))
            if v is not None and 0 <= v < n:
                eot.add(v)
        # by text, as llama.cpp does, but only tokens that are not plain text
        # (Qwen2's vocabulary has an ordinary "</s>" token, for instance)
        typed = bool(md_list(md.get("tokenizer.ggml.token_type")))
        for t in EOT_TEXTS:
            i = self._token_to_id.get(t)
            if i is not None and (not typed or types[i] != TOKEN_TYPE_NORMAL):
                eot.add(i)
        return eot

    def _build_piece_table(self) -> None:
        """id -> bytes for decoding, as llama.cpp's token_to_piece; special (control/unknown) ids flagged."""
        self._special = np.zeros(self.n_vocab, dtype=bool)
        pieces: list[bytes] = []
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_types)):
            if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                self._special[i] = True
                pieces.append(t.encode("utf-8", "surrogateescape"))
            elif ty == TOKEN_TYPE_USER_DEFINED:
                pieces.append(t.encode("utf-8", "surrogateescape"))
            elif ty == TOKEN_TYPE_BYTE and _byte_token_value(t) is not None:
                pieces.append(bytes([_byte_token_value(t)]))
            elif ty == TOKEN_TYPE_NORMAL:
                if self.model == "llama" or not self._byte_encode:
                    pieces.append(t.replace(_SPM_SPACE, " ").encode("utf-8", "surrogateescape"))
                else:
                    pieces.append(self._byte_level_decode(t))
            else:  # undefined / unused: renders as nothing, like llama.cpp
                pieces.append(b"")
        self._pieces = pieces

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
        for m in md_list(md.get("tokenizer.ggml.merges")):
            m = m if isinstance(m, str) else md_str(m)
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
        scores = [float(s) for s in md_list(md.get("tokenizer.ggml.scores"))]
        if len(scores) < len(tokens):
            scores = scores + [0.0] * (len(tokens) - len(scores))
        # SentencePiece BPE as merges: every way to split a piece into two pieces
        # is a merge, ranked by the merged piece's score (higher merges first),
        # which is the order llama.cpp's SPM tokenizer applies them in.  That is
        # quadratic in a piece's length: pieces longer than SPM_MAX_PIECE_CHARS (real
        # ones are a few dozen characters; a hostile file can hold one of millions)
        # get no merges, so they never come out of encoding, and still decode.
        ranked = []
        for i, t in enumerate(tokens):
            if vocab.get(t) != i or len(t) < 2 or len(t) > SPM_MAX_PIECE_CHARS:
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
            ids.extend(_hf_encode(hf, text).ids)
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
        hf = self._hf_with_specials()
        if not text or hf is self._hf_plain:   # no special tokens in this vocabulary
            return self.encode(text, add_special=add_special)
        found = self._content_spans(msgs, text, add_generation_prompt, chat_template, kwargs)
        enc = _hf_encode(hf, text)
        if found is None or found[0] != text:
            # where the content is in the first rendering is unknown: keep it when no content holds a
            # special token's text, else tokenize the second rendering with the raw content put back
            contents = [m["content"] for m in msgs if isinstance(m.get("content"), str)]
            marks = {self.tokens[t] for t, (a, b) in zip(enc.ids, enc.offsets)
                     if self._special[t] and text[a:b] == self.tokens[t]}
            if found is None or not any(mk in c for mk in marks for c in contents):
                return self._wrap(enc.ids, add_special)
            text, spans = found
            enc = _hf_encode(hf, text)
        else:
            spans = found[1]
        return self._wrap(self._ids_outside(text, spans, enc), add_special)

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

    def _ids_outside(self, text: str, spans, enc) -> list[int]:
        """Ids for text where only the special tokens outside the content spans are special: the
        encoding as it is when none falls inside a span, else the text between the template's own
        special tokens encoded with the plain tokenizer."""
        def in_content(a, b):
            return any(a < e and s < b for s, e in spans)

        marks, injected = [], False
        for t, (a, b) in zip(enc.ids, enc.offsets):
            if self._special[t] and text[a:b] == self.tokens[t]:
                if in_content(a, b):
                    injected = True
                else:
                    marks.append((a, b, t))
        if not injected:
            return list(enc.ids)
        out, pos = [], 0
        for a, b, t in marks:
            if a > pos:
                out.extend(_hf_encode(self._hf_plain, text[pos:a]).ids)
            out.append(t)
            pos = b
        if pos < len(text):
            out.extend(_hf_encode(self._hf_plain, text[pos:]).ids)
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
