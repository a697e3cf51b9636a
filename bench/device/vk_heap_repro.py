"""A heap corruption on the Vulkan device path (found 2026-12-05 on lavapipe, Mesa 22.3.6; not yet fixed).

One pooled session on a Vulkan device: a prompt that does not yet evict (1900 or 2048 tokens into a
2048-token pool), a few greedy decode steps (one-token graphs), then more prompt (chunk-sized pieces that
evict) -> glibc aborts ("malloc(): unaligned tcache chunk detected") or a segfault inside libvulkan_lvp.so
during a graph compute.  What does not crash: a prompt that already evicted before the decode steps (2100
tokens), prefilling past the pool with no decode steps in between (one or two sessions), the host store in
RAM or in a file alike (so not the pinned buffers), the same sequence on the CPU backend, and the whole
sequence under glibc's debugging allocator (LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3).
The suspect (not proven): ggml-vulkan grows a context's scratch buffers inside a graph when one needs more
than any graph before it -- flash attention's split-k temporaries (ggml-vulkan.cpp: prealloc_size_split_k,
ggml_vk_preallocate_buffers destroys the old buffer and creates a bigger one) depend on the query count, a
one-token decode graph sizes them first, and the chunk-sized pieces after it need more: the same class as
the crash the runtimes' reserved compute buffers avoided (ARCHITECTURE.md), which happened only when such a
buffer grew after another had been freed.  Seen with ggml-vulkan's memory log (a build with
-Ccmake.define.GGML_VULKAN_MEMORY_DEBUG=ON, run with GGML_VK_MEMORY_LOGGER=1): the decode steps allocate the
split-k temporary at 16896 bytes; the first piece after them regrows it to 67584 (the old buffer destroyed, a new
one made); then the host store's first pinned buffer is allocated (the first page-out) and the process dies in
the next compute.  prealloc_x also regrows (384 -> 512 KiB) during the first prompt without a crash, so regrowth
alone is not the whole story.  The test that points at it: the same sequence with a 64-token piece evaluated
before the decode steps (the split-k temporary sized 67584 at once, never regrown) runs to the end with its
page-outs; with a 2-token piece there instead (16896 -> 59136 -> 67584) it crashes.  So the fix to try: on a GPU
runtime, have ggml-vulkan size that temporary to its largest before any graph needs less -- e.g. a warm-up of
flash attention alone over the pool's extent at the query counts that need the most (chunk-sized pieces) when
the runtime is made -- and confirm with this script and ASan.

    GGML_VK_VISIBLE_DEVICES=0 python bench/device/vk_heap_repro.py MODEL.gguf   # any small llama GGUF

Exit status 0 and "ok" when the sequence survives; the process dies otherwise.
"""
import sys

import numpy as np

import kvflash

model = sys.argv[1]
s = kvflash.Session(model, max_ctx=8192, kvflash=2048, device="vulkan:0", threads=1, verbose=False, policy="lru")
toks = np.random.default_rng(0).integers(0, 1000, 8192).astype(np.int32).tolist()
s.prefill(toks[:1900])                                # nothing evicted yet
for _ in s.generate(max_tokens=4, ignore_eos=True):  # one-token graphs
    pass
print("decoded to", s.n_past, "page-outs", s.pager.stats["page_outs"], flush=True)
s.prefill(toks[2100:2612])                            # pieces that evict: the crash lands here
print("ok", s.n_past)
