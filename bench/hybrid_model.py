"""Writes the random-weight qwen35 GGUF the issue-38 bench figures are measured on.

    python bench/hybrid_model.py OUT.gguf [--layers 8] [--embd 1024] [--vocab 16384] [--seed 38]

No real Qwen3.5 weights can be had on these machines; speed and memory do not depend on the weights'
values, so a random-weight file of a plausible small shape stands in for them (quality figures are never
taken on it).  The default shape, scaled down from Qwen3.5's layout: 8 layers, full attention every 4th
(layers 3 and 7; 8 query heads, 2 KV heads of 128, a quarter of the head rotated), 6 Gated DeltaNet layers
(4 key groups, 8 value heads, state 128, conv kernel 4), a 1024-wide FFN (narrow, so attention's share
shows, and a 16K prefill takes minutes, not a quarter hour, on 2 cores), f16 weights, a 16384-token
byte-level vocab (tests/tinygguf.py's, padded): 175 MiB.  Prints the file's path, size and shape as JSON, which a
result's README row quotes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tinygguf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--seed", type=int, default=38)
    a = ap.parse_args(argv)
    if a.layers < 4 or a.layers % 4:
        ap.error("--layers must be a positive multiple of 4 (a full-attention layer every 4th)")
    shape = dict(n_layer=a.layers, n_embd=a.embd, n_head=8, n_head_kv=2, head_dim=128, n_ff=a.ff,
                 full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_dt_rank=8, ssm_n_group=4,
                 n_vocab=a.vocab, ctx_len=a.ctx, seed=a.seed, weight_type="f16")
    info = tinygguf.write_tiny_hybrid(a.out, "qwen35", **shape)
    print(json.dumps({"path": info["path"], "bytes": Path(a.out).stat().st_size, "arch": "qwen35", **shape}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
