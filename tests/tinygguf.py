"""Tiny random-weight GGUF model writer for tests.

Writes complete, llama.cpp-loadable GGUF files for the architectures ``llama``,
``qwen2``, ``qwen3`` and ``gemma3`` using the pip ``gguf`` package's
``GGUFWriter`` (the MoE and hybrid families: :func:`write_tiny_hybrid`; gpt-oss:
:func:`write_tiny_gptoss`; laguna: :func:`write_tiny_laguna`; gemma4: :func:`write_tiny_gemma4`,
below).  Tensor names, shapes and metadata keys follow llama.cpp (vendored in llama_cpp_python-0.3.36, ``vendor/llama.cpp``):

Tensor names (src/llama-arch.cpp, LLM_TENSOR_NAMES; gguf.constants.TENSOR_NAMES)::

    token_embd.weight              ne=[n_embd, n_vocab]
    output_norm.weight             ne=[n_embd]
    output.weight                  ne=[n_embd, n_vocab]   (absent when tied)
    blk.N.attn_norm.weight         ne=[n_embd]
    blk.N.attn_q.weight            ne=[n_embd, n_head*head_dim]
    blk.N.attn_k.weight            ne=[n_embd, n_head_kv*head_dim]
    blk.N.attn_v.weight            ne=[n_embd, n_head_kv*head_dim]
    blk.N.attn_q.bias / attn_k.bias / attn_v.bias        (qwen2 only)
    blk.N.attn_q_norm.weight / attn_k_norm.weight  ne=[head_dim] (qwen3, gemma3)
    blk.N.attn_output.weight       ne=[n_head*head_dim, n_embd]
    blk.N.post_attention_norm.weight  ne=[n_embd]          (gemma3)
    blk.N.ffn_norm.weight          ne=[n_embd]
    blk.N.ffn_gate.weight          ne=[n_embd, n_ff]
    blk.N.ffn_up.weight            ne=[n_embd, n_ff]
    blk.N.ffn_down.weight          ne=[n_ff, n_embd]
    blk.N.post_ffw_norm.weight     ne=[n_embd]              (gemma3)

(shapes given in ggml ``ne`` order as used by ``create_tensor`` in
src/models/{llama,qwen2,qwen3,gemma3}.cpp; numpy arrays returned by
:func:`write_tiny_model` use the reversed, row-major shape, e.g.
``token_embd.weight`` has numpy shape ``(n_vocab, n_embd)`` and
``attn_q.weight`` has shape ``(n_head*head_dim, n_embd)`` so that
``q = x @ W.T``.)

Tensor storage types follow convert_hf_to_gguf: 1-D tensors (norm weights,
biases) are always F32; 2-D matrices are F32 or F16 per ``weight_type``.

Metadata (src/llama-arch.cpp LLM_KV_NAMES, read in src/llama-model.cpp
``load_hparams`` and the per-arch ``load_arch_hparams``)::

    general.architecture, general.name, general.file_type
    {arch}.context_length, .embedding_length, .block_count,
    .feed_forward_length, .attention.head_count, .attention.head_count_kv,
    .attention.key_length, .attention.value_length   (always written)
    .attention.layer_norm_rms_epsilon, .rope.freq_base
    llama : .rope.dimension_count (= head_dim, llama.cpp requires n_rot == head_dim
            for LLM_ARCH_LLAMA), .vocab_size
    gemma3: .attention.sliding_window (only if gemma_sliding_window > 0),
            .rope.freq_base_swa (local rope base, written by the current
            converter from ``rope_local_base_freq``; llama.cpp's default when
            absent is 10000, src/llama-hparams.h rope_freq_base_train_swa),
            optional .attention.sliding_window_pattern, .final_logit_softcapping

Tokenizer: byte-level "gpt2" BPE vocab with ``tokenizer.ggml.pre = "default"``:
256 byte tokens (GPT-2 ``bytes_to_unicode`` spelling, token id == byte value),
a handful of merged tokens (llama.cpp requires a non-empty merges array for
gpt2 vocabs, src/llama-vocab.cpp, and GGUFWriter silently drops empty arrays),
then ``<|bos|>`` and ``<|eos|>`` control tokens, then optional
``<|reserved_N|>`` control tokens to pad up to the requested ``n_vocab``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import gguf

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# GGUF rope "mode" per arch, from llama_model_rope_type() in src/llama-model.cpp:
# LLM_ARCH_LLAMA -> LLAMA_ROPE_TYPE_NORM; QWEN2/QWEN3/GEMMA3 -> LLAMA_ROPE_TYPE_NEOX.
ROPE_TYPE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}

# Merged BPE tokens (pairs of byte-level token strings).  "Ġ" is the
# bytes_to_unicode spelling of the space byte 0x20.
_MERGES = [("Ġ", "t"), ("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"),
           ("a", "n"), ("Ġ", "a"), ("o", "n")]
N_BASE_TOKENS = 256 + len(_MERGES) + 2  # bytes + merges + bos + eos


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping (the product's table; the
    tokenizer tests check it against real vocabularies)."""
    from kvflash.tokenizer import _bytes_to_unicode
    return _bytes_to_unicode()


