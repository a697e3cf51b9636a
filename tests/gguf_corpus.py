"""A corpus of corrupt GGUF files for the loader, from one small valid model.

    python tests/gguf_corpus.py OUT_DIR      # writes OUT_DIR/ok.gguf and OUT_DIR/bad-*.gguf

Every ``bad-*`` file must be refused by ``Model::load`` with an error (Python
ValueError, C status NULL with a message), never a crash; ``ok.gguf`` must load.
The files are written from a field-level description of the GGUF (v3) layout, so
each case breaks one thing: truncation inside every section, huge and negative
dimensions, overflowing and misaligned offsets, weight types kvflash does not
compute with, missing and mistyped hyper-parameters, zero heads, vocabulary
mismatches.  Only the standard library: the sanitizer leg of CI runs it with a
bare Python, and the fuzz bench seeds its corpus from it.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

# GGUF value types and the ggml tensor types used here (ggml.h, gguf.h).
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
T_F32, T_F16, T_Q4_0, T_Q8_0, T_I8, T_I16, T_I32, T_I64, T_F64 = 0, 1, 2, 8, 24, 25, 26, 27, 28
TYPE_BYTES = {T_F32: (4, 1), T_F16: (2, 1), T_Q4_0: (18, 32), T_Q8_0: (34, 32), T_I8: (1, 1), T_I16: (2, 1),
              T_I32: (4, 1), T_I64: (8, 1), T_F64: (8, 1)}
ALIGN = 32
N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_VOCAB = 64, 2, 1, 32, 64, 40


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _value(t: int, v) -> bytes:
    fmt = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
           F64: "d"}
    if t == STR:
        return _str(v if isinstance(v, bytes) else v.encode())
    if t == ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(_value(et, x) for x in items)
    return struct.pack("<" + fmt[t], v)


def base_kv() -> list:
    """(key, type, value) of the valid model, in file order."""
    a = "llama."
    return [("general.architecture", STR, "llama"), ("general.alignment", U32, ALIGN),
            (a + "block_count", U32, 1), (a + "context_length", U32, 256), (a + "embedding_length", U32, N_EMBD),
            (a + "feed_forward_length", U32, N_FF), (a + "attention.head_count", U32, N_HEAD),
            (a + "attention.head_count_kv", U32, N_HEAD_KV), (a + "attention.key_length", U32, HEAD_DIM),
            (a + "attention.value_length", U32, HEAD_DIM), (a + "rope.dimension_count", U32, HEAD_DIM),
            (a + "attention.layer_norm_rms_epsilon", F32, 1e-5), (a + "rope.freq_base", F32, 10000.0),
            (a + "vocab_size", U32, N_VOCAB)]


def base_tensors() -> list:
    """[name, dims (ggml order), type] of the valid model."""
    E, F, Q, K = N_EMBD, N_FF, N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    b = "blk.0."
    return [["token_embd.weight", [E, N_VOCAB], T_F32], ["output_norm.weight", [E], T_F32],
            [b + "attn_norm.weight", [E], T_F32], [b + "attn_q.weight", [E, Q], T_F32],
            [b + "attn_k.weight", [E, K], T_F32], [b + "attn_v.weight", [E, K], T_F32],
            [b + "attn_output.weight", [Q, E], T_F32], [b + "ffn_norm.weight", [E], T_F32],
            [b + "ffn_gate.weight", [E, F], T_F32], [b + "ffn_up.weight", [E, F], T_F32],
            [b + "ffn_down.weight", [F, E], T_F32]]


def _nbytes(dims, t) -> int:
    size, blck = TYPE_BYTES.get(t, (4, 1))
    n = 1
    for d in dims:
        n *= max(d, 0)
    return n // blck * size


def _pad(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def build(kv=None, tensors=None, *, version=3, offsets=None, n_tensors=None, n_kv=None, data_bytes=None,
          raw_kv: bytes = b"", raw_dims=None) -> bytes:
    """The file's bytes.  offsets: per-tensor overrides; n_tensors / n_kv: the header's
    counts (default: the real ones); data_bytes: the data section (default: small
    deterministic values, each tensor padded); raw_kv: appended key/value bytes;
    raw_dims: {tensor index: (n_dims, [u64 dims])} written as they are."""
    kv = base_kv() if kv is None else kv
    tensors = base_tensors() if tensors is None else tensors
    out = bytearray(b"GGUF" + struct.pack("<I", version))
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                       len(kv) + (1 if raw_kv else 0) if n_kv is None else n_kv)
    for k, t, v in kv:
        out += _str(k.encode()) + struct.pack("<I", t) + _value(t, v)
    out += raw_kv
    off = 0
    data = bytearray()
    for i, (name, dims, t) in enumerate(tensors):
        nd, ds = (raw_dims or {}).get(i, (len(dims), dims))
        out += _str(name.encode()) + struct.pack("<I", nd) + b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in ds)
        o = off if offsets is None or i not in offsets else offsets[i]
        out += struct.pack("<IQ", t, o & (2**64 - 1))
        nb = _nbytes(dims, t)
        if nb < (1 << 24):
            chunk = bytes((j * 37 + i * 11) % 7 for j in range(nb)) if t != T_F32 else \
                b"".join(struct.pack("<f", ((j * 37 + i * 11) % 17 - 8) / 64.0) for j in range(nb // 4))
            data += chunk + bytes(_pad(nb) - nb)
        off += _pad(nb)
    out += bytes(_pad(len(out)) - len(out))
    out += data if data_bytes is None else data_bytes
    return bytes(out)


def _set(kv, key, t=None, v=None, *, drop=False):
    out = []
    for k, kt, kvv in kv:
        if k == key:
            if drop:
                continue
            out.append((k, kt if t is None else t, kvv if v is None else v))
        else:
            out.append((k, kt, kvv))
    return out


def _tensor(tensors, name, dims=None, t=None):
    for x in tensors:
        if x[0] == name:
            if dims is not None:
                x[1] = dims
            if t is not None:
                x[2] = t
    return tensors


def cases() -> dict:
    """name -> bytes of every corrupt file (and 'ok': the valid one)."""
    ok = build()
    c = {"ok": ok}
    # -- truncation inside every section (header, first key, a value, tensor infos, padding, data)
    kv_end = 24 + sum(len(_str(k.encode())) + 4 + len(_value(t, v)) for k, t, v in base_kv())
    ti_end = len(build(data_bytes=b"").rstrip(b"\0"))
    data_start = _pad(ti_end)
    for name, cut in [("trunc-magic", 2), ("trunc-version", 6), ("trunc-counts", 16), ("trunc-first-key-len", 27),
                      ("trunc-in-key", 24 + 8 + 5), ("trunc-in-value", kv_end - 2), ("trunc-after-kv", kv_end),
                      ("trunc-in-tensor-info", kv_end + 20), ("trunc-in-padding", ti_end + 1),
                      ("trunc-before-data", data_start), ("trunc-in-data", data_start + (len(ok) - data_start) // 2),
                      ("trunc-last-byte", len(ok) - 1)]:
        assert 0 < cut < len(ok), name
        c[name] = ok[:cut]
    # -- header
    c["version-1"] = build(version=1)
    c["version-99"] = build(version=99)
    c["n-tensors-huge"] = build(n_tensors=2**62)
    c["n-kv-huge"] = build(n_kv=2**62)
    c["n-tensors-more"] = build(n_tensors=len(base_tensors()) + 1)
    c["string-len-huge"] = build(raw_kv=_str(b"x")[:0] + struct.pack("<Q", 2**63) + b"key")
    c["array-count-huge"] = build(raw_kv=_str(b"a.arr") + struct.pack("<IIQ", ARR, U32, 2**61))
    c["kv-type-unknown"] = build(raw_kv=_str(b"a.bad") + struct.pack("<I", 77) + b"\0" * 8)
    c["alignment-zero"] = build(kv=_set(base_kv(), "general.alignment", v=0))
    c["alignment-3"] = build(kv=_set(base_kv(), "general.alignment", v=3))
    c["duplicate-key"] = build(kv=base_kv() + [("llama.block_count", U32, 1)])
    t = base_tensors()
    c["duplicate-tensor"] = build(tensors=t + [list(t[1])])
    c["tensor-name-long"] = build(tensors=_rename(base_tensors(), "output_norm.weight", "o" * 200))
    # -- dimensions
    c["dims-huge"] = build(tensors=_tensor(base_tensors(), "token_embd.weight", dims=[N_EMBD, 2**40]))
    c["dims-overflow"] = build(raw_dims={0: (2, [2**62, 2**62])})
    c["dims-negative"] = build(raw_dims={1: (1, [-32])})
    c["dims-zero"] = build(raw_dims={1: (1, [0])})
    c["n-dims-5"] = build(raw_dims={1: (5, [N_EMBD, 1, 1, 1, 1])})
    c["n-dims-huge"] = build(raw_dims={1: (2**31, [N_EMBD])})
    c["vocab-over-int32"] = build(tensors=_tensor(base_tensors(), "token_embd.weight", dims=[N_EMBD, 2**31 + 8]))
    # -- offsets
    c["offset-wraps"] = build(offsets={3: 2**64 - 64})
    c["offset-past-eof"] = build(offsets={10: 1 << 30})
    c["offset-misaligned"] = build(offsets={2: 4})
    c["offset-overlap"] = build(offsets={3: 0})
    # -- tensor types
    for name, tname, ty in [("attn-norm-q8_0", "blk.0.attn_norm.weight", T_Q8_0),
                            ("attn-norm-f16", "blk.0.attn_norm.weight", T_F16),
                            ("wq-i8", "blk.0.attn_q.weight", T_I8), ("wk-i32", "blk.0.attn_k.weight", T_I32),
                            ("wv-f64", "blk.0.attn_v.weight", T_F64), ("ffn-up-i16", "blk.0.ffn_up.weight", T_I16),
                            ("embd-i64", "token_embd.weight", T_I64), ("type-unknown", "blk.0.ffn_down.weight", 200),
                            ("type-removed-q4_2", "blk.0.ffn_gate.weight", 4)]:
        c[name] = build(tensors=_tensor(base_tensors(), tname, t=ty))
    # -- hyper-parameters: missing, mistyped, out of range
    for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.attention.head_count", "llama.attention.layer_norm_rms_epsilon"):
        c["missing-" + key.split(".", 1)[1].replace(".", "-")] = build(kv=_set(base_kv(), key, drop=True))
    for name, key, t, v in [("arch-u32", "general.architecture", U32, 7), ("arch-unknown", "general.architecture", STR, "mamba"),
                            ("block-count-str", "llama.block_count", STR, "1"),
                            ("block-count-array", "llama.block_count", ARR, (U32, [1, 2])),
                            ("embd-f32", "llama.embedding_length", F32, 32.0),
                            ("head-count-zero", "llama.attention.head_count", U32, 0),
                            ("head-count-kv-zero", "llama.attention.head_count_kv", U32, 0),
                            ("head-count-kv-3", "llama.attention.head_count_kv", U32, 3),
                            ("block-count-zero", "llama.block_count", U32, 0),
                            ("block-count-huge", "llama.block_count", U32, 10**6),
                            ("block-count-wraps-int32", "llama.block_count", U64, 2**32 + 1),
                            ("embd-negative", "llama.embedding_length", I32, -32),
                            ("key-length-zero", "llama.attention.key_length", U32, 0),
                            ("context-zero", "llama.context_length", U32, 0),
                            ("rms-eps-negative", "llama.attention.layer_norm_rms_epsilon", F32, -1.0),
                            ("rms-eps-nan", "llama.attention.layer_norm_rms_epsilon", F32, float("nan")),
                            ("rope-base-nan", "llama.rope.freq_base", F32, float("nan")),
                            ("rope-base-inf", "llama.rope.freq_base", F64, float("inf")),
                            ("rope-dims-partial", "llama.rope.dimension_count", U32, 16),
                            ("rope-scaling-yarn", "llama.rope.dimension_count", U32, HEAD_DIM)]:
        kv = _set(base_kv(), key, t, v)
        if name == "rope-scaling-yarn":
            kv = kv + [("llama.rope.scaling.type", STR, "yarn")]
        c[name] = build(kv=kv)
    # -- vocabulary
    c["vocab-size-mismatch"] = build(kv=_set(base_kv(), "llama.vocab_size", v=N_VOCAB + 1))
    c["output-vocab-mismatch"] = build(tensors=base_tensors() + [["output.weight", [N_EMBD, N_VOCAB + 8], T_F32]])
    c["embd-width-mismatch"] = build(tensors=_tensor(base_tensors(), "token_embd.weight", dims=[N_EMBD * 2, N_VOCAB]))
    c["embd-1d"] = build(tensors=_tensor(base_tensors(), "token_embd.weight", dims=[N_EMBD * N_VOCAB]))
    c["missing-tensor"] = build(tensors=[x for x in base_tensors() if x[0] != "blk.0.ffn_down.weight"])
    c["wrong-shape"] = build(tensors=_tensor(base_tensors(), "blk.0.attn_k.weight", dims=[N_EMBD, 2 * HEAD_DIM]))
    c["empty-file"] = b""
    c["not-gguf"] = b"GGML" + ok[4:]
    return c


def _rename(tensors, old, new):
    for x in tensors:
        if x[0] == old:
            x[0] = new
    return tensors


def write_vocab_over_int32(path) -> Path:
    """A file whose token_embd has 2^31 + 8 rows and whose bytes are all there: the
    tensor is last and the file is extended sparsely to its full (512 GiB) size, so only
    the vocabulary's range can refuse it.  Not part of the corpus (too large to copy)."""
    t = [x for x in base_tensors() if x[0] != "token_embd.weight"] + [["token_embd.weight", [N_EMBD, 2**31 + 8], T_F32]]
    kv = _set(base_kv(), "llama.vocab_size", drop=True)  # optional: only token_embd says how many
    head = build(kv=kv, tensors=t)
    size = len(build(kv=kv, tensors=t, data_bytes=b"")) + sum(_pad(_nbytes(d, ty)) for _, d, ty in t)
    p = Path(path)
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(size)
    return p


def write(out_dir) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, blob in cases().items():
        p = out / (name + ".gguf" if name == "ok" else "bad-" + name + ".gguf")
        p.write_bytes(blob)
        paths.append(p)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ps = write(sys.argv[1])
    print(f"{len(ps)} files ({sum(p.name.startswith('bad-') for p in ps)} corrupt) in {sys.argv[1]}")
