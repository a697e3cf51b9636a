"""kvflash.Pager through the Python API: bit-exact paging, clean-page skips,
protection, reselect/reset, truncate (masks: test_pager_masks.py; argument
checking: test_pager_input.py).

Semantics under test are those documented in csrc/kvflash/pager.h.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import kvflash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pagerutil import C, NEG, make, on_host, resident  # noqa: E402


class Stamps:
    """Random bytes per written position, per layer, K and V; verified by slot."""

    def __init__(self, p, seed=0):
        self.p = p
        self.rng = np.random.default_rng(seed)
        self.k = {}  # (layer) -> {pos: bytes row}
        self.v = {}
        self.nl = p.n_layers

    def write(self, pos0, slots):
        slots = np.asarray(slots)
        pos = np.arange(pos0, pos0 + len(slots))
        for il in range(self.nl):
            for rows_fn, store in ((self.p.k_rows, self.k), (self.p.v_rows, self.v)):
                rows = rows_fn(il)
                data = self.rng.integers(0, 256, size=(len(slots), rows.shape[1]), dtype=np.uint8)
                rows[slots] = data
                d = store.setdefault(il, {})
                for j, q in enumerate(pos):
                    d[int(q)] = data[j]

    def alloc(self, pos0, n):
        slots = self.p.alloc_span(pos0, n)
        assert slots is not None, f"NO_ROOM for [{pos0}, {pos0 + n})"
        self.write(pos0, slots)
        return slots

    def check_resident(self):
        """Every written, resident position's rows carry exactly the bytes last written."""
        n = 0
        for q in self.k.get(0, {}):
            s = self.p.slot_of(q)
            if s < 0:
                continue
            for il in range(self.nl):
                assert bytes(self.p.k_rows(il)[s]) == bytes(self.k[il][q]), f"K layer {il} pos {q} slot {s}"
                assert bytes(self.p.v_rows(il)[s]) == bytes(self.v[il][q]), f"V layer {il} pos {q} slot {s}"
            n += 1
        return n

    def check_all(self):
        """Bring every materialised chunk in (one at a time) and compare all its positions."""
        t = self.p.chunk_table()
        for c in np.flatnonzero(t["materialised"]):
            c = int(c)
            if self.p.chunk_table()["block"][c] < 0:
                assert self.p.recall(c)
            for q in range(c * C, (c + 1) * C):
                if q not in self.k.get(0, {}):
                    continue
                s = self.p.slot_of(q)
                assert s >= 0 and s // C == self.p.chunk_table()["block"][c]
                for il in range(self.nl):
                    assert bytes(self.p.k_rows(il)[s]) == bytes(self.k[il][q]), f"K layer {il} pos {q}"
                    assert bytes(self.p.v_rows(il)[s]) == bytes(self.v[il][q]), f"V layer {il} pos {q}"
        self.p.check_invariants()


# --------------------------------------------------------------------------- roundtrip

GEOMS = [
    pytest.param(dict(kv_type="f16"), id="f16"),
    pytest.param(dict(kv_type="q8_0"), id="q8_0"),
    pytest.param(dict(kv_type="q4_0"), id="q4_0"),
    pytest.param(dict(kv_type="q8_0", n_layers=3, n_embd_k=128, n_embd_v=64), id="q8_0-3layers-k128-v64"),
    pytest.param(dict(kv_type="q4_0", n_layers=3, n_embd_k=128, n_embd_v=64, layer_ids=[3, 7, 11]),
                 id="q4_0-3layers-ids"),
]