def make_vocab(n_vocab: int | None = None) -> dict[str, Any]:
    """Build the byte-level gpt2 vocab. Returns tokens, token_types, merges, bos_id, eos_id."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [int(gguf.TokenType.NORMAL)] * 256
    merges = []
    for a, b in _MERGES:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(int(gguf.TokenType.NORMAL))
    bos_id = len(tokens)
    tokens.append("<|bos|>")
    types.append(int(gguf.TokenType.CONTROL))
    eos_id = len(tokens)
    tokens.append("<|eos|>")
    types.append(int(gguf.TokenType.CONTROL))
    assert len(tokens) == N_BASE_TOKENS
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab={n_vocab} < minimum tokenizer size {len(tokens)}")
        i = 0
        while len(tokens) < n_vocab:
            tokens.append(f"<|reserved_{i}|>")
            types.append(int(gguf.TokenType.CONTROL))
            i += 1
    assert len(set(tokens)) == len(tokens)
    return {"tokens": tokens, "token_types": types, "merges": merges,
            "bos_id": bos_id, "eos_id": eos_id}


def swa_layers(n_layer: int, n_swa: int, pattern: int | list[bool] | None = None) -> list[bool]:
    """Which layers use sliding-window attention, as llama.cpp computes it for gemma3.

    src/models/gemma3.cpp: if ``{arch}.attention.sliding_window`` is present and >0,
    swa_type = LLAMA_SWA_TYPE_STANDARD and ``load_swa_pattern(ml, 6)``; that reads
    ``attention.sliding_window_pattern`` as a per-layer bool array, else as a
    uint32 period (default 6) expanded by ``llama_hparams::set_swa_pattern``
    (src/llama-hparams.cpp, dense_first=false):
    ``is_swa[il] = n_pattern == 0 || il % n_pattern < n_pattern - 1``
    i.e. with period 6 layers 5, 11, 17, ... ((il+1) % 6 == 0) are global.
    Without a sliding window all layers are global (swa_type NONE).
    """
    if not n_swa:
        return [False] * n_layer
    if pattern is None:
        pattern = 6
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layer:
            raise ValueError("per-layer sliding_window_pattern must have n_layer entries")
        return [bool(x) for x in pattern]
    p = int(pattern)
    return [p == 0 or (il % p) < (p - 1) for il in range(n_layer)]


def _add_extra_kv(w: gguf.GGUFWriter, key: str, val: Any) -> None:
    if isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, int):
        w.add_uint32(key, val) if val >= 0 else w.add_int32(key, val)
    elif isinstance(val, float):
        w.add_float32(key, val)
    elif isinstance(val, str):
        w.add_string(key, val)
    elif isinstance(val, (list, tuple)):
        w.add_array(key, list(val))
    else:
        raise TypeError(f"unsupported metadata value for {key}: {type(val)}")


def _write_tokenizer(w: gguf.GGUFWriter, vocab: dict[str, Any], n_vocab: int,
                     tokenizer_size: int | None = None,
                     tokenizer_extra_merges: list[tuple[str, str]] | None = None, pre: str = "default") -> None:
    """The byte-level BPE tokenizer of make_vocab (optionally cut short or with extra merges)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    tok_list, tok_types, tok_merges = list(vocab["tokens"]), list(vocab["token_types"]), list(vocab["merges"])
    if tokenizer_size is not None:
        if not vocab["eos_id"] < tokenizer_size <= n_vocab:
            raise ValueError(f"tokenizer_size must be in ({vocab['eos_id']}, {n_vocab}]")
        tok_list, tok_types = tok_list[:tokenizer_size], tok_types[:tokenizer_size]
    for a, b in tokenizer_extra_merges or []:
        if a not in tok_list or b not in tok_list or a + b in tok_list:
            raise ValueError(f"extra merge {a!r} + {b!r}: both parts must be tokens, the result a new one")
        tok_merges.append(f"{a} {b}")
        tok_list.append(a + b)
        tok_types.append(int(gguf.TokenType.NORMAL))
    w.add_token_list(tok_list)
    w.add_token_types(tok_types)
    w.add_token_merges(tok_merges)
    w.add_bos_token_id(vocab["bos_id"])
    w.add_eos_token_id(vocab["eos_id"])
    w.add_add_bos_token(True)


def _write_tensors(w: gguf.GGUFWriter, file_arrays: dict[str, Any]) -> None:
    """Add every tensor (ndarray, or (raw bytes, quant type)) and write the file."""
    for name, a in file_arrays.items():
        if isinstance(a, tuple):
            w.add_tensor(name, a[0], raw_dtype=a[1])
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Long on purpose: every key and tensor of the file, in the order it is written.
def write_tiny_model(
    path: str | Path,
    arch: str,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 16,
    n_ff: int = 128,
    n_vocab: int | None = None,
    ctx_len: int = 4096,
    seed: int = 0,
    weight_type: str = "f32",
    tie_embeddings: bool = True,
    rope_base: float = 10000.0,
    rms_eps: float = 1e-6,
    gemma_sliding_window: int = 8,
    gemma_rope_base_swa: float | None = 10000.0,
    gemma_swa_pattern: int | list[bool] | None = None,
    final_logit_softcapping: float | None = None,
    weight_scale: float = 1.0,
    extra: dict[str, Any] | None = None,
    tokenizer_size: int | None = None,
    tokenizer_extra_merges: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """Write a tiny random-weight GGUF model and return its exact weights.

    Returns ``{"weights": {gguf_tensor_name: float64 ndarray}, "hparams": {...},
    "vocab": {...}, "path": str}``.  Weights are the values exactly as stored in
    the file (i.e. already rounded to f16/f32), in numpy row-major shape
    (reverse of GGUF ``ne``).  ``hparams`` is what :class:`reference.RefModel`
    consumes (same dict as ``reference.hparams_from_gguf`` reads back).

    n_vocab: ``None`` -> tokenizer size (266); larger values are padded with
    ``<|reserved_N|>`` control tokens.  ``gemma_sliding_window``: window for
    gemma3 SWA layers (0/None disables SWA: all layers global).
    ``gemma_rope_base_swa``: value written to ``gemma3.rope.freq_base_swa``
    (``None`` = key omitted, llama.cpp then uses 10000).  ``extra``: additional
    metadata key/values written verbatim (bool/int/float/str/list).

    A tokenizer that disagrees with the model (hostile or mistaken files):
    ``tokenizer_size`` writes only the first N tokens of the vocabulary (the
    model keeps its n_vocab embedding rows, so the ids from N on have no text);
    ``tokenizer_extra_merges`` appends merged tokens (pairs of existing token
    strings) to the tokenizer only, after the model's last id, so text can encode
    to ids the model has no embedding for.

    Weight init (so activations stay O(1) and logits / attention are not
    degenerate): matrices ~ N(0, (weight_scale/sqrt(fan_in))^2), token embedding
    std 0.3 (gemma3: 1/sqrt(n_embd) since llama.cpp multiplies by sqrt(n_embd)),
    untied output std 0.3,
    norm weights 1 + N(0, 0.1^2) (gemma3 GGUFs store the HF weight + 1 already —
    conversion/gemma.py Gemma3Model.norm_shift — so they are used as-is),
    qwen2 biases N(0, 0.2^2).
    """
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {ARCHS}")
    quant = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q5_0": gguf.GGMLQuantizationType.Q5_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_K": gguf.GGMLQuantizationType.Q4_K,
             "q6_K": gguf.GGMLQuantizationType.Q6_K}
    if weight_type not in ("f32", "f16", *quant):
        raise ValueError(f"weight_type must be 'f32', 'f16' or one of {sorted(quant)}")
    block = 256 if weight_type.endswith("_K") else 32
    if weight_type in quant and (n_embd % block or n_ff % block or (n_head * head_dim) % block):
        raise ValueError(f"{weight_type} weights need n_embd, n_ff and n_head*head_dim multiples of {block}")
    if n_head % n_head_kv != 0:
        raise ValueError("n_head must be a multiple of n_head_kv")
    if head_dim % 2 != 0:
        raise ValueError("head_dim must be even (RoPE)")
    if arch == "qwen2" and n_head * head_dim != n_embd:
        # src/models/qwen2.cpp creates attn_q as {n_embd, n_embd} and attn_output as {n_embd, n_embd}
        raise ValueError("qwen2 in llama.cpp requires n_head*head_dim == n_embd")

    vocab = make_vocab(n_vocab)
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    np_wtype = np.float16 if weight_type == "f16" else np.float32
    n_q = n_head * head_dim
    n_kv = n_head_kv * head_dim

    weights: dict[str, np.ndarray] = {}
    file_arrays: dict[str, np.ndarray] = {}

    def mat(name: str, rows: int, cols: int, std: float) -> None:
        a = (rng.standard_normal((rows, cols)) * std).astype(np_wtype)
        if weight_type in quant:   # stored quantized; the exact weights are the dequantized values
            if weight_type.endswith("_K"):   # gguf-py cannot quantize K-quants: ggml's own, through kvflash
                from kvflash import _core
                q = _core.quantize_rows(a, weight_type)
            else:
                q = gguf.quants.quantize(a, quant[weight_type])
            file_arrays[name] = (q, quant[weight_type])
            weights[name] = gguf.quants.dequantize(q, quant[weight_type]).astype(np.float64)
            return
        file_arrays[name] = a
        weights[name] = a.astype(np.float64)

    def vec(name: str, n: int, mean: float, std: float) -> None:
        a = (mean + rng.standard_normal(n) * std).astype(np.float32)
        file_arrays[name] = a
        weights[name] = a.astype(np.float64)

    s = weight_scale
    emb_std = 1.0 / math.sqrt(n_embd) if arch == "gemma3" else 0.3
    mat("token_embd.weight", n_vocab, n_embd, emb_std)
    vec("output_norm.weight", n_embd, 1.0, 0.1)
    if not tie_embeddings:
        mat("output.weight", n_vocab, n_embd, 0.3)
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", n_embd, 1.0, 0.1)
        mat(p + "attn_q.weight", n_q, n_embd, s / math.sqrt(n_embd))
        mat(p + "attn_k.weight", n_kv, n_embd, s / math.sqrt(n_embd))
        mat(p + "attn_v.weight", n_kv, n_embd, s / math.sqrt(n_embd))
        if arch == "qwen2":
            vec(p + "attn_q.bias", n_q, 0.0, 0.2)
            vec(p + "attn_k.bias", n_kv, 0.0, 0.2)
            vec(p + "attn_v.bias", n_kv, 0.0, 0.2)
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", head_dim, 1.0, 0.1)
            vec(p + "attn_k_norm.weight", head_dim, 1.0, 0.1)
        mat(p + "attn_output.weight", n_embd, n_q, s / math.sqrt(n_q))
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", n_embd, 1.0, 0.1)
        vec(p + "ffn_norm.weight", n_embd, 1.0, 0.1)
        mat(p + "ffn_gate.weight", n_ff, n_embd, s / math.sqrt(n_embd))
        mat(p + "ffn_up.weight", n_ff, n_embd, s / math.sqrt(n_embd))
        mat(p + "ffn_down.weight", n_embd, n_ff, s / math.sqrt(n_ff))
        if arch == "gemma3":
            vec(p + "post_ffw_norm.weight", n_embd, 1.0, 0.1)

    # ---- metadata -------------------------------------------------------
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)  # writes general.architecture
    w.add_name(f"tiny-{arch}")
    w.add_file_type(int({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                         "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                         "q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q6_K": gguf.LlamaFileType.MOSTLY_Q6_K}
                        .get(weight_type, gguf.LlamaFileType.ALL_F32)))
    if ctx_len < 2**32:
        w.add_context_length(ctx_len)
    else:  # a context_length past 32 bits, as a hostile or mistaken GGUF may declare
        w.add_uint64(f"{arch}.context_length", ctx_len)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(n_vocab)
    n_swa = 0
    if arch == "gemma3":
        if gemma_sliding_window:
            n_swa = int(gemma_sliding_window)
            w.add_sliding_window(n_swa)
            if gemma_swa_pattern is not None:
                w.add_sliding_window_pattern(gemma_swa_pattern)
        if gemma_rope_base_swa is not None:
            w.add_rope_freq_base_swa(gemma_rope_base_swa)
        if final_logit_softcapping:
            w.add_final_logit_softcapping(final_logit_softcapping)
    elif final_logit_softcapping:
        raise ValueError("final_logit_softcapping is only read by llama.cpp for gemma3 here")

    _write_tokenizer(w, vocab, n_vocab, tokenizer_size, tokenizer_extra_merges)

    for k, v in (extra or {}).items():
        _add_extra_kv(w, k, v)

    _write_tensors(w, file_arrays)

    # ---- hparams as llama.cpp derives them ---------------------------------
    if arch == "gemma3":
        is_swa = swa_layers(n_layer, n_swa, gemma_swa_pattern)
        rope_base_swa = 10000.0 if gemma_rope_base_swa is None else float(gemma_rope_base_swa)
    else:
        is_swa = [False] * n_layer
        rope_base_swa = 10000.0
    hparams = make_hparams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, ctx_len=ctx_len, rms_eps=rms_eps,
        rope_base=rope_base, rope_base_swa=rope_base_swa, n_swa=n_swa, is_swa=is_swa,
        final_logit_softcapping=final_logit_softcapping or 0.0,
        tie_embeddings=tie_embeddings, bos_id=vocab["bos_id"], eos_id=vocab["eos_id"],
    )
    return {"weights": weights, "hparams": hparams, "vocab": vocab, "path": str(path)}


