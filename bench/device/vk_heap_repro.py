"""A heap corruption on the Vulkan device path (found 2026-12-05 on lavapipe, Mesa 22.3.6; not yet fixed).

One pooled session on a Vulkan device: a prompt that fills the pool exactly, a few greedy decode steps (the
first one evicts a chunk: a page-out queued on the device from a one-token graph), then more prompt (pieces
that evict and recall) -> glibc aborts ("malloc(): unaligned tcache chunk detected") or a segfault inside
libvulkan_lvp.so during the next graph compute, i.e. something wrote past or after a heap block earlier.
Prefilling past the pool without the decode steps in between (any number of sessions), or decoding past
the pool after a longer prefill, does not crash; on the CPU backend the same sequence is fine.  With glibc's
debugging allocator (LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3) it runs to the end: a small
overrun or a late write whose landing place the allocator's padding changes.  Next steps: an ASan build of
the Vulkan variant (the async page-out's destination and the decode mask's host vector first), or
valgrind on a smaller geometry.

    GGML_VK_VISIBLE_DEVICES=0 python bench/device/vk_heap_repro.py MODEL.gguf   # any small llama GGUF

Exit status 0 and "ok" when the sequence survives; the process dies otherwise.
"""
import sys

import numpy as np

import kvflash

model = sys.argv[1]
s = kvflash.Session(model, max_ctx=8192, kvflash=2048, device="vulkan:0", threads=1, verbose=False, policy="lru")
toks = np.random.default_rng(0).integers(0, 1000, 8192).astype(np.int32).tolist()
s.prefill(toks[:2048])                                # the pool exactly full
for _ in s.generate(max_tokens=4, ignore_eos=True):  # the first step evicts
    pass
print("decoded to", s.n_past, "page-outs", s.pager.stats["page_outs"], flush=True)
s.prefill(toks[2100:2612])                            # more prompt: the crash lands here
print("ok", s.n_past)