def _roundtrip(p, seed):
    st = Stamps(p, seed)
    n_chunks_written = 20
    total = n_chunks_written * C
    # Append in odd-sized pieces so pieces straddle chunk boundaries; the pool holds 8 chunks,
    # so this evicts through alloc_span.
    pos = 0
    sizes = np.random.default_rng(seed).integers(1, 90, size=1000)
    for sz in sizes:
        if pos >= total:
            break
        n = int(min(sz, total - pos))
        st.alloc(pos, n)
        pos += n
        assert st.check_resident() > 0
    s = p.stats
    assert s["page_outs"] >= n_chunks_written - p.n_blocks
    assert s["bytes_out"] == s["page_outs"] * p.chunk_bytes
    p.check_invariants()

    # Shuffle blocks: evict two resident chunks (recording where they were) and recall them
    # in the same order, so the LIFO free list hands each a different block.
    cands = sorted(c for c in resident(p) if not p.chunk_table()["protected"][c])
    assert len(cands) >= 2, p.dump()
    moved = cands[:2]
    left_from = {c: int(p.chunk_table()["block"][c]) for c in moved}
    for c in moved:
        p.evict(c)
    assert on_host(p) >= set(moved)
    st.check_resident()
    for c in moved:
        assert p.recall(c)
    back_in = {c: int(p.chunk_table()["block"][c]) for c in moved}
    assert any(back_in[c] != left_from[c] for c in moved), (left_from, back_in)
    st.check_resident()

    # Recall host chunks in a shuffled order (each recall evicts an LRU victim), then
    # verify every written position, chunk by chunk.
    host = sorted(on_host(p))
    np.random.default_rng(seed + 1).shuffle(host)
    for c in host[:6]:
        if p.chunk_table()["block"][c] < 0:
            assert p.recall(c)
        st.check_resident()
    st.check_all()
    s = p.stats
    assert s["page_ins"] > 0 and s["bytes_in"] == s["page_ins"] * p.chunk_bytes


@pytest.mark.parametrize("geom", GEOMS)
def test_roundtrip_bit_exact(geom):
    p = make(pool=512, max_ctx=64 * 24, **geom)
    assert p.n_layers == geom.get("n_layers", 1)
    _roundtrip(p, seed=len(str(geom)))


def test_roundtrip_file_backing(tmp_path):
    path = tmp_path / "store.bin"
    p = make(pool=512, max_ctx=64 * 24, kv_type="q8_0", n_layers=2, n_embd_k=128, n_embd_v=64,
             host="file", host_path=str(path))
    _roundtrip(p, seed=7)
    assert p.stats["host_reserved_bytes"] >= p.stats["host_bytes"] > 0
    # The file is unlinked as soon as it is created: nothing of it is visible, or left behind.
    assert not path.exists()
    del p
    import gc
    gc.collect()
    assert not path.exists()


def test_file_backing_accepts_pathlike(tmp_path):
    p = make(host="file", host_path=tmp_path / "s.bin")  # os.PathLike, not str
    st = Stamps(p)
    for c in range(12):
        st.alloc(c * C, C)
    st.check_all()


