"""Session snapshots (issue 17): a session saved with the context above the pool, loaded in a
new process, continues with exactly the uninterrupted run's tokens; a truncated, corrupted or
mismatched file is refused with a clear ValueError and leaves the session as it was; a failed
write leaves nothing half-written at the destination."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

core = pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tinygguf import write_tiny_model  # noqa: E402

MAX_CTX, POOL, PROMPT = 2048, 512, 1200   # the prompt is above the pool: chunks live on the host
TAGS = ("HEAD", "PAGR", "POOL", "HOST", "RING", "QCAP", "SUMM", "TOKS", "LOGT", "SAMP", "APPS", "RECR")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("snapshot")
    gem = d / "gemma3.gguf"
    write_tiny_model(gem, "gemma3", n_layer=6, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, seed=5,
                     gemma_sliding_window=96)
    # weight_scale 2: a random llama whose next tokens depend on its context (at 1 it repeats one token,
    # whatever the cache holds)
    llama = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, weight_type="f32", weight_scale=2.0)
    write_tiny_model(d / "small.gguf", "llama", seed=3, **llama)
    write_tiny_model(d / "other.gguf", "llama", seed=4, **llama)
    return {"llama": str(d / "small.gguf"), "other": str(d / "other.gguf"), "gemma3": str(gem)}


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


def _session(path, **kw):
    import kvflash
    kw = dict(dict(max_ctx=MAX_CTX, kvflash=POOL, policy="lru", threads=1, verbose=False), **kw)
    return kvflash.Session(path, **kw)


def _gen(s, n, **sampling):
    n0 = len(s.tokens)
    for _ in s.generate(max_tokens=n, ignore_eos=True, **sampling):
        pass
    assert len(s.tokens) == n0 + n
    return s.tokens[n0:]


def _in_child(code: str) -> dict:
    """Run code in a fresh interpreter (nothing of this process's state can reach it); it prints one JSON line."""
    prelude = f"import sys, json; sys.path.insert(0, {HERE!r})\n"
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sections(data: bytes) -> dict:
    """tag -> (offset of the payload, length), walking the file as the format says."""
    assert data[:8] == b"KVFLSNAP"
    version, n = struct.unpack_from("<II", data, 8)
    at, out = 16, {}
    for _ in range(n):
        tag, crc, length = data[at:at + 4].decode(), *struct.unpack_from("<IQ", data, at + 4)
        assert zlib.crc32(data[at + 16:at + 16 + length]) == crc   # the checksum is zlib's crc32
        out[tag] = (at + 16, length)
        at += 16 + length
    assert at == len(data) and tuple(out) == TAGS
    return out


# ---------------------------------------------------------------- round trips

CASES = {
    "lru-greedy": (dict(policy="lru"), {}),
    "qk-greedy": (dict(policy="qk", tau=8), {}),
    "qk-bound-greedy": (dict(policy="qk-bound", tau=8), {}),
    "lru-sampled": (dict(policy="lru", seed=11), dict(temperature=0.9, top_k=40, top_p=0.95)),
    "qk-sampled": (dict(policy="qk", tau=8, seed=5), dict(temperature=0.8, min_p=0.02)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_restart_round_trip_continues_with_the_uninterrupted_tokens(models, tmp_path, case):
    kw, sampling = CASES[case]
    model = models["llama"]
    prompt = _ids(PROMPT, 1)
    # The uninterrupted run: prompt, 16 tokens, then the 64 the restarted run must reproduce.
    a = _session(model, **kw)
    a.prefill(prompt)
    _gen(a, 16, **sampling)
    want = _gen(a, 64, **sampling)
    want_logits = a.logits()

    b = _session(model, **kw)
    b.prefill(prompt)
    _gen(b, 16, **sampling)
    st = b.pager.stats
    assert st["host_chunks"] > 0 and st["page_outs"] > 0, st   # eviction is in play
    path = tmp_path / "s.kvsnap"
    b.save(path)
    got = _in_child(f"""
        import kvflash
        s = kvflash.Session.load({str(path)!r}, {model!r}, threads=1)
        s.pager.check_invariants()
        n0, rescores = s.n_past, s.stats["rescores"]
        for _ in s.generate(max_tokens=64, ignore_eos=True, **{sampling!r}):
            pass
        s.pager.check_invariants()
        print(json.dumps({{"n0": n0, "tokens": s.tokens[n0:], "host": s.pager.stats["host_chunks"],
                          "rescored": s.stats["rescores"] - rescores, "logits": s.logits().tobytes().hex()}}))
    """)
    assert got["n0"] == PROMPT + 16
    assert got["host"] > 0
    if kw["policy"] != "lru":
        assert got["rescored"] > 0   # the policy ran on the restored state
    assert got["tokens"] == want
    # and the logits after them, bit for bit (a tiny random model's greedy tokens can survive a
    # wrong cache; its logits cannot)
    assert bytes.fromhex(got["logits"]) == want_logits.tobytes()


def test_loaded_state_is_the_saved_state(models, tmp_path):
    import kvflash
    s = _session(models["llama"], policy="qk", tau=8)
    s.prefill(_ids(PROMPT, 2))
    _gen(s, 20)
    path = tmp_path / "s.kvsnap"
    s.save(path)
    t = kvflash.Session.load(path, models["llama"], threads=1)
    t.pager.check_invariants()
    assert t.tokens == s.tokens and t.n_past == s.n_past
    assert np.array_equal(t.logits(), s.logits())
    a, b = s.pager.chunk_table(), t.pager.chunk_table()
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    for k in ("page_outs", "page_ins", "clean_skips", "resident_chunks", "host_chunks", "free_blocks"):
        assert s.pager.stats[k] == t.pager.stats[k], k
    # The pool's rows of every resident chunk, bit for bit.
    blocks = a["block"][a["block"] >= 0]
    C = s.chunk_tokens
    for layer in range(s.pager.n_layers):
        for rows in ("k_rows", "v_rows"):
            x, y = getattr(s.pager, rows)(layer), getattr(t.pager, rows)(layer)
            for blk in blocks:
                assert np.array_equal(x[blk * C:(blk + 1) * C], y[blk * C:(blk + 1) * C]), (layer, rows, blk)
    assert t.policy.name == "qk" and t.tau == 8 and t.runtime.pool_tokens == s.runtime.pool_tokens


def test_gemma3_sliding_window_ring_round_trip(models, tmp_path):
    model = models["gemma3"]
    prompt = _ids(PROMPT, 4)
    a = _session(model)
    a.prefill(prompt)
    want = _gen(a, 64)
    want_logits = a.logits()
    b = _session(model)
    assert b.runtime.swa_bytes > 0   # the ring exists
    b.prefill(prompt)
    assert b.pager.stats["host_chunks"] > 0
    path = tmp_path / "g.kvsnap"
    b.save(path)
    got = _in_child(f"""
        import kvflash
        s = kvflash.Session.load({str(path)!r}, {model!r}, threads=1)
        s.pager.check_invariants()
        n0 = s.n_past
        for _ in s.generate(max_tokens=64, ignore_eos=True):
            pass
        print(json.dumps({{"tokens": s.tokens[n0:], "logits": s.logits().tobytes().hex()}}))
    """)
    assert got["tokens"] == want
    assert bytes.fromhex(got["logits"]) == want_logits.tobytes()


def test_restore_into_a_used_session_replaces_its_context(models, tmp_path):
    model = models["llama"]
    a = _session(model)
    a.prefill(_ids(PROMPT, 6))
    path = tmp_path / "s.kvsnap"
    a.save(path)
    want = _gen(a, 32)
    want_logits = a.logits()
    t = _session(model)
    t.prefill(_ids(1500, 7))     # a longer, different context with more host chunks
    _gen(t, 5)
    t.restore(path)
    t.pager.check_invariants()
    assert t.n_past == PROMPT
    assert _gen(t, 32) == want
    assert np.array_equal(t.logits(), want_logits)


# ---------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """A snapshot file and the session state it was taken from."""
    d = tmp_path_factory.mktemp("saved")
    s = _session(models["llama"])
    s.prefill(_ids(PROMPT, 8))
    path = d / "s.kvsnap"
    s.save(path)
    return {"path": path, "data": path.read_bytes(), "tokens": s.tokens}


class _Target:
    """A session with a context of its own, and what it must still be after a refused restore."""

    def __init__(self, model, **kw):
        self.kw = kw
        self.s = _session(model, **kw)
        self.s.prefill(_ids(700, 9))
        self.tokens, self.logits = self.s.tokens, self.s.logits()
        self.table = self.s.pager.chunk_table()
        self.model = model

    def unchanged(self):
        s = self.s
        s.pager.check_invariants()
        assert s.tokens == self.tokens and s.n_past == len(self.tokens)
        assert np.array_equal(s.logits(), self.logits)
        table = s.pager.chunk_table()
        for k in table:
            assert np.array_equal(table[k], self.table[k]), k

    def still_works(self):
        # It continues as an identical session that never saw a bad file does.
        twin = _session(self.model, **self.kw)
        twin.prefill(_ids(700, 9))
        assert _gen(self.s, 16) == _gen(twin, 16)


def _refused(target, path, match):
    with pytest.raises(ValueError, match=match) as e:
        target.s.restore(path)
    assert isinstance(e.value, core.SnapshotError) or "custom policy" in str(e.value)
    target.unchanged()


def test_truncated_files_are_refused(models, saved, tmp_path):
    data = saved["data"]
    sec = _sections(data)
    target = _Target(models["llama"])
    cuts = [0, 5, 12, 16, 30, sec["HEAD"][0] + 10, sec["PAGR"][0] + 100, sec["POOL"][0] + sec["POOL"][1] // 2,
            sec["HOST"][0] + 7, len(data) - 1]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.kvsnap"
        p.write_bytes(data[:cut])
        _refused(target, p, "truncated|not a kvflash snapshot")
    target.still_works()


def test_a_flipped_byte_in_any_section_is_refused(models, saved, tmp_path):
    data = saved["data"]
    target = _Target(models["llama"])
    for tag, (at, n) in _sections(data).items():
        assert n > 0, tag
        bad = bytearray(data)
        bad[at + n // 2] ^= 0x40
        p = tmp_path / f"flip-{tag}.kvsnap"
        p.write_bytes(bytes(bad))
        _refused(target, p, f"checksum of section {tag} does not match")
    target.still_works()


def test_a_consistent_checksum_over_a_broken_chunk_table_is_refused(models, saved, tmp_path):
    # A crafted file: the chunk table says chunk 3 lives in block 9999, and its checksum is redone.
    data = bytearray(saved["data"])
    at, n = _sections(bytes(data))["PAGR"]
    head = 4 + 4 + 4 + 8 + 8 + 1 + 6 * 8      # n_chunks, n_blocks, words, head, tick, has_scores, counters
    block_of = at + head + 8                   # past the array's u64 length
    struct.pack_into("<i", data, block_of + 3 * 4, 9999)
    struct.pack_into("<I", data, at - 12, zlib.crc32(bytes(data[at:at + n])))
    p = tmp_path / "crafted.kvsnap"
    p.write_bytes(bytes(data))
    target = _Target(models["llama"])
    _refused(target, p, "section PAGR is malformed: chunk 3 and its block disagree")
    target.still_works()


def test_future_version_and_foreign_files_are_refused(models, saved, tmp_path):
    target = _Target(models["llama"])
    data = bytearray(saved["data"])
    struct.pack_into("<I", data, 8, core.SNAPSHOT_VERSION + 1)
    p = tmp_path / "future.kvsnap"
    p.write_bytes(bytes(data))
    _refused(target, p, f"format version {core.SNAPSHOT_VERSION + 1}; this kvflash reads versions 2 to "
                        f"{core.SNAPSHOT_VERSION}")
    struct.pack_into("<I", data, 8, 1)   # version 1: another fingerprint, refused
    p.write_bytes(bytes(data))
    _refused(target, p, "format version 1; this kvflash reads versions 2 to")
    data = bytearray(saved["data"])
    struct.pack_into("<I", data, 8, 2)   # version 2 has eleven sections
    p.write_bytes(bytes(data))
    _refused(target, p, "has 12 sections; format version 2 has 11")
    p = tmp_path / "gguf.kvsnap"
    p.write_bytes(open(models["llama"], "rb").read())
    _refused(target, p, "not a kvflash snapshot")
    data = bytearray(saved["data"])
    data += b"\0" * 3
    p = tmp_path / "tail.kvsnap"
    p.write_bytes(bytes(data))
    _refused(target, p, "3 bytes after its last section")
    with pytest.raises(FileNotFoundError):
        target.s.restore(tmp_path / "missing.kvsnap")
    target.unchanged()
    target.still_works()


@pytest.mark.parametrize("what, model, kw, match", [
    ("model", "other", {}, "another model file"),
    ("kv_type", "llama", dict(kv_type="f16"), r"kv_type differs \(the file has q8_0, this session f16\)"),
    ("pool", "llama", dict(kvflash=1024), r"pool size \(pool_tokens\) differs \(the file has 512, this session 1024\)"),
    ("full cache", "llama", dict(kvflash=None), "pool size"),
    ("max_ctx", "llama", dict(max_ctx=4096), r"max_ctx differs \(the file has 2048, this session 4096\)"),
    ("policy", "llama", dict(policy="qk"), r"policy differs \(the file has 'lru', this session 'qk'\)"),
    ("chunks", "llama", dict(tail_window_chunks=2), "tail_window_chunks differs"),
    ("arch", "gemma3", {}, r"architecture differs \(the file has llama, this session gemma3\)"),
])
def test_a_snapshot_of_another_geometry_is_refused(models, saved, what, model, kw, match):
    target = _Target(models[model], **kw)
    _refused(target, saved["path"], match)
    target.still_works()


def test_a_host_store_too_small_for_the_snapshot_is_refused_before_anything_changes(models, saved):
    # The snapshot needs more host buffers than this session's max_host_bytes allows: the
    # reservation fails before the first byte is replaced.
    target = _Target(models["llama"], max_host_bytes=6 * 17408)
    assert 0 < target.s.pager.stats["host_chunks"] < 6
    with pytest.raises(RuntimeError, match="host store full"):
        target.s.restore(saved["path"])
    target.unchanged()
    target.still_works()


def test_load_refuses_another_model_and_a_custom_policy_without_one(models, saved, tmp_path):
    import kvflash
    with pytest.raises(kvflash.SnapshotError, match="another model file"):
        kvflash.Session.load(saved["path"], models["other"], threads=1)

    class KeepEarly:
        name = "keep-early"

        def score(self, view):
            return -np.arange(view.n_chunks, dtype=np.float32)

    s = _session(models["llama"], policy=KeepEarly())
    s.prefill(_ids(PROMPT, 10))
    path = tmp_path / "custom.kvsnap"
    s.save(path)
    with pytest.raises(ValueError, match="custom policy 'keep-early': pass policy="):
        kvflash.Session.load(path, models["llama"], threads=1)
    t = kvflash.Session.load(path, models["llama"], threads=1, policy=KeepEarly())
    assert t.tokens == s.tokens
    assert _gen(t, 16) == _gen(s, 16)


def test_save_is_refused_while_generate_is_open(models, tmp_path):
    s = _session(models["llama"])
    s.prefill(_ids(100))
    g = s.generate(max_tokens=4)
    next(g)
    with pytest.raises(RuntimeError, match="in use"):
        s.save(tmp_path / "s.kvsnap")
    g.close()
    assert not (tmp_path / "s.kvsnap").exists()


# ---------------------------------------------------------------- atomic writes

def test_a_write_that_fails_midway_leaves_the_old_file(models, tmp_path):
    # The file-size limit makes write() fail with EFBIG part way through the pool's rows.
    dest = tmp_path / "snaps" / "s.kvsnap"
    dest.parent.mkdir()
    got = _in_child(f"""
        import os, resource, signal
        import numpy as np
        from test_snapshot import _session, _ids
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        s = _session({models["llama"]!r})
        s.prefill(_ids({PROMPT}, 12))
        s.save({str(dest)!r})
        old = open({str(dest)!r}, "rb").read()
        s.prefill(_ids(300, 13))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
        try:
            s.save({str(dest)!r})
            err = None
        except RuntimeError as e:
            err = str(e)
        print(json.dumps({{"err": err, "same": open({str(dest)!r}, "rb").read() == old, "old": len(old),
                          "files": sorted(os.listdir({str(dest.parent)!r}))}}))
    """)
    assert got["old"] > 64 << 10   # the failing write needed more than the limit
    assert got["err"] and "cannot write" in got["err"] and "File too large" in got["err"], got
    assert got["same"], "the destination changed"
    assert got["files"] == ["s.kvsnap"], got["files"]   # no temporary file left behind


def test_saving_where_it_cannot_leaves_nothing(models, tmp_path):
    s = _session(models["llama"])
    s.prefill(_ids(200))
    with pytest.raises(RuntimeError, match="cannot create a temporary file"):
        s.save(tmp_path / "no-such-dir" / "s.kvsnap")
    assert not (tmp_path / "no-such-dir").exists()
    d = tmp_path / "a-dir"
    d.mkdir()
    (d / "keep").write_text("x")
    with pytest.raises(RuntimeError, match="cannot rename"):
        s.save(d)
    assert sorted(os.listdir(d)) == ["keep"] and sorted(os.listdir(tmp_path)) == ["a-dir"]
    s.pager.check_invariants()


def test_drafter_cache_is_rebuilt_from_the_history_after_a_load(models, tmp_path):
    # The drafter's own cache is not in the snapshot: after a load it is fed the whole history
    # at its first rescore (then only what is new, as before).
    import kvflash
    model = models["llama"]
    s = _session(model, policy="drafter", drafter=model, tau=8)
    s.prefill(_ids(PROMPT, 14))
    _gen(s, 8)
    path = tmp_path / "d.kvsnap"
    s.save(path)
    t = kvflash.Session.load(path, model, threads=1, drafter=model)   # the drafter is the loader's to give
    assert t.policy.name == "drafter" and t.policy.fed_tokens_total == 0
    n0 = t.n_past
    _gen(t, 40)
    assert t.stats["rescores"] > s.stats["rescores"]
    assert t.policy.fed_tokens_total >= n0   # the history, fed once
    t.pager.check_invariants()
