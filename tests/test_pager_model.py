"""Stateful property test: kvflash.Pager against a pure-Python model.

The model mirrors the documented semantics of csrc/kvflash/pager.h exactly enough
to predict every observable: which block each chunk gets (LIFO free list), which
victim is evicted (LRU by last-use tick; with scores, lowest score first, ties by
LRU, unscored chunks = +inf), reselect's target set and recall order, NO_ROOM,
host-buffer indices (the HostStore slab's LIFO free list), all stats counters and
the epoch.  On top, every written position carries a byte stamp (per position and
write version, every layer, K and V) that must survive any sequence of paging.

Writes are decode-style: appends at the written extent plus re-writes inside it, so
the written set is always a prefix [0, extent) (see the xfail tests in
test_pager.py for truncate with gaps).
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvflash

INF = math.inf
C = 64
N_CHUNKS = 24
MAX_CTX = C * N_CHUNKS - 17  # last chunk is partial
N_LAYERS = 2
HOST_ALIGN = 256

# (pool_tokens, sink_chunks, tail_window_chunks)
CONFIGS = [(512, 1, 4), (256, 0, 0), (512, 2, 1), (768, 1, 4), (256, 1, 1)]


class HostModel:
    """kvflash::HostStore: slab regions (16, then doubling), LIFO free list."""

    def __init__(self):
        self.cap = 0
        self.free = []
        self.in_use = 0
        self.next_region = 16

    def acquire(self):
        if not self.free:
            count = self.next_region
            for i in range(count - 1, -1, -1):
                self.free.append(self.cap + i)
            self.cap += count
            self.next_region = self.cap
        self.in_use += 1
        return self.free.pop()

    def release(self, h):
        self.free.append(h)
        self.in_use -= 1

    def clear(self):
        self.free = list(range(self.cap - 1, -1, -1))
        self.in_use = 0

    def release_memory(self):  # Pager::reset: the regions go back to the OS
        self.cap, self.free, self.in_use, self.next_region = 0, [], 0, 16


class Model:
    def __init__(self, n_blocks, n_chunks, sinks, tail, chunk_bytes):
        self.nb, self.nc, self.sinks, self.tail, self.cb = n_blocks, n_chunks, sinks, tail, chunk_bytes
        self.host = HostModel()
        self.epoch = 0
        self.reset()
        self.epoch = 0

    def reset(self):
        nc = self.nc
        self.block = [-1] * nc
        self.hostbuf = [-1] * nc
        self.written = [set() for _ in range(nc)]
        self.dirty = [False] * nc
        self.last_use = [0] * nc
        self.score = [INF] * nc
        self.chunk_of = [-1] * self.nb
        self.free = list(range(self.nb - 1, -1, -1))
        self.host.release_memory()
        self.has_scores = False
        self.head = -1
        self.tick = 0
        self.st = dict(page_outs=0, page_ins=0, clean_skips=0, bytes_out=0, bytes_in=0)
        self.epoch += 1

    # -- protection / victims
    def protected_under(self, c, head):
        return c < self.sinks or (head >= 0 and head - self.tail <= c <= head)

    def is_protected(self, c):
        return self.protected_under(c, self.head)

    def pick_victim(self, head, lo, hi):
        cands = [c for c in self.chunk_of if c >= 0 and not (lo <= c <= hi) and not self.protected_under(c, head)]
        if not cands:
            return -1
        if self.has_scores:
            return min(cands, key=lambda c: (self.score[c], self.last_use[c]))
        return min(cands, key=lambda c: self.last_use[c])

    # -- primitives
    def do_evict(self, c):
        b = self.block[c]
        if self.hostbuf[c] < 0:
            self.hostbuf[c] = self.host.acquire()
        if self.dirty[c]:
            self.st["page_outs"] += 1
            self.st["bytes_out"] += self.cb
            self.dirty[c] = False
        else:
            self.st["clean_skips"] += 1
        self.chunk_of[b] = -1
        self.block[c] = -1
        self.free.append(b)
        self.epoch += 1

    def do_place(self, c, b):
        self.chunk_of[b] = c
        self.block[c] = b
        if self.hostbuf[c] >= 0:
            self.st["page_ins"] += 1
            self.st["bytes_in"] += self.cb
            self.dirty[c] = False
        else:
            self.dirty[c] = True
        self.tick += 1
        self.last_use[c] = self.tick
        self.epoch += 1

    def take_block(self, head, lo, hi):
        if not self.free:
            v = self.pick_victim(head, lo, hi)
            assert v >= 0, "model: take_block without a victim"
            self.do_evict(v)
        return self.free.pop()

    # -- API
    def alloc_span(self, pos0, n):
        c0, c1 = pos0 // C, (pos0 + n - 1) // C
        new_head = max(self.head, c1)
        need = sum(self.block[c] < 0 for c in range(c0, c1 + 1))
        if need:
            avail = len(self.free) + sum(
                1 for c in self.chunk_of if c >= 0 and not (c0 <= c <= c1) and not self.protected_under(c, new_head))
            if avail < need:
                return None
        for c in range(c0, c1 + 1):
            if self.block[c] < 0:
                self.do_place(c, self.take_block(new_head, c0, c1))
        slots = []
        last_c = -1
        for p in range(pos0, pos0 + n):
            c, i = divmod(p, C)
            if i not in self.written[c]:
                if not self.written[c]:
                    self.score[c] = INF
                self.written[c].add(i)
            slots.append(self.block[c] * C + i)
            if c != last_c:
                self.dirty[c] = True
                self.tick += 1
                self.last_use[c] = self.tick
                last_c = c
        self.head = new_head
        return slots

    def evict_error(self, c):
        if not (0 <= c < self.nc):
            return IndexError, "outside"
        if self.block[c] < 0:
            return ValueError, "not resident"
        if self.is_protected(c):
            return ValueError, "protected"
        return None

    def recall_error(self, c):
        if not (0 <= c < self.nc):
            return IndexError, "outside"
        if self.block[c] >= 0:
            return ValueError, "already resident"
        if self.hostbuf[c] < 0 or not self.written[c]:
            return ValueError, "not on the host"
        return None

    def recall(self, c):
        if not self.free and self.pick_victim(self.head, c, c) < 0:
            return False
        self.do_place(c, self.take_block(self.head, c, c))
        return True

    def set_scores(self, s):
        for c in range(self.nc):
            self.score[c] = float(s[c]) if c < len(s) else INF
        self.has_scores = True

    def clear_scores(self):
        self.score = [INF] * self.nc
        self.has_scores = False

    def reselect(self, s):
        self.set_scores(s)
        prot, rest = [], []
        for c in range(self.head + 1):
            if self.written[c]:
                (prot if self.is_protected(c) else rest).append(c)
        keep = max(0, self.nb - len(prot))
        if len(rest) > keep:
            rest.sort(key=lambda c: (-self.score[c], self.block[c] < 0, -self.last_use[c]))
        n_keep = min(keep, len(rest))
        target = set(prot) | set(rest[:n_keep])
        moved = 0
        for b in range(self.nb):
            c = self.chunk_of[b]
            if c >= 0 and c not in target:
                self.do_evict(c)
                moved += 1
        for c in rest[:n_keep]:
            if self.block[c] >= 0:
                continue
            self.do_place(c, self.free.pop())
            moved += 1
        return moved

    def truncate(self, n_past):
        for c in range(self.head, n_past // C - 1, -1):   # last chunk first (its block is freed first)
            self.written[c] = {i for i in self.written[c] if c * C + i < n_past}
            if not self.written[c]:
                if self.block[c] >= 0:
                    b = self.block[c]
                    self.chunk_of[b] = -1
                    self.block[c] = -1
                    self.free.append(b)
                if self.hostbuf[c] >= 0:
                    self.host.release(self.hostbuf[c])
                    self.hostbuf[c] = -1
                self.dirty[c] = False
                self.score[c] = INF
        self.head = (n_past - 1) // C if n_past > 0 else -1
        for c in range(max(0, self.head - self.tail), self.head + 1):
            if self.written[c] and self.block[c] < 0:
                self.do_place(c, self.take_block(self.head, c, c))
        self.epoch += 1

    # -- observables
    def slot_positions(self, pool_tokens):
        sp = np.full(pool_tokens, -1, dtype=np.int64)
        for c in range(self.nc):
            b = self.block[c]
            if b >= 0:
                for i in self.written[c]:
                    sp[b * C + i] = c * C + i
        return sp

    def stats(self):
        s = dict(self.st)
        s["epoch"] = self.epoch
        s["resident_chunks"] = sum(b >= 0 for b in self.block)
        s["host_chunks"] = sum(b < 0 and h >= 0 for b, h in zip(self.block, self.hostbuf))
        s["materialised_chunks"] = sum(bool(w) for w in self.written)
        s["n_blocks"] = self.nb
        s["free_blocks"] = len(self.free)
        s["host_bytes"] = self.host.in_use * self.cb
        s["host_reserved_bytes"] = self.host.cap * ((self.cb + HOST_ALIGN - 1) // HOST_ALIGN * HOST_ALIGN)
        s["max_host_bytes"] = 0
        return s


def stamp(pos, ver, layer, kind, width):
    """Deterministic bytes for (position, write version, layer, K/V): [len(pos), width] uint8."""
    pos = np.asarray(pos, dtype=np.uint64)[:, None]
    ver = np.asarray(ver, dtype=np.uint64)[:, None]
    j = np.arange(width, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = pos * np.uint64(0x9E3779B97F4A7C15) + ver * np.uint64(0xC2B2AE3D27D4EB4F)
        h = h + np.uint64(layer * 131 + kind * 7 + 1) * np.uint64(0x165667B19E3779F9) + j * np.uint64(0x27D4EB2F165667C5)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    return (h & np.uint64(0xFF)).astype(np.uint8)


class PagerMachine(RuleBasedStateMachine):
    @initialize(cfg=st.sampled_from(CONFIGS), kv=st.sampled_from(["f16", "q8_0", "q4_0"]),
                prefill=st.integers(0, MAX_CTX), piece=st.integers(1, 200))
    def setup(self, cfg, kv, prefill, piece):
        pool, sinks, tail = cfg
        self.p = kvflash.Pager(pool_tokens=pool, max_ctx=MAX_CTX, n_layers=N_LAYERS, n_embd_k=64, n_embd_v=32,
                               kv_type=kv, sink_chunks=sinks, tail_window_chunks=tail)
        self.m = Model(self.p.n_blocks, self.p.n_chunks, sinks, tail, self.p.chunk_bytes)
        assert self.p.n_chunks == N_CHUNKS
        self.extent = 0
        self.ver = np.zeros(MAX_CTX, dtype=np.int64)
        self.rows = [(self.p.k_rows(il), self.p.v_rows(il)) for il in range(N_LAYERS)]
        self.pool_bytes = self.p.pool_bytes
        self.n_no_room = 0
        # Start (usually) past the pool size, so eviction pressure exists from the first rule.
        while self.extent < prefill:
            n = min(piece, prefill - self.extent)
            if not self._write(self.extent, n):
                break
            self.extent += n

    # ---------------------------------------------------------------- helpers
    def _write(self, pos0, n):
        got = self.p.alloc_span(pos0, n)
        want = self.m.alloc_span(pos0, n)
        if want is None:
            assert got is None, "pager allocated where the model expects NO_ROOM"
            self.n_no_room += 1
            return False
        assert got is not None, f"pager NO_ROOM for [{pos0}, {pos0 + n}), model expects slots"
        assert got.tolist() == want, "slots differ from the model"
        pos = np.arange(pos0, pos0 + n)
        self.ver[pos] += 1
        for il, (k, v) in enumerate(self.rows):
            k[got] = stamp(pos, self.ver[pos], il, 0, k.shape[1])
            v[got] = stamp(pos, self.ver[pos], il, 1, v.shape[1])
        return True

    def _expect_error(self, err, fn):
        exc, msg = err
        try:
            fn()
        except exc as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(f"expected {exc.__name__} ({msg})")

    def _random_scores(self, data, n):
        # Mostly few distinct values, so ties (broken by residency, then recency) are common.
        elem = data.draw(st.sampled_from(["tie", "tie", "small", "any"]))
        if elem == "tie":
            e = st.sampled_from([0.0, 1.0])
        elif elem == "small":
            e = st.integers(-3, 3).map(float)
        else:
            e = st.one_of(st.floats(-1e3, 1e3, width=32), st.sampled_from([0.0, INF, -INF]))
        vals = data.draw(st.lists(e, min_size=n, max_size=n))
        return np.asarray(vals, dtype=np.float32)

    # ---------------------------------------------------------------- rules
    @rule(n=st.one_of(st.integers(1, 8), st.integers(1, 200)))
    def append(self, n):
        n = min(n, MAX_CTX - self.extent)
        if n <= 0:
            return
        if self._write(self.extent, n):
            self.extent += n

    @rule(chunks=st.integers(1, 3))
    def append_chunks(self, chunks):
        self.append(chunks * C)

    @precondition(lambda self: self.extent > 0)
    @rule(data=st.data())
    def rewrite(self, data):
        pos0 = data.draw(st.integers(0, self.extent - 1))
        n = data.draw(st.integers(1, min(self.extent - pos0, 4 * C)))
        self._write(pos0, n)

    @rule(c=st.integers(-1, N_CHUNKS))
    def evict(self, c):
        err = self.m.evict_error(c)
        if err:
            self._expect_error(err, lambda: self.p.evict(c))
        else:
            self.p.evict(c)
            self.m.do_evict(c)

    @precondition(lambda self: self.extent > 0)
    @rule(data=st.data())
    def evict_resident(self, data):
        # Aim at something evictable more often than the blind rule does.
        ok = [c for c in range(N_CHUNKS) if self.m.evict_error(c) is None]
        if ok:
            self.evict(data.draw(st.sampled_from(ok)))

    @rule(c=st.integers(-1, N_CHUNKS))
    def recall(self, c):
        err = self.m.recall_error(c)
        if err:
            self._expect_error(err, lambda: self.p.recall(c))
        else:
            assert self.p.recall(c) == self.m.recall(c)

    @rule(data=st.data())
    def recall_host(self, data):
        ok = [c for c in range(N_CHUNKS) if self.m.recall_error(c) is None]
        if ok:
            self.recall(data.draw(st.sampled_from(ok)))

    @rule(data=st.data())
    def swap(self, data):
        # Evict one chunk and recall another into its block: the pool stays full while a
        # recently used chunk sits on the host (exercises reselect's residency tie-break).
        self.evict_resident(data)
        self.recall_host(data)

    @rule(data=st.data())
    def set_scores(self, data):
        s = self._random_scores(data, data.draw(st.integers(0, N_CHUNKS)))
        self.p.set_scores(s)
        self.m.set_scores(s)

    @rule(data=st.data())
    def reselect(self, data):
        s = self._random_scores(data, data.draw(st.integers(0, N_CHUNKS)))
        assert self.p.reselect(s) == self.m.reselect(s)

    @rule()
    def clear_scores(self):
        self.p.clear_scores()
        self.m.clear_scores()

    @rule(data=st.data())
    def truncate(self, data):
        n_past = data.draw(st.integers(0, self.extent))
        self.p.truncate(n_past)
        self.m.truncate(n_past)
        self.extent = n_past

    @rule()
    def reset(self):
        self.p.reset()
        self.m.reset()
        self.extent = 0

    @rule(data=st.data())
    def mask(self, data):
        q = data.draw(st.lists(st.integers(0, MAX_CTX + 5), min_size=1, max_size=3))
        w = data.draw(st.sampled_from([0, 1, 10, 64, 200]))
        m = self.p.mask(np.array(q), n_kv=self.p.pool_tokens + 256, window=w)
        sp = self.m.slot_positions(self.p.pool_tokens)
        assert m.dtype == np.float16
        for r, qp in enumerate(q):
            ok = (sp >= 0) & (sp <= qp)
            if w:
                ok &= sp > qp - w
            want = np.where(ok, np.float16(0), np.float16(-np.inf))
            assert np.array_equal(m[r, : len(sp)], want)
            assert np.all(m[r, len(sp):] == np.float16(-np.inf))

    # ---------------------------------------------------------------- invariants
    @invariant()
    def matches_model(self):
        if not hasattr(self, "p"):
            return
        p, m = self.p, self.m
        p.check_invariants()
        t = p.chunk_table()
        assert t["block"].tolist() == m.block, (t["block"].tolist(), m.block, p.dump())
        assert t["host"].tolist() == m.hostbuf
        assert t["materialised"].tolist() == [bool(w) for w in m.written]
        assert t["dirty"].tolist() == m.dirty
        assert t["protected"].tolist() == [bool(m.written[c]) and m.is_protected(c) for c in range(m.nc)]
        assert p.head_chunk == m.head
        sp = p.slot_positions()
        assert np.array_equal(sp, m.slot_positions(p.pool_tokens))
        s = p.stats
        want = m.stats()
        want["resident_bytes"] = self.pool_bytes
        assert s == want, {k: (s[k], want.get(k)) for k in s if s[k] != want.get(k)}
        sc = p.scores()
        if m.has_scores:
            assert sc is not None and sc.tolist() == [float(np.float32(x)) for x in m.score]
        else:
            assert sc is None
        # written positions: a prefix [0, extent)
        assert sum(len(w) for w in m.written) == self.extent
        # slot_of agrees with the slot map
        held = np.flatnonzero(sp >= 0)
        for slot in held[:: max(1, len(held) // 16)]:
            assert p.slot_of(int(sp[slot])) == slot
        # byte stamps survive paging
        if len(held):
            pos = sp[held]
            for il, (k, v) in enumerate(self.rows):
                assert np.array_equal(k[held], stamp(pos, self.ver[pos], il, 0, k.shape[1])), f"K layer {il}"
                assert np.array_equal(v[held], stamp(pos, self.ver[pos], il, 1, v.shape[1])), f"V layer {il}"


PagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestPagerModel = PagerMachine.TestCase


def test_model_predicts_victims_exactly():
    """Sanity check of the model itself on a hand-worked case (pool 8 blocks)."""
    p = kvflash.Pager(pool_tokens=512, max_ctx=MAX_CTX)
    m = Model(p.n_blocks, p.n_chunks, 1, 4, p.chunk_bytes)
    for c in range(8):
        assert p.alloc_span(c * C, C).tolist() == m.alloc_span(c * C, C)
    s = np.zeros(N_CHUNKS, np.float32)
    s[1], s[2] = 2.0, 1.0
    p.set_scores(s)
    m.set_scores(s)
    assert m.pick_victim(8, 8, 8) == 3  # lowest score 0, LRU among 3 (and others)
    p.alloc_span(8 * C, C)
    m.alloc_span(8 * C, C)
    assert p.chunk_table()["block"].tolist() == m.block
    assert m.block[3] < 0