def test_chunk_bytes_geometry():
    # q8_0: 34 bytes per 32 values; f16: 2 bytes per value; q4_0: 18 bytes per 32 values.
    for kv, per in (("f16", lambda n: 2 * n), ("q8_0", lambda n: n // 32 * 34), ("q4_0", lambda n: n // 32 * 18)):
        p = make(kv_type=kv, n_layers=3, n_embd_k=128, n_embd_v=64)
        assert p.k_rows(2).shape == (512, per(128))
        assert p.v_rows(2).shape == (512, per(64))
        assert p.chunk_bytes == 3 * C * (per(128) + per(64))


def test_view_keeps_pager_alive():
    p = make()
    rows = p.k_rows(0)
    slots = p.alloc_span(0, 10)
    rows[slots] = 7
    del p
    import gc
    gc.collect()
    assert rows[:10].min() == 7  # still a valid buffer


# --------------------------------------------------------------------------- clean skips

def test_clean_chunks_are_not_copied_again():
    p = make()
    st = Stamps(p)
    for c in range(12):
        st.alloc(c * C, C)
    victim = 3
    assert p.chunk_table()["block"][victim] < 0  # paged out by LRU
    assert p.chunk_table()["host"][victim] >= 0
    s0 = p.stats
    assert p.recall(victim)
    t = p.chunk_table()
    assert not t["dirty"][victim] and t["host"][victim] >= 0
    s1 = p.stats
    assert s1["page_ins"] == s0["page_ins"] + 1
    p.evict(victim)
    s2 = p.stats
    assert s2["page_outs"] == s1["page_outs"] and s2["bytes_out"] == s1["bytes_out"]
    assert s2["clean_skips"] == s1["clean_skips"] + 1
    assert p.chunk_table()["host"][victim] >= 0
    st.check_all()

    # Writing into it again (alloc_span recalls it) makes it dirty: the next eviction copies.
    if p.chunk_table()["block"][victim] < 0:
        assert p.recall(victim)
    st.alloc(victim * C + 5, 3)  # overwrite 3 positions with new bytes
    assert p.chunk_table()["dirty"][victim]
    s3 = p.stats
    p.evict(victim)
    s4 = p.stats
    assert s4["page_outs"] == s3["page_outs"] + 1
    assert s4["bytes_out"] == s3["bytes_out"] + p.chunk_bytes
    assert s4["clean_skips"] == s3["clean_skips"]
    st.check_all()  # the new bytes came back, not the stale host copy


def test_rewrite_of_paged_out_chunk_recalls_it():
    p = make()
    st = Stamps(p)
    for c in range(12):
        st.alloc(c * C, C)
    assert p.chunk_table()["block"][2] < 0
    ins = p.stats["page_ins"]
    st.alloc(2 * C + 10, 1)
    assert p.stats["page_ins"] == ins + 1
    assert p.chunk_table()["dirty"][2]
    st.check_all()


def test_head_chunk_dirty_after_append():
    p = make()
    st = Stamps(p)
    for c in range(12):
        st.alloc(c * C, C)
    # Make chunk 6 clean (evict+recall), then check it only goes dirty on a write.
    p.evict(6)
    assert p.recall(6)
    assert not p.chunk_table()["dirty"][6]
    st.alloc(12 * C, 1)  # append into a new head: chunk 6 untouched, stays clean
    assert not p.chunk_table()["dirty"][6]
    assert p.chunk_table()["dirty"][12]


# --------------------------------------------------------------------------- protection

@pytest.mark.parametrize("sinks,tail", [(1, 4), (2, 1), (0, 0), (3, 2)])
def test_protection_during_decode(sinks, tail):
    pool = kvflash.min_pool_tokens(64, sinks, tail)
    p = make(pool=pool, max_ctx=64 * 40, sink_chunks=sinks, tail_window_chunks=tail)
    st = Stamps(p)
    for pos in range(64 * 30):
        st.alloc(pos, 1)
        head = pos // C
        blk = p.chunk_table()["block"]
        for c in range(min(sinks, head + 1)):
            assert blk[c] >= 0, f"sink {c} evicted at pos {pos}"
        for c in range(max(0, head - tail), head + 1):
            assert blk[c] >= 0, f"tail chunk {c} evicted at pos {pos}"
        if pos % 97 == 0:
            p.check_invariants()
    assert p.head_chunk == 29
    prot = p.chunk_table()["protected"]
    want = set(range(sinks)) | set(range(29 - tail, 30))
    assert set(np.flatnonzero(prot).tolist()) == want
    for c in sorted(want):
        with pytest.raises(ValueError, match="protected"):
            p.evict(c)
    p.check_invariants()
    st.check_resident()
    # first unprotected resident chunk is evictable
    free = sorted(resident(p) - want)
    assert free
    p.evict(free[0])
    p.check_invariants()


def test_protected_chunks_survive_reselect_with_low_scores():
    p = make(pool=512, max_ctx=64 * 30)
    for c in range(25):
        p.alloc_span(c * C, C)
    scores = np.full(p.n_chunks, 100.0, dtype=np.float32)
    prot = {0, 20, 21, 22, 23, 24}
    for c in prot:
        scores[c] = -1e30
    p.reselect(scores)
    assert prot <= resident(p)
    p.check_invariants()


def test_no_room_when_everything_protected_or_in_span():
    p = make()  # 8 blocks, sinks 1 + tail 4
    for c in range(8):
        p.alloc_span(c * C, C)
    before = (p.stats, p.chunk_table()["block"].copy(), p.slot_positions().copy())
    # a span over 8 chunks cannot fit alongside the sink
    assert p.alloc_span(9 * C, 8 * C) is None
    s, blk, sp = before
    assert p.stats == s
    assert np.array_equal(p.chunk_table()["block"], blk) and np.array_equal(p.slot_positions(), sp)
    p.check_invariants()
    # a span over 7 chunks fits (sink + 7); everything else is paged out
    assert p.alloc_span(9 * C, 7 * C) is not None
    assert resident(p) == {0} | set(range(9, 16))
    p.check_invariants()


def test_recall_evicts_lru_unprotected_victim():
    # 4 blocks (min pool for sinks 0, tail 0 is 2 chunks -> 256 tokens -> 4 blocks).
    p = make(pool=256, max_ctx=64 * 10, sink_chunks=0, tail_window_chunks=0)
    assert p.n_blocks == 4
    for c in range(6):
        p.alloc_span(c * C, C)
    # resident 2..5; chunk 0 and 1 on host. Write one more span covering 3 chunks
    # (5 is head and protected, the span's chunks can't be victims).
    assert on_host(p) == {0, 1}
    s0 = p.stats
    # A span of 4 chunks: needs 4 blocks, but head 5 stays... new head is 9: fits exactly.
    assert p.alloc_span(6 * C, 4 * C) is not None
    assert resident(p) == {6, 7, 8, 9}
    # Now only chunk 9 (head) is protected; recall works by evicting LRU 6.
    assert p.recall(0)
    assert 6 not in resident(p)
    assert p.stats["page_ins"] == s0["page_ins"] + 1
    p.check_invariants()


# --------------------------------------------------------------------------- reselect / scores / reset

def test_reselect_planted_scores():
    p = make(pool=1024, max_ctx=64 * 40)  # 16 blocks
    st = Stamps(p, seed=3)
    for c in range(36):
        st.alloc(c * C, C)
    prot = {0, 31, 32, 33, 34, 35}
    assert set(np.flatnonzero(p.chunk_table()["protected"]).tolist()) == prot
    rng = np.random.default_rng(0)
    scores = rng.uniform(0, 1, size=p.n_chunks).astype(np.float32)
    planted = [2, 5, 7, 11, 13, 17, 19, 23, 27, 29]  # 16 blocks - 6 protected = 10 kept
    scores[planted] = rng.uniform(5, 6, size=len(planted)).astype(np.float32)
    before = resident(p)
    moved = p.reselect(scores)
    after = resident(p)
    assert after == prot | set(planted)
    assert moved == len(before - after) + len(after - before)
    assert np.array_equal(p.scores(), scores)
    p.check_invariants()
    st.check_resident()
    assert p.reselect(scores) == 0  # already selected
    st.check_all()


def test_reselect_scores_shorter_than_chunks_and_unscored_rank_first():
    p = make(pool=512, max_ctx=64 * 30)
    for c in range(12):
        p.alloc_span(c * C, C)
    s = np.arange(12, dtype=np.float32)
    p.set_scores(s)
    got = p.scores()
    assert got.shape == (p.n_chunks,)
    assert np.array_equal(got[:12], s) and np.all(np.isinf(got[12:]) & (got[12:] > 0))
    # chunk 12 written after scores: unscored, ranks above every scored chunk
    p.alloc_span(12 * C, C)
    p.alloc_span(13 * C, C)  # evicts the lowest-score resident unprotected chunk
    p.alloc_span(14 * C, C)
    # protected now: 0 and 10..14; chunk 12,13 unscored; lowest-scored resident unprotected go first
    res = resident(p)
    assert {0, 10, 11, 12, 13, 14} <= res
    p.check_invariants()
    # scores-driven eviction: with everything scored, victim is the lowest score, not LRU
    p2 = make(pool=512, max_ctx=64 * 30)
    for c in range(8):
        p2.alloc_span(c * C, C)
    sc = np.zeros(p2.n_chunks, dtype=np.float32)
    sc[1] = 5.0  # LRU chunk is 1, but it scores highest
    sc[2] = 1.0
    p2.set_scores(sc)
    p2.alloc_span(8 * C, C)
    assert p2.chunk_table()["block"][3] < 0  # lowest score 0, ties -> LRU: 3
    assert p2.chunk_table()["block"][1] >= 0 and p2.chunk_table()["block"][2] >= 0


def test_reselect_ties_prefer_resident_then_recent():
    p = make()  # 8 blocks: sink 0 + tail 7..11 protected, 2 blocks chosen by score
    for c in range(12):
        p.alloc_span(c * C, C)
    assert resident(p) == {0, 5, 6, 7, 8, 9, 10, 11}
    p.evict(6)            # the most recently used unprotected chunk leaves...
    assert p.recall(2)    # ...and an older one takes its block (no free block left)
    assert resident(p) == {0, 2, 5, 7, 8, 9, 10, 11}
    epoch = p.epoch
    # all scores equal: residents win the tie, nothing moves (6 is more recent than 5)
    assert p.reselect(np.zeros(0, np.float32)) == 0
    assert p.reselect(np.zeros(p.n_chunks, np.float32)) == 0
    assert p.epoch == epoch and resident(p) == {0, 2, 5, 7, 8, 9, 10, 11}
    # among non-residents of equal score, the most recent wins: 6 over 4, 3, 1
    sc = np.zeros(p.n_chunks, np.float32)
    sc[[1, 3, 4, 6]] = 1.0
    assert p.reselect(sc) == 4
    assert resident(p) == {0, 6, 4, 7, 8, 9, 10, 11}
    p.check_invariants()


def test_clear_scores_returns_to_lru():
    p = make()
    for c in range(8):
        p.alloc_span(c * C, C)
    sc = np.zeros(p.n_chunks, dtype=np.float32)
    sc[1] = 9
    p.set_scores(sc)
    p.clear_scores()
    assert p.scores() is None
    p.alloc_span(8 * C, C)
    assert p.chunk_table()["block"][1] < 0  # LRU victim again


def test_reset_clears_everything():
    p = make()
    st = Stamps(p)
    for c in range(14):
        st.alloc(c * C, C)
    p.reselect(np.linspace(0, 1, p.n_chunks, dtype=np.float32))
    assert p.scores() is not None
    s = p.stats
    assert s["page_outs"] > 0 and s["host_bytes"] > 0
    epoch = p.epoch
    p.reset()
    assert p.scores() is None
    s = p.stats
    for k in ("page_outs", "page_ins", "clean_skips", "bytes_out", "bytes_in", "resident_chunks",
              "host_chunks", "materialised_chunks", "host_bytes"):
        assert s[k] == 0, k
    assert s["free_blocks"] == s["n_blocks"] == p.n_blocks
    assert p.epoch > epoch  # monotonic across sessions
    assert p.head_chunk == -1
    t = p.chunk_table()
    assert np.all(t["block"] == -1) and np.all(t["host"] == -1) and not t["materialised"].any()
    assert not t["dirty"].any() and not t["protected"].any()
    assert np.all(p.slot_positions() == -1)
    assert np.all(p.mask([100]) == NEG)
    p.check_invariants()
    # A new session: LRU order again (no leaked scores), bytes still round-trip.
    st = Stamps(p, seed=9)
    for c in range(9):
        st.alloc(c * C, C)
    assert p.chunk_table()["block"][1] < 0
    st.check_all()


def test_truncate_frees_and_recalls_tail():
    p = make()
    st = Stamps(p)
    for c in range(16):
        st.alloc(c * C, C)
    assert p.chunk_table()["block"][6] < 0
    p.truncate(7 * C + 10)  # head becomes chunk 7: tail window 3..7 must be resident again
    assert p.head_chunk == 7
    assert {0, 3, 4, 5, 6, 7} <= resident(p)
    t = p.chunk_table()
    assert not t["materialised"][8:].any() and np.all(t["host"][8:] == -1)
    assert p.slot_of(7 * C + 9) >= 0 and p.slot_of(7 * C + 10) == -1
    p.check_invariants()
    # forget bytes of truncated positions in the reference
    for d in (st.k, st.v):
        for il in d:
            for q in [q for q in d[il] if q >= 7 * C + 10]:
                del d[il][q]
    st.check_all()
    p.truncate(0)
    assert p.head_chunk == -1 and p.stats["materialised_chunks"] == 0 and p.stats["host_bytes"] == 0
    p.check_invariants()


def test_truncate_beyond_written_extent_is_a_noop():
    p = make()
    p.alloc_span(0, 100)  # chunks 0, 1
    p.truncate(640)       # nothing at or past 640 to forget
    assert p.head_chunk == 1
    p.check_invariants()


def test_truncate_into_gap_sets_head_to_last_written_chunk():
    p = make()
    p.alloc_span(0, 64)
    p.alloc_span(640, 10)  # chunk 10
    p.truncate(400)        # forgets chunk 10; last written chunk is 0
    assert p.head_chunk == 0
    p.check_invariants()
