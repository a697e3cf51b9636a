"""A crash of Debian 12's lavapipe (Mesa 22.3.6) on kvflash's device path; Mesa 25's lavapipe runs it clean.

One pooled session on a Vulkan device: a prompt that does not yet evict (1900 or 2048 tokens into a
2048-token pool), a few greedy decode steps (one-token graphs), then more prompt (chunk-sized pieces that
evict) -> glibc aborts ("malloc(): unaligned tcache chunk detected") or a segfault inside libvulkan_lvp.so
during a graph compute.  Decode steps are not needed: 1900 tokens and then 512 more in a second call crash
too.  Fine: the same sequences on the CPU backend, and under glibc's debugging allocator
(LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3).
What is known (2026-12-05, two sessions):
- The fault is inside lavapipe, on its queue thread, while it executes a submitted command buffer: an
  indirect call through a NULL table (`call *0xe8(%rax)`, rax = 0) in a loop that drops reference counts
  (`lock subl $1`) -- the shape of releasing a gallium resource whose memory was already freed.  The main
  thread is waiting in ggml_backend_graph_compute.  Other runs abort in glibc ("malloc(): unaligned tcache
  chunk detected"): the same freed memory reused.
- Every crash so far comes after ggml-vulkan destroyed and regrew its flash-attention split-k temporary
  during a graph (ggml_vk_preallocate_buffers) and then the first pinned host buffer was allocated (the
  host store's first region, at the first page-out).  Not every such sequence crashes.
- Not the KV type (f16, q8_0 and q4_0 all crash on some sequence), not the host store (RAM or file), not
  descriptor reuse (GGML_VK_DISABLE_DESCRIPTOR_REUSE=1 still crashes), not host-visible device memory
  (GGML_VK_DISABLE_HOST_VISIBLE_VIDMEM=1 still crashes), not the page-out copies left in an open command
  buffer (the pool's mover now records an event after every page event, which submits them; still
  crashes).  The earlier idea -- size the split-k temporary before any graph needs less -- does not hold:
  a 64-token piece first, or a 2100-token prefill first (the pool's whole extent), then truncate(0),
  still crash on other sequences.
- Khronos' validation layer (core, synchronization and GPU-assisted validation; Debian 12's
  vulkan-validationlayers 1.3.239) reports no misuse by the application: no destroyed-while-in-use buffer,
  no out-of-bounds shader access; only write-after-read hazards between ggml's own dispatches.  Under
  GPU-assisted validation the sequence runs to the end.  Electric Fence (guard pages on every malloc, freed
  memory protected) finds no overrun in the process's heap before the same fault.  Valgrind cannot run it
  (ggml's AVX-512 code).
- The deciding run: Debian 13's lavapipe (Mesa 25.0.7, LLVM 19; bench/device/mesa25-lavapipe.sh runs it on
  this Debian 12 box under trixie's glibc) runs this script and every crashing variant found (f16, q8_0 and
  q4_0; one call or two; with or without decode steps) to the end, with the same kvflash and ggml binaries.
So it is a bug of Debian 12's lavapipe (Mesa 22.3.6), fixed by Mesa 25; there are no debug symbols for Mesa
here to name the function.  tests/test_gpu.py::test_a_session_that_starts_evicting_late runs two of these
sequences against the CPU's logits, skipped on lavapipe built on LLVM <= 15 (Debian 12's).  Smaller sequences to try (exp-style): prompt 1900 into a 2048 pool, then 468
tokens in one call (5 page-outs, fine), then 1 token -> crash; 2 tokens or 64 there -> fine.

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
