"""Two tiny models for the C++ snapshot tests (tests/cpp/test_snapshot_corpus.cpp, under ASan/UBSan in
CI) and the snapshot fuzz target (bench/fuzz/fuzz_snapshot.cpp):

    python tests/snapshot_models.py OUT_DIR     # writes OUT_DIR/llama.gguf and OUT_DIR/gemma3.gguf

llama.gguf: one layer (tests/gguf_corpus.py's valid model, with a 4096-token context); gemma3.gguf: two
layers, the first a 32-token sliding window (so its snapshots hold a ring), the second global.  Written
with the standard library only (gguf_corpus.build), as the sanitizer leg runs it with a bare Python.
"""
from __future__ import annotations

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


def write(out_dir) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, blob in (("llama", llama()), ("gemma3", gemma3())):
        p = out / f"{name}.gguf"
        p.write_bytes(blob)
        paths.append(p)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(" ".join(str(p) for p in write(sys.argv[1])))
