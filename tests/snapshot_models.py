"""Two tiny models for the C++ snapshot tests (tests/cpp/test_snapshot_corpus.cpp, under ASan/UBSan in
CI) and the snapshot fuzz target (bench/fuzz/fuzz_snapshot.cpp):

    python tests/snapshot_models.py OUT_DIR     # writes OUT_DIR/llama.gguf, gemma3.gguf and qwen35.gguf

llama.gguf: one layer (tests/gguf_corpus.py's valid model, with a 4096-token context); gemma3.gguf: two
layers, the first a 32-token sliding window (so its snapshots hold a ring), the second global; qwen35.gguf:
two layers, a Gated DeltaNet layer (so its snapshots hold a RECR section) and a gated full-attention one,
its ssm_a negative (a decaying state stays finite over the corpus's 600 tokens).  Written
with the standard library only (gguf_corpus.build), as the sanitizer leg runs it with a bare Python.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_corpus as g  # noqa: E402


def llama() -> bytes:
    kv = g._set(g.base_kv(), "llama.context_length", v=4096)
    return g.build(kv)


def gemma3() -> bytes:
    a = "gemma3."
    E, F, D = g.N_EMBD, g.N_FF, g.HEAD_DIM
    Q, K = g.N_HEAD * D, g.N_HEAD_KV * D
    kv = [("general.architecture", g.STR, "gemma3"), ("general.alignment", g.U32, g.ALIGN),
          (a + "block_count", g.U32, 2), (a + "context_length", g.U32, 4096), (a + "embedding_length", g.U32, E),
          (a + "feed_forward_length", g.U32, F), (a + "attention.head_count", g.U32, g.N_HEAD),
          (a + "attention.head_count_kv", g.U32, g.N_HEAD_KV), (a + "attention.key_length", g.U32, D),
          (a + "attention.value_length", g.U32, D), (a + "rope.dimension_count", g.U32, D),
          (a + "attention.layer_norm_rms_epsilon", g.F32, 1e-6), (a + "rope.freq_base", g.F32, 1000000.0),
          (a + "rope.freq_base_swa", g.F32, 10000.0), (a + "attention.sliding_window", g.U32, 32),
          (a + "attention.sliding_window_pattern", g.U32, 2), (a + "vocab_size", g.U32, g.N_VOCAB)]
    tensors = [["token_embd.weight", [E, g.N_VOCAB], g.T_F32], ["output_norm.weight", [E], g.T_F32]]
    for il in range(2):
        b = f"blk.{il}."
        tensors += [[b + "attn_norm.weight", [E], g.T_F32], [b + "attn_q.weight", [E, Q], g.T_F32],
                    [b + "attn_k.weight", [E, K], g.T_F32], [b + "attn_v.weight", [E, K], g.T_F32],
                    [b + "attn_q_norm.weight", [D], g.T_F32], [b + "attn_k_norm.weight", [D], g.T_F32],
                    [b + "attn_output.weight", [Q, E], g.T_F32], [b + "post_attention_norm.weight", [E], g.T_F32],
                    [b + "ffn_norm.weight", [E], g.T_F32], [b + "ffn_gate.weight", [E, F], g.T_F32],
                    [b + "ffn_up.weight", [E, F], g.T_F32], [b + "ffn_down.weight", [F, E], g.T_F32],
                    [b + "post_ffw_norm.weight", [E], g.T_F32]]
    return g.build(kv, tensors)


def qwen35() -> bytes:
    a = "qwen35."
    E, F, D = g.N_EMBD, g.N_FF, g.HEAD_DIM
    state, groups, heads, conv = 8, 2, 4, 4
    key, value = state * groups, state * heads
    C = 2 * key + value
    kv = [("general.architecture", g.STR, "qwen35"), ("general.alignment", g.U32, g.ALIGN),
          (a + "block_count", g.U32, 2), (a + "context_length", g.U32, 4096), (a + "embedding_length", g.U32, E),
          (a + "feed_forward_length", g.U32, F), (a + "attention.head_count", g.U32, g.N_HEAD),
          (a + "attention.head_count_kv", g.U32, g.N_HEAD_KV), (a + "attention.key_length", g.U32, D),
          (a + "attention.value_length", g.U32, D), (a + "rope.dimension_count", g.U32, D // 4),
          (a + "attention.layer_norm_rms_epsilon", g.F32, 1e-6), (a + "rope.freq_base", g.F32, 10000.0),
          (a + "rope.dimension_sections", g.ARR, (g.I32, [2, 1, 1, 0])),
          (a + "full_attention_interval", g.U32, 2), (a + "ssm.conv_kernel", g.U32, conv),
          (a + "ssm.inner_size", g.U32, value), (a + "ssm.state_size", g.U32, state),
          (a + "ssm.time_step_rank", g.U32, heads), (a + "ssm.group_count", g.U32, groups),
          (a + "vocab_size", g.U32, g.N_VOCAB)]
    tensors = [["token_embd.weight", [E, g.N_VOCAB], g.T_F32], ["output_norm.weight", [E], g.T_F32]]
    for il in range(2):
        b = f"blk.{il}."
        tensors += [[b + "attn_norm.weight", [E], g.T_F32], [b + "post_attention_norm.weight", [E], g.T_F32]]
        if il == 0:
            tensors += [[b + "attn_qkv.weight", [E, C], g.T_F32], [b + "attn_gate.weight", [E, value], g.T_F32],
                        [b + "ssm_conv1d.weight", [conv, C], g.T_F32], [b + "ssm_dt.bias", [heads], g.T_F32],
                        [b + "ssm_a", [heads], g.T_F32], [b + "ssm_beta.weight", [E, heads], g.T_F32],
                        [b + "ssm_alpha.weight", [E, heads], g.T_F32], [b + "ssm_norm.weight", [state], g.T_F32],
                        [b + "ssm_out.weight", [value, E], g.T_F32]]
        else:
            tensors += [[b + "attn_q.weight", [E, 2 * D * g.N_HEAD], g.T_F32],
                        [b + "attn_k.weight", [E, D * g.N_HEAD_KV], g.T_F32],
                        [b + "attn_v.weight", [E, D * g.N_HEAD_KV], g.T_F32],
                        [b + "attn_output.weight", [D * g.N_HEAD, E], g.T_F32],
                        [b + "attn_q_norm.weight", [D], g.T_F32], [b + "attn_k_norm.weight", [D], g.T_F32]]
        tensors += [[b + "ffn_gate.weight", [E, F], g.T_F32], [b + "ffn_up.weight", [E, F], g.T_F32],
                    [b + "ffn_down.weight", [F, E], g.T_F32]]
    return _with_values(g.build(kv, tensors), tensors, {"blk.0.ssm_a": [-0.5, -0.25, -1.0, -0.125]})


def _with_values(blob: bytes, tensors: list, values: dict) -> bytes:
    """The file with some F32 tensors' data replaced (gguf_corpus.build writes small deterministic values,
    of either sign): the data section is the last, each tensor padded to the alignment."""
    out = bytearray(blob)
    sizes = [g._pad(g._nbytes(d, t)) for _, d, t in tensors]
    start = len(out) - sum(sizes)
    off = 0
    for (name, dims, t), size in zip(tensors, sizes):
        if name in values:
            data = b"".join(struct.pack("<f", v) for v in values[name])
            assert t == g.T_F32 and len(data) == g._nbytes(dims, t)
            out[start + off:start + off + len(data)] = data
        off += size
    return bytes(out)


def write(out_dir) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, blob in (("llama", llama()), ("gemma3", gemma3()), ("qwen35", qwen35())):
        p = out / f"{name}.gguf"
        p.write_bytes(blob)
        paths.append(p)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(" ".join(str(p) for p in write(sys.argv[1])))
