"""numpy float64 reference forward pass matching llama.cpp for llama/qwen2/qwen3/gemma3.

Everything here was read from llama.cpp as vendored in llama_cpp_python-0.3.36
(``vendor/llama.cpp``); file names below are relative to that directory.

Common conventions
------------------
* Embedding: ``x = token_embd[tokens]`` (``build_inp_embd`` / ggml_get_rows,
  src/llama-graph.cpp).
* RMSNorm (``build_norm`` with LLM_NORM_RMS, src/llama-graph.cpp; ggml
  ``rms_norm`` in ggml/src/ggml-cpu/ops.cpp):
  ``y = x / sqrt(mean(x^2) + eps) * w`` — eps inside the sqrt, added to the
  mean, weight multiplied afterwards, no bias, eps = ``attention.layer_norm_rms_epsilon``.
  The same eps is used for every norm, including the per-head q/k norms.
* Q/K/V (``build_qkv``): ``q = x @ Wq.T (+ bq)`` etc., reshaped to
  ``[n_tokens, n_head, head_dim]`` (head-major within the row).  GQA: query head
  ``h`` uses KV head ``h // (n_head / n_head_kv)`` (ggml_mul_mat broadcasting,
  ``i02 = i12 / r2``).
* RoPE (ggml ``rope_f32``/``rotate_pairs``, ggml/src/ggml-cpu/ops.cpp), no
  scaling (freq_scale = 1, ext_factor = 0, attn_factor = 1), n_rot = head_dim:
  ``theta_i = pos * base^(-2i/n_rot)``, i in [0, n_rot/2);
  ``x0' = x0 cos - x1 sin``, ``x1' = x0 sin + x1 cos`` where
  NORM mode (llama): ``(x0, x1) = (x[2i], x[2i+1])``;
  NEOX mode (qwen2, qwen3, gemma3): ``(x0, x1) = (x[i], x[i + n_rot/2])``
  (mode per arch from ``llama_model_rope_type``, src/llama-model.cpp).
* Attention (``build_attn_mha``, src/llama-graph.cpp, non-flash path):
  ``softmax(scale * q.k + mask) @ v``; mask is 0 / -inf.  Causality is by
  *position*: key j is masked for query i when ``pos[j] > pos[i]``
  (``set_input_kq_mask``, src/llama-kv-cache.cpp).  With the KV cache, K is
  stored after RoPE and V as-is, in the cache type (f16 by default);
  ``kv_f16_roundtrip`` emulates that.
* FFN (``build_ffn`` with LLM_FFN_PAR): ``down(act(gate(x)) * up(x))``, act =
  SiLU (llama/qwen2/qwen3) or GELU tanh-approximation (gemma3,
  ``ggml_geglu_split``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``;
  note that ggml's CPU backend evaluates this GELU through an f16 lookup table
  (GGML_GELU_FP16 in ggml/src/ggml-cpu/vec.h), so CPU llama.cpp deviates from the
  exact formula by ~1e-3 relative in the activation).
* Output: ``rms_norm(x) * output_norm`` then ``@ output.T``; when
  ``output.weight`` is absent it is tied to ``token_embd.weight``
  (TENSOR_DUPLICATED in each arch's ``load_arch_tensors``).

Per-architecture (src/models/<arch>.cpp)
----------------------------------------
* llama: pre-norm block ``h = x + attn(norm(x)); out = h + ffn(norm(h))``;
  NORM rope; kq_scale = 1/sqrt(head_dim) (f_attention_scale == 0).
* qwen2: as llama but NEOX rope and q/k/v biases (attn_q.bias, attn_k.bias,
  attn_v.bias, added right after the matmul, before RoPE); optional
  output.bias (not written by tinygguf).
* qwen3: as qwen2 without biases, plus per-head RMSNorm of q and k over head_dim
  with weights attn_q_norm/attn_k_norm, applied *before* RoPE.
* gemma3: ``x = embd * sqrtf(n_embd)``;
  ``a = post_attention_norm(attn(attn_norm(x))); h = a + x;``
  ``f = post_ffw_norm(ffn(ffn_norm(h))); out = f + h``;
  q/k per-head RMSNorm before RoPE (NEOX); Q is multiplied by
  f_attention_scale (1/sqrt(head_dim) except the 27B layout) and kq_scale is 1;
  norm weights are used as stored (converter already added +1,
  conversion/gemma.py); optional final logit soft-capping
  ``cap * tanh(logits / cap)``.
  Sliding window (``llama_model_gemma3::load_arch_hparams``): if
  ``attention.sliding_window`` > 0, swa_type STANDARD with pattern period 6
  (``is_swa(il) = il % 6 < 5``, i.e. every 6th layer is global) unless
  ``attention.sliding_window_pattern`` overrides it.  SWA layers use rope base
  ``rope.freq_base_swa`` (default 10000, src/llama-hparams.h) and global layers
  ``rope.freq_base`` (``llama_model::get_rope_freq_base``).  On SWA layers a key
  is masked when ``pos_q - pos_k >= n_swa`` (``llama_hparams::is_masked_swa``,
  LLAMA_SWA_TYPE_STANDARD, src/llama-hparams.h), i.e. visible iff
  ``pos_q - pos_k < n_swa``: the query sees itself plus n_swa-1 previous positions.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """llama.cpp RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * w."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """ggml_gelu: 0.5*x*(1 + tanh(sqrt(2/pi)*x*(1 + 0.044715*x^2)))."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def rope(x: np.ndarray, pos: np.ndarray, base: float, mode: str, n_rot: int | None = None) -> np.ndarray:
    """Apply RoPE to x [n_tokens, n_heads, head_dim] at integer positions pos [n_tokens].

    mode "norm": rotate (x[2i], x[2i+1]);  mode "neox": rotate (x[i], x[i+n_rot/2]).
    theta_i = pos * base^(-2i/n_rot).  Dimensions >= n_rot pass through.
    """
    n_tok, _, d = x.shape
    n_rot = d if n_rot is None else n_rot
    half = n_rot // 2
    inv_freq = base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)  # [half]
    theta = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n_tok, half]
    cos = np.cos(theta)[:, None, :]
    sin = np.sin(theta)[:, None, :]
    out = x.copy()
    if mode == "norm":
        x0 = x[..., 0:n_rot:2]
        x1 = x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    elif mode == "neox":
        x0 = x[..., :half]
        x1 = x[..., half:n_rot]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_rot] = x0 * sin + x1 * cos
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    return out