def make_hparams(*, arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                 head_dim: int, n_ff: int, n_vocab: int, ctx_len: int, rms_eps: float,
                 rope_base: float, rope_base_swa: float, n_swa: int, is_swa: list[bool],
                 final_logit_softcapping: float, tie_embeddings: bool,
                 bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """Assemble the derived hparams dict (shared by writer and GGUF reader).

    attn_scale: llama/qwen2/qwen3 use kq_scale = 1/sqrt(head_dim)
    (src/models/{llama,qwen2,qwen3}.cpp; llama: f_attention_scale is 0 -> 1/sqrt).
    gemma3 (src/models/gemma3.cpp load_arch_hparams): f_attention_scale =
    1/sqrt(n_embd/n_head) for the 27B type (n_layer == 62) else 1/sqrt(head_dim);
    query_pre_attn_scalar is NOT read by llama.cpp.  gemma3 input embeddings are
    scaled by sqrtf(n_embd).
    """
    if arch == "gemma3":
        if n_layer == 62:
            attn_scale = 1.0 / math.sqrt(float(n_embd // n_head))
        else:
            attn_scale = 1.0 / math.sqrt(float(head_dim))
        embd_scale = math.sqrt(float(n_embd))
    else:
        attn_scale = 1.0 / math.sqrt(float(head_dim))
        embd_scale = 1.0
    return {
        "arch": arch, "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head,
        "n_head_kv": n_head_kv, "head_dim": head_dim, "n_ff": n_ff, "n_vocab": n_vocab,
        "ctx_len": ctx_len,
        # GGUF stores these as float32 and llama.cpp uses the float32 values
        "rms_eps": float(np.float32(rms_eps)), "rope_base": float(np.float32(rope_base)),
        "rope_base_swa": float(np.float32(rope_base_swa)), "rope_type": ROPE_TYPE[arch],
        "n_rot": head_dim, "n_swa": int(n_swa), "is_swa": list(is_swa),
        "attn_scale": attn_scale, "embd_scale": embd_scale,
        "final_logit_softcapping": float(np.float32(final_logit_softcapping or 0.0)),
        "ffn_act": "gelu_tanh" if arch == "gemma3" else "silu",
        "tie_embeddings": bool(tie_embeddings), "bos_id": bos_id, "eos_id": eos_id,
    }


def write_small_llama(path: str | Path, seed: int) -> str:
    """The 2-layer llama (128 wide, GQA 4:2, head dim 32, f32) the policy, device and bench tests share."""
    write_tiny_model(str(path), "llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                     weight_type="f32", seed=seed)
    return str(path)


# A plain "role: content" chat template, for tests that go through chat() on a tiny model.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def write_tiny_chat_model(path: str | Path, *, seed: int, **kw) -> None:
    """A 2-layer f32 llama (n_embd 128, 4 heads, 2 KV heads) with PLAIN_CHAT_TEMPLATE."""
    write_tiny_model(path, "llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, weight_type="f32",
                     seed=seed, extra={"tokenizer.chat_template": PLAIN_CHAT_TEMPLATE}, **kw)


HYBRID_ARCHS = ("qwen3moe", "qwen35", "qwen35moe")


def write_tiny_hybrid(
    path: str | Path,
    arch: str,
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_rot: int | None = None,
    n_ff: int = 96,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_ff_shexp: int = 48,
    full_attention_interval: int = 4,
    ssm_d_conv: int = 4,
    ssm_d_state: int = 16,
    ssm_dt_rank: int = 4,
    ssm_n_group: int = 2,
    nextn_layers: int = 0,
    router_scale: float = 4.0,
    n_vocab: int | None = None,
    ctx_len: int = 65536,
    seed: int = 0,
    weight_type: str = "f32",
    rope_base: float = 10000.0,
    rms_eps: float = 1e-6,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A tiny random-weight qwen3moe, qwen35 or qwen35moe GGUF, laid out as llama.cpp loads it.

    qwen3moe: every layer full attention (q/k norms, NeoX RoPE) with a routed MoE FFN (softmax gating,
    top-k normalised).  qwen35 / qwen35moe: Gated DeltaNet layers with a gated full-attention layer every
    ``full_attention_interval``-th (interleaved multi-section RoPE over ``n_rot`` of the head, default a
    quarter), the MoE variant with a shared expert behind a sigmoid gate.  ``nextn_layers`` appends MTP
    blocks (full attention layers plus their extra tensors) that inference skips.  The router's weights are
    ``router_scale`` times the other matrices' scale so the top-k choice has a margin (a tie flipped by
    rounding is not a bug).  Returns {"path", "hparams"} with the dims written.
    """
    if arch not in HYBRID_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {HYBRID_ARCHS}")
    if weight_type not in ("f32", "f16"):
        raise ValueError("weight_type must be 'f32' or 'f16'")
    moe = arch != "qwen35"
    hybrid = arch != "qwen3moe"
    n_rot = n_rot if n_rot is not None else (head_dim // 4 if hybrid else head_dim)
    vocab = make_vocab(n_vocab)
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    np_wtype = np.float16 if weight_type == "f16" else np.float32
    n_all = n_layer + nextn_layers
    recr = [hybrid and il < n_layer and (il + 1) % full_attention_interval != 0 for il in range(n_all)]
    arrays: dict[str, Any] = {}

    def mat(name: str, *shape: int, std: float, dtype=None) -> None:
        arrays[name] = (rng.standard_normal(shape) * std).astype(dtype or np_wtype)

    def vec(name: str, n: int, mean: float, std: float) -> None:
        arrays[name] = (mean + rng.standard_normal(n) * std).astype(np.float32)

    E, D = n_embd, head_dim
    inv = 1.0 / math.sqrt(E)
    mat("token_embd.weight", n_vocab, E, std=0.3)
    vec("output_norm.weight", E, 1.0, 0.1)
    mat("output.weight", n_vocab, E, std=0.3)
    key_dim, value_dim = ssm_d_state * ssm_n_group, ssm_d_state * ssm_dt_rank
    for il in range(n_all):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", E, 1.0, 0.1)
        if hybrid:
            vec(p + "post_attention_norm.weight", E, 1.0, 0.1)
        else:
            vec(p + "ffn_norm.weight", E, 1.0, 0.1)
        if recr[il]:
            C = 2 * key_dim + value_dim
            mat(p + "attn_qkv.weight", C, E, std=inv)
            mat(p + "attn_gate.weight", value_dim, E, std=inv)
            mat(p + "ssm_conv1d.weight", C, ssm_d_conv, std=1.0 / math.sqrt(ssm_d_conv), dtype=np.float32)
            vec(p + "ssm_dt.bias", ssm_dt_rank, 0.0, 0.5)
            arrays[p + "ssm_a"] = (-np.exp(rng.standard_normal(ssm_dt_rank) * 0.5)).astype(np.float32)
            mat(p + "ssm_beta.weight", ssm_dt_rank, E, std=inv)
            mat(p + "ssm_alpha.weight", ssm_dt_rank, E, std=inv)
            vec(p + "ssm_norm.weight", ssm_d_state, 1.0, 0.1)
            mat(p + "ssm_out.weight", E, value_dim, std=1.0 / math.sqrt(value_dim))
        else:
            mat(p + "attn_q.weight", (2 if hybrid else 1) * D * n_head, E, std=inv)
            mat(p + "attn_k.weight", D * n_head_kv, E, std=inv)
            mat(p + "attn_v.weight", D * n_head_kv, E, std=inv)
            mat(p + "attn_output.weight", E, D * n_head, std=1.0 / math.sqrt(D * n_head))
            vec(p + "attn_q_norm.weight", D, 1.0, 0.1)
            vec(p + "attn_k_norm.weight", D, 1.0, 0.1)
        if moe:
            mat(p + "ffn_gate_inp.weight", n_expert, E, std=router_scale * inv, dtype=np.float32)
            mat(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, E, std=inv)
            mat(p + "ffn_up_exps.weight", n_expert, n_ff_exp, E, std=inv)
            mat(p + "ffn_down_exps.weight", n_expert, E, n_ff_exp, std=1.0 / math.sqrt(n_ff_exp))
            if arch == "qwen35moe":
                mat(p + "ffn_gate_inp_shexp.weight", E, std=inv, dtype=np.float32)
                mat(p + "ffn_gate_shexp.weight", n_ff_shexp, E, std=inv)
                mat(p + "ffn_up_shexp.weight", n_ff_shexp, E, std=inv)
                mat(p + "ffn_down_shexp.weight", E, n_ff_shexp, std=1.0 / math.sqrt(n_ff_shexp))
        else:
            mat(p + "ffn_gate.weight", n_ff, E, std=inv)
            mat(p + "ffn_up.weight", n_ff, E, std=inv)
            mat(p + "ffn_down.weight", E, n_ff, std=1.0 / math.sqrt(n_ff))
        if il >= n_layer:   # an MTP block's own tensors (llama.cpp's nextn names)
            mat(p + "nextn.eh_proj.weight", E, 2 * E, std=inv)
            vec(p + "nextn.enorm.weight", E, 1.0, 0.1)
            vec(p + "nextn.hnorm.weight", E, 1.0, 0.1)
            vec(p + "nextn.shared_head_norm.weight", E, 1.0, 0.1)

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if weight_type == "f16" else gguf.LlamaFileType.ALL_F32))
    w.add_context_length(ctx_len)
    w.add_embedding_length(E)
    w.add_block_count(n_all)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(n_rot)
    if moe:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff_exp)
        if arch == "qwen35moe":
            w.add_expert_shared_feed_forward_length(n_ff_shexp)
    meta: dict[str, Any] = {}
    if hybrid:
        meta[f"{arch}.rope.dimension_sections"] = [n_rot // 2 - 2 * (n_rot // 6), n_rot // 6, n_rot // 6, 0]
        meta[f"{arch}.full_attention_interval"] = full_attention_interval
        meta[f"{arch}.ssm.conv_kernel"] = ssm_d_conv
        meta[f"{arch}.ssm.inner_size"] = value_dim
        meta[f"{arch}.ssm.state_size"] = ssm_d_state
        meta[f"{arch}.ssm.time_step_rank"] = ssm_dt_rank
        meta[f"{arch}.ssm.group_count"] = ssm_n_group
        if nextn_layers:
            meta[f"{arch}.nextn_predict_layers"] = nextn_layers
    meta.update(extra or {})   # extra: more keys, or other values for these (a mistaken or hostile file)
    _write_tokenizer(w, vocab, n_vocab)
    for k, v in meta.items():
        _add_extra_kv(w, k, v)
    _write_tensors(w, arrays)
    return {"path": str(path), "vocab": vocab, "n_vocab": n_vocab, "recurrent": recr[:n_layer],
            "hparams": {"arch": arch, "n_layer": n_layer, "n_embd": E, "head_dim": D, "n_rot": n_rot}}


# gpt-oss's harmony tokens (o200k_harmony's specials), appended to make_vocab's as control tokens: the
# file's BOS is <|startoftext|> and its EOS <|return|>, as in the released GGUFs.
HARMONY_TOKENS = ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>")


def write_tiny_gptoss(
    path: str | Path,
    *,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_swa: int = 32,
    swa_pattern: int | list[bool] | None = None,
    rope_base: float = 10000.0,
    yarn_factor: float | None = 8.0,
    yarn_orig_ctx: int = 256,
    sink_mean: float = 1.0,
    sink_std: float = 1.0,
    router_scale: float = 4.0,
    expert_scale: float = 2.5,
    qkv_bias: bool = True,
    ctx_len: int = 65536,
    seed: int = 0,
    weight_type: str = "f32",
    expert_type: str | None = None,
    rms_eps: float = 1e-5,
    chat_template: str | None = None,
    extra: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    retype: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A tiny random-weight gpt-oss GGUF, laid out as llama.cpp loads it (src/models/openai-moe.cpp).

    Every layer: attn_norm; attn_q/k/v with biases (``qkv_bias``), attn_output with its bias, per-head
    ``attn_sinks`` [n_head] (values ~ N(sink_mean, sink_std): sinks that take a real share of each softmax);
    post_attention_norm (the FFN's pre-norm); the router ffn_gate_inp with its bias; experts
    ffn_gate_exps / ffn_up_exps / ffn_down_exps each with a per-expert bias.  Keys: sliding_window
    ``n_swa`` (alternate layers slide: llama.cpp's pattern 2, or ``swa_pattern``), expert_feed_forward_length,
    YaRN (rope.scaling.type "yarn", factor ``yarn_factor``, original_context_length ``yarn_orig_ctx``; None:
    no scaling keys), the gpt2 tokenizer with pre-tokenizer "gpt-4o" and the harmony specials.  The router
    is ``router_scale`` times the other matrices' scale so top-k has a margin; the experts' gate and up are
    ``expert_scale`` times it so swiglu_oai's clamps (7) are reached.  ``expert_type="mxfp4"``: the experts'
    matrices stored as MXFP4, as the released files store them.  ``drop``: tensor names left out;
    ``retype``: tensor name -> numpy dtype (a file that breaks the rules).  Returns {"path", "vocab",
    "n_vocab", "is_swa", "hparams"}.
    """
    if weight_type not in ("f32", "f16"):
        raise ValueError("weight_type must be 'f32' or 'f16'")
    if expert_type not in (None, "mxfp4"):
        raise ValueError("expert_type must be None or 'mxfp4'")
    if expert_type and (n_embd % 32 or n_ff_exp % 32):
        raise ValueError("mxfp4 experts need n_embd and n_ff_exp multiples of 32")
    vocab = make_vocab()
    for t in HARMONY_TOKENS:
        vocab["tokens"].append(t)
        vocab["token_types"].append(int(gguf.TokenType.CONTROL))
    vocab["bos_id"] = vocab["tokens"].index("<|startoftext|>")
    vocab["eos_id"] = vocab["tokens"].index("<|return|>")
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    np_wtype = np.float16 if weight_type == "f16" else np.float32
    arrays: dict[str, Any] = {}

    def mat(name: str, *shape: int, std: float, dtype=None) -> None:
        arrays[name] = (rng.standard_normal(shape) * std).astype(dtype or np_wtype)

    def vec(name: str, *shape: int, mean: float, std: float) -> None:
        arrays[name] = (mean + rng.standard_normal(shape) * std).astype(np.float32)

    E, D, H, Hkv, X, F = n_embd, head_dim, n_head, n_head_kv, n_expert, n_ff_exp
    inv = 1.0 / math.sqrt(E)
    mat("token_embd.weight", n_vocab, E, std=0.3)
    vec("output_norm.weight", E, mean=1.0, std=0.1)
    mat("output.weight", n_vocab, E, std=0.3)
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", E, mean=1.0, std=0.1)
        mat(p + "attn_q.weight", D * H, E, std=inv)
        mat(p + "attn_k.weight", D * Hkv, E, std=inv)
        mat(p + "attn_v.weight", D * Hkv, E, std=inv)
        if qkv_bias:
            vec(p + "attn_q.bias", D * H, mean=0.0, std=0.2)
            vec(p + "attn_k.bias", D * Hkv, mean=0.0, std=0.2)
            vec(p + "attn_v.bias", D * Hkv, mean=0.0, std=0.2)
        mat(p + "attn_output.weight", E, D * H, std=1.0 / math.sqrt(D * H))
        vec(p + "attn_output.bias", E, mean=0.0, std=0.1)
        vec(p + "attn_sinks.weight", H, mean=sink_mean, std=sink_std)
        vec(p + "post_attention_norm.weight", E, mean=1.0, std=0.1)
        mat(p + "ffn_gate_inp.weight", X, E, std=router_scale * inv, dtype=np.float32)
        vec(p + "ffn_gate_inp.bias", X, mean=0.0, std=0.3)
        mat(p + "ffn_gate_exps.weight", X, F, E, std=expert_scale * inv)
        mat(p + "ffn_up_exps.weight", X, F, E, std=expert_scale * inv)
        mat(p + "ffn_down_exps.weight", X, E, F, std=1.0 / math.sqrt(F))
        vec(p + "ffn_gate_exps.bias", X, F, mean=0.0, std=0.2)
        vec(p + "ffn_up_exps.bias", X, F, mean=0.0, std=0.2)
        vec(p + "ffn_down_exps.bias", X, E, mean=0.0, std=0.1)
    if expert_type == "mxfp4":
        for name in [n for n in arrays if n.endswith("_exps.weight")]:
            q = gguf.quants.quantize(arrays[name].astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
            arrays[name] = (q, gguf.GGMLQuantizationType.MXFP4)
    for name in drop:
        del arrays[name]
    for name, dt in (retype or {}).items():
        arrays[name] = arrays[name].astype(dt)

    arch = "gpt-oss"
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gpt-oss")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if weight_type == "f16" else gguf.LlamaFileType.ALL_F32))
    meta: dict[str, Any] = {
        f"{arch}.context_length": ctx_len,
        f"{arch}.embedding_length": E,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": F,
        f"{arch}.attention.head_count": H,
        f"{arch}.attention.head_count_kv": Hkv,
        f"{arch}.attention.key_length": D,
        f"{arch}.attention.value_length": D,
        f"{arch}.attention.layer_norm_rms_epsilon": float(rms_eps),
        f"{arch}.rope.freq_base": float(rope_base),
        f"{arch}.expert_count": X,
        f"{arch}.expert_used_count": n_expert_used,
        f"{arch}.expert_feed_forward_length": F,
        f"{arch}.attention.sliding_window": n_swa,
    }
    if swa_pattern is not None:
        meta[f"{arch}.attention.sliding_window_pattern"] = swa_pattern
    if yarn_factor is not None:
        meta[f"{arch}.rope.scaling.type"] = "yarn"
        meta[f"{arch}.rope.scaling.factor"] = float(yarn_factor)
        meta[f"{arch}.rope.scaling.original_context_length"] = yarn_orig_ctx
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    meta.update(extra or {})   # extra: more keys, or other values for these (a mistaken or hostile file)
    _write_tokenizer(w, vocab, n_vocab, pre="gpt-4o")
    for k, v in meta.items():
        if v is None:
            continue           # extra may remove a key by naming it with None
        _add_extra_kv(w, k, v)
    _write_tensors(w, arrays)
    is_swa = swa_layers(n_layer, n_swa, 2 if swa_pattern is None else swa_pattern)
    return {"path": str(path), "vocab": vocab, "n_vocab": n_vocab, "is_swa": is_swa,
            "hparams": {"arch": arch, "n_layer": n_layer, "n_embd": E, "head_dim": D, "n_swa": n_swa}}


def write_tiny_laguna(
    path: str | Path,
    *,
    n_layer: int = 5,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_swa: int = 6,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_rot: int = 16,
    n_rot_swa: int | None = 32,
    n_ff: int = 96,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_ff_shexp: int | None = 48,
    n_dense_lead: int = 1,
    n_swa: int = 32,
    swa_pattern: int | list[bool] | None = None,
    rope_base: float = 500000.0,
    rope_base_swa: float | None = 10000.0,
    yarn_factor: float | None = 8.0,
    yarn_orig_ctx: int = 256,
    gate: str | list[str] = "per_head",
    gate_std: float = 1.0,
    probs_bias_std: float = 1.0,
    weights_norm: bool = True,
    weights_scale: float | None = 2.5,
    router_scale: float = 4.0,
    ctx_len: int = 65536,
    seed: int = 0,
    weight_type: str = "f32",
    rms_eps: float = 1e-6,
    extra: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    retype: dict[str, Any] | None = None,
    reshape: dict[str, tuple[int, ...]] | None = None,
    pre: str = "laguna",
    extra_merges: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """A tiny random-weight laguna GGUF, laid out as llama.cpp loads it (src/models/laguna.cpp).

    Every layer: attn_norm; attn_q [D * heads of the layer], attn_k / attn_v [D * n_head_kv]; attn_q_norm /
    attn_k_norm [D]; attn_gate (``gate``: "per_head" [heads] or "per_element" [D * heads], or one per layer;
    values ~ N(0, gate_std) through the products: 0 gives softplus(0) everywhere); attn_output; ffn_norm; the
    first ``n_dense_lead`` layers a dense SwiGLU of width ``n_ff``, the others the router ffn_gate_inp with
    the score-correction bias exp_probs_b (~ N(0, probs_bias_std): it moves the choice of experts), experts
    ffn_gate/up/down_exps and the shared expert ffn_gate/up/down_shexp (width ``n_ff_shexp``; None: the key
    left out).  Keys: head_count as a per-layer array (``n_head`` on global layers, ``n_head_swa`` on sliding
    ones, as the converter writes it); sliding_window ``n_swa`` (0: the key left out, every layer global) in
    llama.cpp's period of 4 with the global layer first (or ``swa_pattern``); YaRN on the global layers
    (rope.scaling.*, ``yarn_factor``; None: no scaling keys) over ``n_rot`` dims; rope.freq_base_swa and
    rope.dimension_count_swa (None: left out); expert_weights_norm / scale (sigmoid gating, the converter's
    keys); the gpt2 tokenizer with pre-tokenizer ``pre`` and ``extra_merges``.  ``drop`` / ``retype`` / ``reshape``: tensors left
    out, stored as another dtype, or drawn in another (numpy) shape (files that break the rules).  Returns
    {"path", "vocab", "n_vocab", "is_swa", "heads", "hparams"}.
    """
    if weight_type not in ("f32", "f16"):
        raise ValueError("weight_type must be 'f32' or 'f16'")
    vocab = make_vocab()
    for a, b in extra_merges or []:    # merged tokens in the vocabulary (the tokenizer adds the merge)
        vocab["tokens"].append(a + b)
        vocab["token_types"].append(int(gguf.TokenType.NORMAL))
        vocab["merges"].append(f"{a} {b}")
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    np_wtype = np.float16 if weight_type == "f16" else np.float32
    arrays: dict[str, Any] = {}
    reshape = reshape or {}

    def mat(name: str, *shape: int, std: float, dtype=None) -> None:
        arrays[name] = (rng.standard_normal(reshape.get(name, shape)) * std).astype(dtype or np_wtype)

    def vec(name: str, *shape: int, mean: float, std: float) -> None:
        arrays[name] = (mean + rng.standard_normal(reshape.get(name, shape)) * std).astype(np.float32)

    is_swa = [False] * n_layer if not n_swa else [
        bool(x) for x in (swa_pattern if isinstance(swa_pattern, (list, tuple)) else
                          [(4 if swa_pattern is None else swa_pattern) == 0 or
                           il % (4 if swa_pattern is None else swa_pattern) != 0 for il in range(n_layer)])]
    heads = [n_head_swa if s else n_head for s in is_swa]
    gates = [gate] * n_layer if isinstance(gate, str) else list(gate)
    E, D, Hkv, X, F = n_embd, head_dim, n_head_kv, n_expert, n_ff_exp
    S = n_ff_shexp or n_ff_exp
    inv = 1.0 / math.sqrt(E)
    mat("token_embd.weight", n_vocab, E, std=0.3)
    vec("output_norm.weight", E, mean=1.0, std=0.1)
    mat("output.weight", n_vocab, E, std=0.3)
    for il in range(n_layer):
        p, H = f"blk.{il}.", heads[il]
        vec(p + "attn_norm.weight", E, mean=1.0, std=0.1)
        mat(p + "attn_q.weight", D * H, E, std=inv)
        mat(p + "attn_k.weight", D * Hkv, E, std=inv)
        mat(p + "attn_v.weight", D * Hkv, E, std=inv)
        vec(p + "attn_q_norm.weight", D, mean=1.0, std=0.1)
        vec(p + "attn_k_norm.weight", D, mean=1.0, std=0.1)
        mat(p + "attn_gate.weight", H if gates[il] == "per_head" else D * H, E, std=gate_std * inv)
        mat(p + "attn_output.weight", E, D * H, std=1.0 / math.sqrt(D * H))
        vec(p + "ffn_norm.weight", E, mean=1.0, std=0.1)
        if il < n_dense_lead:
            mat(p + "ffn_gate.weight", n_ff, E, std=inv)
            mat(p + "ffn_up.weight", n_ff, E, std=inv)
            mat(p + "ffn_down.weight", E, n_ff, std=1.0 / math.sqrt(n_ff))
            continue
        mat(p + "ffn_gate_inp.weight", X, E, std=router_scale * inv, dtype=np.float32)
        vec(p + "exp_probs_b.bias", X, mean=0.0, std=probs_bias_std)
        mat(p + "ffn_gate_exps.weight", X, F, E, std=inv)
        mat(p + "ffn_up_exps.weight", X, F, E, std=inv)
        mat(p + "ffn_down_exps.weight", X, E, F, std=1.0 / math.sqrt(F))
        mat(p + "ffn_gate_shexp.weight", S, E, std=inv)
        mat(p + "ffn_up_shexp.weight", S, E, std=inv)
        mat(p + "ffn_down_shexp.weight", E, S, std=1.0 / math.sqrt(S))
    for name in drop:
        del arrays[name]
    for name, dt in (retype or {}).items():
        arrays[name] = arrays[name].astype(dt)

    arch = "laguna"
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-laguna")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if weight_type == "f16" else gguf.LlamaFileType.ALL_F32))
    meta: dict[str, Any] = {
        f"{arch}.context_length": ctx_len,
        f"{arch}.embedding_length": E,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": Hkv,
        f"{arch}.attention.key_length": D,
        f"{arch}.attention.value_length": D,
        f"{arch}.attention.layer_norm_rms_epsilon": float(rms_eps),
        f"{arch}.rope.freq_base": float(rope_base),
        f"{arch}.rope.dimension_count": n_rot,
        f"{arch}.expert_count": X,
        f"{arch}.expert_used_count": n_expert_used,
        f"{arch}.expert_feed_forward_length": F,
        f"{arch}.leading_dense_block_count": n_dense_lead,
        f"{arch}.expert_weights_norm": bool(weights_norm),
        f"{arch}.expert_gating_func": 2,
        f"{arch}.vocab_size": n_vocab,
    }
    if n_ff_shexp is not None:
        meta[f"{arch}.expert_shared_feed_forward_length"] = n_ff_shexp
    if weights_scale is not None:
        meta[f"{arch}.expert_weights_scale"] = float(weights_scale)
    if n_swa:
        meta[f"{arch}.attention.sliding_window"] = n_swa
        if swa_pattern is not None:
            meta[f"{arch}.attention.sliding_window_pattern"] = swa_pattern
        if rope_base_swa is not None:
            meta[f"{arch}.rope.freq_base_swa"] = float(rope_base_swa)
        if n_rot_swa is not None:
            meta[f"{arch}.rope.dimension_count_swa"] = n_rot_swa
    if yarn_factor is not None:
        meta[f"{arch}.rope.scaling.type"] = "yarn"
        meta[f"{arch}.rope.scaling.factor"] = float(yarn_factor)
        meta[f"{arch}.rope.scaling.original_context_length"] = yarn_orig_ctx
    meta.update(extra or {})
    _write_tokenizer(w, vocab, n_vocab, pre=pre)
    for k, v in meta.items():
        if v is None:
            continue
        _add_extra_kv(w, k, v)
    _write_tensors(w, arrays)
    return {"path": str(path), "vocab": vocab, "n_vocab": n_vocab, "is_swa": is_swa, "heads": heads,
            "hparams": {"arch": arch, "n_layer": n_layer, "n_embd": E, "head_dim": D, "n_swa": n_swa}}


def write_tiny_gemma4(
    path: str | Path,
    *,
    swa_pattern: list[bool] | int | None = None,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 1,
    n_head_kv_swa: int = 2,
    head_dim: int = 64,
    head_dim_swa: int = 32,
    n_rot_swa: int | None = 32,
    partial_rotary: float = 0.25,
    n_ff: int | list[int] = 96,
    n_shared_kv: int = 2,
    n_embd_per_layer: int = 16,
    n_expert: int = 0,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    fused_gate_up: bool = False,
    expert_scale: bool = True,
    k_eq_v: str = "global",
    out_scale: bool = True,
    n_swa: int = 32,
    rope_base: float = 1000000.0,
    rope_base_swa: float | None = 10000.0,
    softcap: float | None = 30.0,
    router_scale: float = 4.0,
    ctx_len: int = 65536,
    seed: int = 0,
    weight_type: str = "f32",
    rms_eps: float = 1e-6,
    extra: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    retype: dict[str, Any] | None = None,
    reshape: dict[str, tuple[int, ...]] | None = None,
    overrides: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A tiny random-weight gemma4 GGUF, laid out as llama.cpp loads it (src/models/gemma4.cpp) and as its
    converter writes it (conversion/gemma.py, Gemma4Model).

    Layers: ``swa_pattern`` (default [T, T, F, T, F, T, F]: 7 layers, sliding where True), written as the
    per-layer bool array (an int: written as a period, which llama.cpp refuses for gemma4); the last ``n_shared_kv`` layers have no K/V of their own (llama.cpp reads
    layer n_kv - 2's cache on a sliding one, n_kv - 1's on a global one, n_kv = layers - shared): no attn_k,
    attn_v or attn_k_norm.  Global layers: head dim ``head_dim`` (key_length), ``n_head_kv`` K/V heads, RoPE over
    the whole head with rope_freqs (1 on the first ``partial_rotary`` of the pairs, 1e30 on the rest: the
    converter's "proportional" RoPE); sliding layers: ``head_dim_swa`` (key_length_swa), ``n_head_kv_swa``
    heads (head_count_kv as a per-layer array), rope.dimension_count_swa ``n_rot_swa`` and their own base.
    ``k_eq_v``: which layers have no attn_v (V is K's product): "global", "all" or "none".  Every layer:
    attn_norm, attn_q/k(/v), q/k norms, attn_output, post_attention_norm, ffn_norm, ffn_gate/up/down (width
    ``n_ff``, one or per layer), post_ffw_norm, layer_output_scale (``out_scale``); with ``n_embd_per_layer``
    the per-layer embeddings (per_layer_token_embd, per_layer_model_proj, per_layer_proj_norm; inp_gate,
    proj, post_norm per layer); with ``n_expert`` every layer a MoE layer too: the router ffn_gate_inp and its
    .scale, pre_ffw_norm_2, post_ffw_norm_1/2, the experts (``fused_gate_up``: one ffn_gate_up_exps) and
    ffn_down_exps.scale (``expert_scale``).  The gpt2 tokenizer of make_vocab (the gemma4 tokenizer model
    is tested on llama.cpp's vocabulary vectors: tests/test_vocab_core.py).  ``drop`` / ``retype`` /
    ``reshape``: tensors left out, stored as another dtype, or drawn in another (numpy) shape; ``overrides``:
    tensor name -> one value every element takes after the draws (the same weights with one feature off).
    Returns {"path", "vocab", "n_vocab", "is_swa", "kv_src", "hparams"}.
    """
    if weight_type not in ("f32", "f16"):
        raise ValueError("weight_type must be 'f32' or 'f16'")
    if swa_pattern is None:
        swa_pattern = [True, True, False, True, False, True, False]
    is_swa = [bool(x) for x in swa_pattern] if isinstance(swa_pattern, (list, tuple)) else None
    n_layer = len(is_swa) if is_swa is not None else 7
    if is_swa is None:
        is_swa = [True] * n_layer
    vocab = make_vocab()
    n_vocab = len(vocab["tokens"])
    rng = np.random.default_rng(seed)
    np_wtype = np.float16 if weight_type == "f16" else np.float32
    arrays: dict[str, Any] = {}
    reshape = reshape or {}

    def mat(name: str, *shape: int, std: float, dtype=None) -> None:
        arrays[name] = (rng.standard_normal(reshape.get(name, shape)) * std).astype(dtype or np_wtype)

    def vec(name: str, *shape: int, mean: float, std: float) -> None:
        arrays[name] = (mean + rng.standard_normal(reshape.get(name, shape)) * std).astype(np.float32)

    n_kv = n_layer - n_shared_kv
    kv_src = [-1 if il < n_kv else n_kv - (2 if is_swa[il] else 1) for il in range(n_layer)]
    ffs = list(n_ff) if isinstance(n_ff, (list, tuple)) else [n_ff] * n_layer
    E, H, P, X, FE = n_embd, n_head, n_embd_per_layer, n_expert, n_ff_exp
    inv = 1.0 / math.sqrt(E)
    mat("token_embd.weight", n_vocab, E, std=0.3)
    vec("output_norm.weight", E, mean=1.0, std=0.1)
    mat("output.weight", n_vocab, E, std=0.3)
    n_rot_pairs = int(head_dim * partial_rotary / 2)
    freqs = np.array([1.0] * n_rot_pairs + [1e30] * (head_dim // 2 - n_rot_pairs), np.float32)
    arrays["rope_freqs.weight"] = np.resize(freqs, reshape.get("rope_freqs.weight", freqs.shape))
    if P:
        mat("per_layer_token_embd.weight", n_vocab, P * n_layer, std=0.5)
        mat("per_layer_model_proj.weight", P * n_layer, E, std=1.0)
        vec("per_layer_proj_norm.weight", P, mean=1.0, std=0.1)
    for il in range(n_layer):
        p = f"blk.{il}."
        D = head_dim_swa if is_swa[il] else head_dim
        Hkv = n_head_kv_swa if is_swa[il] else n_head_kv
        vec(p + "attn_norm.weight", E, mean=1.0, std=0.1)
        mat(p + "attn_q.weight", D * H, E, std=inv)
        if kv_src[il] < 0:
            mat(p + "attn_k.weight", D * Hkv, E, std=inv)
            if not (k_eq_v == "all" or (k_eq_v == "global" and not is_swa[il])):
                mat(p + "attn_v.weight", D * Hkv, E, std=inv)
            vec(p + "attn_k_norm.weight", D, mean=1.0, std=0.1)
        vec(p + "attn_q_norm.weight", D, mean=1.0, std=0.1)
        mat(p + "attn_output.weight", E, D * H, std=1.0 / math.sqrt(D * H))
        vec(p + "post_attention_norm.weight", E, mean=1.0, std=0.1)
        F = ffs[il]
        vec(p + "ffn_norm.weight", E, mean=1.0, std=0.1)
        mat(p + "ffn_gate.weight", F, E, std=inv)
        mat(p + "ffn_up.weight", F, E, std=inv)
        mat(p + "ffn_down.weight", E, F, std=1.0 / math.sqrt(F))
        vec(p + "post_ffw_norm.weight", E, mean=1.0, std=0.1)
        if out_scale:
            arrays[p + "layer_output_scale.weight"] = rng.uniform(0.5, 1.5, reshape.get(
                p + "layer_output_scale.weight", (1,))).astype(np.float32)
        if X:
            mat(p + "ffn_gate_inp.weight", X, E, std=router_scale, dtype=np.float32)
            vec(p + "ffn_gate_inp.scale", E, mean=1.0, std=0.2)
            vec(p + "pre_ffw_norm_2.weight", E, mean=1.0, std=0.1)
            vec(p + "post_ffw_norm_1.weight", E, mean=1.0, std=0.1)
            vec(p + "post_ffw_norm_2.weight", E, mean=1.0, std=0.1)
            if fused_gate_up:
                mat(p + "ffn_gate_up_exps.weight", X, 2 * FE, E, std=inv)
            else:
                mat(p + "ffn_gate_exps.weight", X, FE, E, std=inv)
                mat(p + "ffn_up_exps.weight", X, FE, E, std=inv)
            mat(p + "ffn_down_exps.weight", X, E, FE, std=1.0 / math.sqrt(FE))
            if expert_scale:
                vec(p + "ffn_down_exps.scale", X, mean=1.0, std=0.3)
        if P:
            mat(p + "inp_gate.weight", P, E, std=inv)
            mat(p + "proj.weight", E, P, std=1.0 / math.sqrt(P))
            vec(p + "post_norm.weight", E, mean=1.0, std=0.1)
    for name, val in (overrides or {}).items():
        arrays[name] = np.full_like(arrays[name], val)
    for name in drop:
        del arrays[name]
    with np.errstate(over="ignore"):   # rope_freqs' 1e30 as f16 is inf: a file broken on purpose anyway
        for name, dt in (retype or {}).items():
            arrays[name] = arrays[name].astype(dt)

    arch = "gemma4"
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gemma4")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if weight_type == "f16" else gguf.LlamaFileType.ALL_F32))
    meta: dict[str, Any] = {
        f"{arch}.context_length": ctx_len,
        f"{arch}.embedding_length": E,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": ffs if len(set(ffs)) > 1 else ffs[0],
        f"{arch}.attention.head_count": H,
        f"{arch}.attention.head_count_kv": [n_head_kv_swa if s else n_head_kv for s in is_swa],
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.key_length_swa": head_dim_swa,
        f"{arch}.attention.value_length_swa": head_dim_swa,
        f"{arch}.attention.layer_norm_rms_epsilon": float(rms_eps),
        f"{arch}.attention.sliding_window": n_swa,
        f"{arch}.attention.sliding_window_pattern": swa_pattern,
        f"{arch}.attention.shared_kv_layers": n_shared_kv,
        f"{arch}.embedding_length_per_layer_input": P,
        f"{arch}.rope.freq_base": float(rope_base),
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.vocab_size": n_vocab,
    }
    if rope_base_swa is not None:
        meta[f"{arch}.rope.freq_base_swa"] = float(rope_base_swa)
    if n_rot_swa is not None:
        meta[f"{arch}.rope.dimension_count_swa"] = n_rot_swa
    if softcap is not None:
        meta[f"{arch}.final_logit_softcapping"] = float(softcap)
    if X:
        meta[f"{arch}.expert_count"] = X
        meta[f"{arch}.expert_used_count"] = n_expert_used
        meta[f"{arch}.expert_feed_forward_length"] = FE
    meta.update(extra or {})
    _write_tokenizer(w, vocab, n_vocab)
    for k, v in meta.items():
        if v is None:
            continue
        _add_extra_kv(w, k, v)
    _write_tensors(w, arrays)
    return {"path": str(path), "vocab": vocab, "n_vocab": n_vocab, "is_swa": is_swa, "kv_src": kv_src,
            "hparams": {"arch": arch, "n_layer": n_layer, "n_embd": E, "head_dim": head_dim,
                        "head_dim_swa": head_dim_swa, "n_swa": n_swa}}