def gelu_tanh_fp16_table(x: np.ndarray) -> np.ndarray:
    """ggml CPU's GELU as used by ``ggml_geglu_split`` (GGML_GELU_FP16, ggml-cpu/vec.h):
    0 for x <= -10, x for x >= 10, else the f16 table entry
    ``f16(gelu(f16(x)))`` (table built in ggml-cpu.c from the f16 input)."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    t = _f16(gelu_tanh(_f16(x32)))
    return np.where(x32 <= -10.0, 0.0, np.where(x32 >= 10.0, x, t))


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


# --------------------------------------------------------------------------
# GGUF reading
# --------------------------------------------------------------------------

def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load_gguf(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a GGUF file back: (weights float64 keyed by tensor name, hparams).

    Tensors are dequantized with ``gguf.quants.dequantize`` (F32/F16/BF16/Q8_0, ...)
    to float64, numpy shape = reversed GGUF ``ne``.  hparams are derived with
    llama.cpp's defaults (head_count_kv defaults to head_count, key_length to
    n_embd/n_head, rope.freq_base to 10000, rope.freq_base_swa to 10000,
    sliding-window pattern period 6 for gemma3).
    """
    import gguf
    try:
        from tinygguf import make_hparams, swa_layers  # tests/ on sys.path
    except ImportError:  # pragma: no cover - tests/ imported as a package
        from .tinygguf import make_hparams, swa_layers

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        ne = [int(v) for v in t.shape]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.asarray(a, dtype=np.float64).reshape(tuple(reversed(ne)))

    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_embd = int(g("embedding_length"))
    n_head = int(g("attention.head_count"))
    n_head_kv = int(g("attention.head_count_kv", n_head))
    head_dim = int(g("attention.key_length", n_embd // n_head))
    head_dim_v = int(g("attention.value_length", n_embd // n_head))
    if head_dim_v != head_dim:
        raise NotImplementedError("key_length != value_length")
    n_rot = int(g("rope.dimension_count", head_dim))
    if n_rot != head_dim:
        raise NotImplementedError("partial rotary (n_rot != head_dim) not supported")
    n_layer = int(g("block_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_vocab = weights["token_embd.weight"].shape[0]
    if tokens is not None and len(tokens) != n_vocab:
        raise ValueError("token list length does not match token_embd rows")
    n_swa = 0
    is_swa = [False] * n_layer
    rope_base_swa = float(g("rope.freq_base_swa", 10000.0))
    if arch == "gemma3":
        n_swa = int(g("attention.sliding_window", 0) or 0)
        pattern = g("attention.sliding_window_pattern", None)
        is_swa = swa_layers(n_layer, n_swa, pattern)
    hp = make_hparams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, n_ff=int(g("feed_forward_length")), n_vocab=n_vocab,
        ctx_len=int(g("context_length")), rms_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_base=float(g("rope.freq_base", 10000.0)), rope_base_swa=rope_base_swa,
        n_swa=n_swa, is_swa=is_swa,
        final_logit_softcapping=float(g("final_logit_softcapping", 0.0) or 0.0) if arch == "gemma3" else 0.0,
        tie_embeddings="output.weight" not in weights,
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    return weights, hp


# --------------------------------------------------------------------------
# Reference model
# --------------------------------------------------------------------------

VisibleSpec = Optional[Union[Callable[..., bool], np.ndarray]]  # typing forms: Python 3.9


class RefModel:
    """Full-sequence float64 reference of llama.cpp's forward pass.

    ``weights``: float64 arrays keyed by GGUF tensor name (numpy shape = reversed
    GGUF ne), ``hparams``: as produced by ``tinygguf.write_tiny_model`` /
    :func:`load_gguf`.

    ``kv_f16_roundtrip``: round K (after q/k-norm and RoPE) and V to float16 before
    attention, as llama.cpp's f16 KV cache does.  ``q_f16_roundtrip``: also round
    Q (after RoPE and, for gemma3, the Q pre-scale) to f16 — ggml's CPU flash
    attention converts Q to the K type; off by default.

    ``attn_fn``: optional replacement for the exact softmax attention, called per
    layer as ``attn_fn(il=, q=, k=, v=, mask=, kq_scale=, pos=)`` with ``q``
    [n, n_head, head_dim], ``k``/``v`` [n, n_head_kv, head_dim] (as cached),
    ``mask`` the boolean [n, n] layer mask; it must return the per-head output
    [n, n_head, head_dim].  ``gelu_fp16_table``: evaluate gemma3's GELU through
    ggml's CPU f16 lookup table (:func:`gelu_tanh_fp16_table`) instead of the
    exact formula.  Both are used to emulate a specific kernel's rounding (e.g.
    ggml's CPU flash-attention decode path, see tests/test_model_exact.py).
    """

    def __init__(self, weights: dict[str, np.ndarray], hparams: dict[str, Any], *,
                 kv_f16_roundtrip: bool = False, q_f16_roundtrip: bool = False,
                 attn_fn: Callable[..., np.ndarray] | None = None, gelu_fp16_table: bool = False):
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        self.hp = dict(hparams)
        self.kv_f16_roundtrip = kv_f16_roundtrip
        self.q_f16_roundtrip = q_f16_roundtrip
        self.attn_fn = attn_fn
        self.gelu_fp16_table = gelu_fp16_table
        arch = self.hp["arch"]
        if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
            raise ValueError(f"unsupported arch {arch!r}")
        self.output = self.w.get("output.weight", self.w["token_embd.weight"])

    @classmethod
    def from_gguf(cls, path: str | Path, **kw) -> "RefModel":
        weights, hp = load_gguf(path)
        return cls(weights, hp, **kw)

    # ---- masks ---------------------------------------------------------
    def _visible_matrix(self, visible: VisibleSpec, n: int, il: int) -> np.ndarray:
        if visible is None:
            return np.ones((n, n), dtype=bool)
        if callable(visible):
            try:
                nargs = len(inspect.signature(visible).parameters)
            except (TypeError, ValueError):
                nargs = 2
            if nargs >= 3:
                return np.array([[bool(visible(il, i, j)) for j in range(n)] for i in range(n)])
            return np.array([[bool(visible(i, j)) for j in range(n)] for i in range(n)])
        m = np.asarray(visible, dtype=bool)
        if m.ndim == 3:
            m = m[il]
        if m.shape != (n, n):
            raise ValueError(f"visible mask has shape {m.shape}, expected ({n}, {n}) or (n_layer, {n}, {n})")
        return m

    def layer_mask(self, pos: np.ndarray, il: int, visible: VisibleSpec = None) -> np.ndarray:
        """Boolean [n_q, n_k]: True where query i may attend key j in layer il.

        causal by position (pos_k <= pos_q), AND visible, AND on gemma3 SWA layers
        pos_q - pos_k < n_swa.
        """
        n = len(pos)
        m = pos[None, :] <= pos[:, None]
        if self.hp["is_swa"][il]:
            m &= (pos[:, None] - pos[None, :]) < self.hp["n_swa"]
        return m & self._visible_matrix(visible, n, il)

    # ---- forward -------------------------------------------------------
    # Long on purpose: one pass that reads top to bottom in the model's op order (the
    # independent reference the native graph is checked against).
    def forward(self, tokens, positions=None, visible: VisibleSpec = None, *,
                kv_f16_roundtrip: bool | None = None, return_details: bool = False,
                attn_fn: Callable[..., np.ndarray] | None = None):
        """Logits [n_tokens, n_vocab] (float64) for a causal pass over ``tokens``.

        positions: per-token integer positions (default 0..n-1); used for RoPE,
          causality and the sliding window.
        visible: extra key visibility ANDed with causal/SWA masking: a bool matrix
          [n, n] (query i, key j by token index) or [n_layer, n, n], or a callable
          ``f(i, j)`` / ``f(il, i, j)`` returning bool.
        attn_fn: overrides the constructor's ``attn_fn`` for this call.
        return_details: also return ``(logits, details)``; details holds per-layer
          lists ``q`` ([n, n_head, head_dim], after RoPE and gemma3's pre-scale),
          ``k``/``v`` ([n, n_head_kv, head_dim], as they would sit in the KV
          cache), ``attn`` (per-head attention output [n, n_head, head_dim],
          before attn_output), ``masks`` ([n, n] bool), and ``hidden`` (final
          output_norm'ed hidden state [n, n_embd]).
        """
        hp = self.hp
        w = self.w
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= hp["n_vocab"]:
            raise ValueError("token id out of range")
        n = len(tokens)
        pos = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
        if pos.shape != (n,):
            raise ValueError("positions must have one entry per token")
        kvrt = self.kv_f16_roundtrip if kv_f16_roundtrip is None else kv_f16_roundtrip
        attn_fn = self.attn_fn if attn_fn is None else attn_fn

        arch = hp["arch"]
        eps = hp["rms_eps"]
        nh, nkv, hd = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
        grp = nh // nkv
        gemma = arch == "gemma3"
        qk_norm = arch in ("qwen3", "gemma3")

        x = w["token_embd.weight"][tokens]
        if gemma:
            x = x * hp["embd_scale"]

        details: dict[str, list] = {"q": [], "k": [], "v": [], "attn": [], "masks": []}
        for il in range(hp["n_layer"]):
            p = f"blk.{il}."
            h = rms_norm(x, w[p + "attn_norm.weight"], eps)
            q = h @ w[p + "attn_q.weight"].T
            k = h @ w[p + "attn_k.weight"].T
            v = h @ w[p + "attn_v.weight"].T
            if p + "attn_q.bias" in w:
                q = q + w[p + "attn_q.bias"]
            if p + "attn_k.bias" in w:
                k = k + w[p + "attn_k.bias"]
            if p + "attn_v.bias" in w:
                v = v + w[p + "attn_v.bias"]
            q = q.reshape(n, nh, hd)
            k = k.reshape(n, nkv, hd)
            v = v.reshape(n, nkv, hd)
            if qk_norm:
                q = rms_norm(q, w[p + "attn_q_norm.weight"], eps)
                k = rms_norm(k, w[p + "attn_k_norm.weight"], eps)
            base = hp["rope_base_swa"] if hp["is_swa"][il] else hp["rope_base"]
            q = rope(q, pos, base, hp["rope_type"], hp.get("n_rot", hd))
            k = rope(k, pos, base, hp["rope_type"], hp.get("n_rot", hd))
            if gemma:
                q = q * hp["attn_scale"]
                kq_scale = 1.0
            else:
                kq_scale = hp["attn_scale"]
            if kvrt:
                k = _f16(k)
                v = _f16(v)
            if self.q_f16_roundtrip:
                q = _f16(q)

            mask = self.layer_mask(pos, il, visible)
            if not mask.any(axis=1).all():
                bad = np.nonzero(~mask.any(axis=1))[0].tolist()
                raise ValueError(f"layer {il}: queries {bad} have no visible keys")
            if attn_fn is not None:
                o3 = np.asarray(attn_fn(il=il, q=q, k=k, v=v, mask=mask, kq_scale=kq_scale, pos=pos),
                                dtype=np.float64)
                if o3.shape != (n, nh, hd):
                    raise ValueError(f"attn_fn returned shape {o3.shape}, expected {(n, nh, hd)}")
            else:
                kk = np.repeat(k, grp, axis=1)  # [n, nh, hd], head h -> kv head h // grp
                vv = np.repeat(v, grp, axis=1)
                # (batched matmuls: same as einsum("ihd,jhd->hij") / ("hij,jhd->ihd"), BLAS-fast)
                s = np.matmul(q.transpose(1, 0, 2), kk.transpose(1, 2, 0)) * kq_scale
                s = np.where(mask[None], s, -np.inf)
                s = s - s.max(axis=-1, keepdims=True)
                pr = np.exp(s)
                pr = pr / pr.sum(axis=-1, keepdims=True)
                o3 = np.matmul(pr, vv.transpose(1, 0, 2)).transpose(1, 0, 2)  # [n, nh, hd]
            o = o3.reshape(n, nh * hd)
            a = o @ w[p + "attn_output.weight"].T
            if gemma:
                a = rms_norm(a, w[p + "post_attention_norm.weight"], eps)
            x = x + a

            h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
            gt = h @ w[p + "ffn_gate.weight"].T
            up = h @ w[p + "ffn_up.weight"].T
            if gemma:
                act = gelu_tanh_fp16_table(gt) if self.gelu_fp16_table else gelu_tanh(gt)
            else:
                act = silu(gt)
            f = (act * up) @ w[p + "ffn_down.weight"].T
            if gemma:
                f = rms_norm(f, w[p + "post_ffw_norm.weight"], eps)
            x = x + f

            if return_details:
                details["q"].append(q)
                details["k"].append(k)
                details["v"].append(v)
                details["attn"].append(o3)
                details["masks"].append(mask)

        hN = rms_norm(x, w["output_norm.weight"], eps)
        logits = hN @ self.output.T
        if "output.bias" in w:
            logits = logits + w["output.bias"]
        cap = hp.get("final_logit_softcapping", 0.0)
        if cap:
            logits = cap * np.tanh(logits / cap)
        if return_details:
            details["hidden"] = hN
            return logits, details
        return logits

    __call__ = forward
