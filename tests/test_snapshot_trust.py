"""Snapshot files from anywhere (issue 36): the structure and the header are checked before the file's
size is allocated, the file is held to what the session's geometry can need (or to the caller's cap),
every field of the session's JSON is held to its type and range, nothing in a file names a path the
loader opens, the model fingerprint covers the whole GGUF header and tensor table and every tensor's
data, and the file records the kvflash that wrote it.  Every refusal is a kvflash.SnapshotError (a
ValueError) and leaves the session as it was."""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import zlib

import numpy as np
import pytest

core = pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gguf_corpus  # noqa: E402
from test_snapshot import (MAX_CTX, POOL, TAGS, _gen, _ids, _in_child, _refused, _sections,  # noqa: E402,F401
                           _session, _Target, models, saved)


def _rewrite(data: bytes, tag: str, payload: bytes) -> bytes:
    """data with section tag's payload replaced, its length and checksum made to match."""
    at, n = _sections(data)[tag]
    head = data[:at - 16] + tag.encode() + struct.pack("<IQ", zlib.crc32(payload), len(payload))
    return head + payload + data[at + n:]


def _payload(data: bytes, tag: str) -> bytes:
    at, n = _sections(data)[tag]
    return data[at:at + n]


def _app(data: bytes) -> dict:
    return json.loads(_payload(data, "APPS"))


def _with_app(data: bytes, app) -> bytes:
    return _rewrite(data, "APPS", app if isinstance(app, bytes) else json.dumps(app).encode())


def _head_offsets(head: bytes) -> dict:
    """Field -> (offset, struct format) in a format-2 HEAD payload."""
    at, out = 16, {"fingerprint": (0, "<Q"), "model_bytes": (8, "<Q")}
    for name in ("kvflash_version", "arch", "kv_type"):
        (n,) = struct.unpack_from("<I", head, at)
        out[name] = (at, None)
        at += 4 + n
    for name in ("n_layer", "eval_layers", "chunk_tokens", "pool_tokens", "sink_chunks", "tail_window_chunks",
                 "swa_tokens", "n_swa_layers", "capture_queries"):
        out[name] = (at, "<i")
        at += 4
    for name, fmt in (("max_ctx", "<q"), ("n_past", "<q"), ("chunk_bytes", "<Q"), ("full_cache", "<B"),
                      ("summaries", "<B"), ("n_vocab", "<i"), ("query_floats", "<Q"), ("summary_floats", "<Q"),
                      ("n_paged", "<I")):
        out[name] = (at, fmt)
        at += struct.calcsize(fmt)
    out["row_bytes_k0"] = (at + 4, "<Q")
    return out


def _with_head(data: bytes, **fields) -> bytes:
    head = bytearray(_payload(data, "HEAD"))
    offs = _head_offsets(bytes(head))
    for k, v in fields.items():
        at, fmt = offs[k]
        struct.pack_into(fmt, head, at, v)
    return _rewrite(data, "HEAD", bytes(head))


def _write(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


# ---------------------------------------------------------------- what the file records

def test_the_file_records_its_format_and_the_kvflash_that_wrote_it(saved):
    import kvflash
    data = saved["data"]
    assert struct.unpack_from("<I", data, 8)[0] == core.SNAPSHOT_VERSION == 3
    snap = core.Snapshot.read(str(saved["path"]))
    assert snap.header["kvflash_version"] == kvflash.__version__
    head, app = core.Snapshot.peek(str(saved["path"]))
    assert head == snap.header and app == snap.app
    assert head["n_vocab"] > 0 and head["query_floats"] > 0 and head["summary_floats"] > 0
    assert head["version"] == 3 and head["recurrent_layers"] == 0 and head["recurrent_floats"] == 0


def test_an_older_format_version_is_refused_naming_both_versions(models, saved, tmp_path):
    data = bytearray(saved["data"])
    struct.pack_into("<I", data, 8, 1)
    p = _write(tmp_path, "v1.kvsnap", bytes(data))
    target = _Target(models["llama"])
    _refused(target, p, r"format version 1; this kvflash reads versions 2 to 3 \(it is kvflash 0\.1\.0; an older kvflash "
                        r"wrote the file")
    with pytest.raises(core.SnapshotError, match="format version 1; this kvflash reads versions 2 to 3"):
        _load(p, models["llama"])
    target.still_works()


def _load(path, model, **kw):
    import kvflash
    return kvflash.Session.load(path, model, threads=1, **kw)


# ---------------------------------------------------------------- before any large allocation

def _sparse(tmp_path, name, prefix: bytes, size: int):
    p = tmp_path / name
    with open(p, "wb") as f:
        f.write(prefix)
        f.truncate(size)
    return p


def test_the_structure_and_header_are_checked_before_the_file_is_allocated(models, saved, tmp_path):
    # Sparse files of 8 GiB, read in a process whose address space cannot hold one: what reads the whole
    # file before checking it gets MemoryError; these must be refused, by what is wrong with them, first.
    big = 8 << 30
    data = saved["data"]
    at, n = _sections(data)["RECR"]
    # A consistent section table whose last section (RECR) claims 8 GiB more than it held.
    grown = data[:at - 8] + struct.pack("<Q", n + big) + data[at:]
    files = {
        "junk": _sparse(tmp_path, "junk.kvsnap", b"not a snapshot", big),
        "grown": _sparse(tmp_path, "grown.kvsnap", grown, len(data) + big),
        "tail": _sparse(tmp_path, "tail.kvsnap", data, len(data) + big),
        "claims": _sparse(tmp_path, "claims.kvsnap", data[:at - 8] + struct.pack("<Q", 1 << 62) + data[at:], big),
    }
    got = _in_child(f"""
        import resource
        import kvflash
        from test_snapshot import _session, _ids
        s = _session({models["llama"]!r})
        s.prefill(_ids(700, 9))
        n0 = s.n_past
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
        out = {{}}
        for name, path in {dict((k, str(v)) for k, v in files.items())!r}.items():
            for how in ("restore", "read", "load", "peek"):
                try:
                    if how == "restore":
                        s.restore(path)
                    elif how == "read":
                        kvflash._core.Snapshot.read(path)
                    elif how == "peek":
                        kvflash._core.Snapshot.peek(path)
                    else:
                        kvflash.Session.load(path, {models["llama"]!r}, threads=1)
                    out[name + "/" + how] = "accepted"
                except Exception as e:
                    out[name + "/" + how] = type(e).__name__ + ": " + str(e)
        s.pager.check_invariants()
        out["unchanged"] = s.n_past == n0
        print(json.dumps(out))
    """)
    assert got.pop("unchanged")
    for k, v in got.items():
        assert v.startswith("SnapshotError: "), (k, v)
    for how in ("restore", "read", "load", "peek"):
        assert "not a kvflash snapshot" in got["junk/" + how]
        assert f"{big} bytes after its last section" in got["tail/" + how]
        assert "is truncated: section RECR holds 4611686018427387904 bytes" in got["claims/" + how]
    # the grown file: refused by the session's geometry (restore), by what its header allows a section
    assert "bytes: more than the largest snapshot of this session's geometry" in got["grown/restore"]
    for how in ("read", "load", "peek"):
        assert "section RECR holds" in got["grown/" + how] and "allows at most 12" in got["grown/" + how]


def test_a_file_over_the_callers_cap_or_the_geometry_is_refused_naming_the_cap(models, saved, tmp_path):
    import kvflash
    target = _Target(models["llama"])
    size = len(saved["data"])
    with pytest.raises(kvflash.SnapshotError, match=rf"is {size} bytes: more than the cap of 1000 bytes \(max_bytes\)"):
        target.s.restore(saved["path"], max_bytes=1000)
    target.unchanged()
    with pytest.raises(kvflash.SnapshotError, match=r"more than the cap of 1000 bytes \(max_bytes\)"):
        _load(saved["path"], models["llama"], max_bytes=1000)
    # a cap above the file: restored
    cap = core.Snapshot.max_file_bytes(target.s.runtime)
    assert size < cap < size + (18 << 20)    # the geometry's KV and tables, plus 17 MiB for sampler and app
    # an app section grown past what the geometry can need: the geometry's cap, named
    data = _with_app(saved["data"], b" " * (cap - size + 1) + _payload(saved["data"], "APPS"))
    p = _write(tmp_path, "fat.kvsnap", data)
    _refused(target, p, rf"is {len(data)} bytes: more than the largest snapshot of this session's geometry "
                        rf"\({cap} bytes")
    target.s.restore(saved["path"], max_bytes=size)
    assert target.s.tokens == saved["tokens"]


def test_sections_longer_than_the_header_allows_are_refused(models, saved, tmp_path):
    data = saved["data"]
    logits = _payload(data, "LOGT")
    n_vocab = core.Snapshot.read(str(saved["path"])).header["n_vocab"]
    cases = {
        # one float more than the vocabulary
        "logits": (_rewrite(data, "LOGT", struct.pack("<Q", n_vocab + 1) + logits[8:] + b"\0" * 4),
                   rf"section LOGT holds {len(logits) + 4} bytes; its header's geometry allows at most {len(logits)}"),
        # a token history one token longer than n_past
        "tokens": (_rewrite(data, "TOKS", _payload(data, "TOKS") + b"\0" * 4), "section TOKS holds .* exactly"),
        "sampler": (_rewrite(data, "SAMP", struct.pack("<I", 2 << 20) + b"x" * (2 << 20)),
                    "section SAMP holds .* at most"),
    }
    target = _Target(models["llama"])
    for name, (blob, match) in cases.items():
        p = _write(tmp_path, name + ".kvsnap", blob)
        _refused(target, p, match)
        with pytest.raises(core.SnapshotError, match=match):
            core.Snapshot.read(str(p))
    target.still_works()


@pytest.mark.parametrize("fields, match", [
    (dict(n_past=MAX_CTX + 1), f"section HEAD is malformed: n_past {MAX_CTX + 1}"),
    (dict(chunk_tokens=0), "section HEAD is malformed: chunk_tokens 0"),
    (dict(max_ctx=1 << 40), "section HEAD is malformed: max_ctx"),
    (dict(full_cache=7), "a flag that is not 0 or 1"),
    (dict(n_vocab=-1), "n_vocab -1"),
    (dict(row_bytes_k0=1 << 40), "a paged layer's row of"),
    (dict(chunk_bytes=12345), "chunk_bytes disagrees with its row sizes"),
    (dict(query_floats=1 << 40), "a row of over 2"),
])
def test_a_crafted_header_with_its_checksum_redone_is_refused(models, saved, tmp_path, fields, match):
    p = _write(tmp_path, "h.kvsnap", _with_head(saved["data"], **fields))
    with pytest.raises(core.SnapshotError, match=match):
        core.Snapshot.read(str(p))
    with pytest.raises(core.SnapshotError, match=match):
        core.Snapshot.peek(str(p))
    target = _Target(models["llama"])
    _refused(target, p, match)


@pytest.mark.parametrize("at, fmt, value, match", [
    (20, "<Q", 2**64 - 1, "the pager's clock at 18446744073709551615"),
    (29 + 5 * 8, "<q", 2**63 - 1, "a counter at 9223372036854775807"),   # the epoch (the fuzz target's find)
    (29, "<q", -1, "a counter at -1"),                                     # page_outs
])
def test_the_pagers_clock_and_counters_are_held_far_from_overflow(models, saved, tmp_path, at, fmt, value, match):
    pagr = bytearray(_payload(saved["data"], "PAGR"))
    struct.pack_into(fmt, pagr, at, value)
    p = _write(tmp_path, "pagr.kvsnap", _rewrite(saved["data"], "PAGR", bytes(pagr)))
    target = _Target(models["llama"])
    _refused(target, p, "section PAGR is malformed: " + match)


# ---------------------------------------------------------------- the session's JSON

def _cfg(**kw):
    return lambda app: app["config"].update(kw)


APP_CASES = {
    "max_ctx-str": (_cfg(max_ctx="2048"), r"config.max_ctx = '2048' is out of range or of the wrong type"),
    "max_ctx-header": (_cfg(max_ctx=4096), r"config.max_ctx = 4096 but the cache's header has 2048"),
    "max_ctx-huge": (_cfg(max_ctx=10**12), r"config.max_ctx = 1000000000000 is out of range"),
    "pool-negative": (_cfg(kvflash=-5), r"config.kvflash = -5 is out of range"),
    "pool-header": (_cfg(kvflash=1024), r"config.kvflash = 1024 but the cache's header has a pool of 512 tokens"),
    "pool-bool": (_cfg(kvflash=True), r"config.kvflash = True is out of range or of the wrong type"),
    "tau": (_cfg(tau=0), r"config.tau = 0"),
    "kv_type": (_cfg(kv_type="../../q8_0"), r"config.kv_type = '../../q8_0'"),
    "seed": (_cfg(seed=-1), r"config.seed = -1"),
    "ubatch": (_cfg(ubatch=1.5), r"config.ubatch = 1.5"),
    "exact_draft": (_cfg(exact_draft=1000), r"config.exact_draft = 1000"),
    "allow_long_ctx": (_cfg(allow_long_ctx="yes"), r"config.allow_long_ctx = 'yes'"),
    "config-path": (_cfg(host_path="/tmp/x"), r"config has unknown field\(s\) 'host_path'"),
    "config-missing": (lambda app: app["config"].pop("tau"), r"config has no field\(s\) 'tau'"),
    "model-path": (lambda app: app.update(model="/etc/passwd"), r"the session state has unknown field\(s\) 'model'"),
    "drafter-path": (lambda app: app.update(policy={"name": "drafter", "drafter": dict(
        path="/tmp/other.gguf", n_queries=16, smooth_width=5, kv_type="q8_0", layers=None, pool=1024,
        aggregate="max", contrast=None, spread=None)}), r"policy.drafter has unknown field\(s\) 'path'"),
    "qk-settings": (lambda app: app.update(policy={"name": "qk", "qk": dict(
        mode="keys", n_queries=10**6, smooth_width=5, aggregate="peak", contrast=32, spread=4, layers="auto",
        carry=16)}), r"policy.qk.n_queries = 1000000"),
    "qk-mode": (lambda app: app.update(policy={"name": "qk", "qk": dict(
        mode="nonsense", n_queries=8, smooth_width=5, aggregate="peak", contrast=32, spread=4, layers="auto",
        carry=16)}), r"the policy's settings: qk mode must be one of"),
    "qk-windows": (lambda app: app.update(policy={"name": "qk", "qk": dict(
        mode="keys", n_queries=8, smooth_width=5, aggregate="peak", contrast=64, spread=8, layers="auto",
        carry=16, windows=0)}), r"policy.qk.windows = 0"),
    "policy-nameless": (lambda app: app.update(policy={"lru": True}), r"policy has no name"),
    "lru-extra": (lambda app: app["policy"].update(extra=1), r"policy has unknown field\(s\) 'extra'"),
    "scores-type": (lambda app: app["state"].update(last_scores={"a": 1}), r"state.last_scores = \{'a': 1\}"),
    "scores-long": (lambda app: app["state"].update(last_scores=[0.0] * 100), r"not a list of at most 32 numbers"),
    "scores-nan": (lambda app: app["state"].update(last_scores=[float("nan")]), r"not a list of at most 32 numbers"),
    "rescores-bool": (lambda app: app["state"].update(rescores=True), r"state.rescores = True"),
    "layout": (lambda app: app.update(kvflash_session=1), r"holds Session state of layout 1; this kvflash reads layout 2"),
    "not-json": (b"\xff\xfe{", r"holds no kvflash Session state"),
    "deep": (b"[" * 200000 + b"]" * 200000, r"holds no kvflash Session state"),
    "not-object": (b"[1, 2]", r"holds no kvflash Session state"),
}


def _case_blob(saved, case):
    """APP_CASES[case] as the session-state bytes it puts in a snapshot, and the refusal it must meet."""
    how, match = APP_CASES[case]
    if isinstance(how, bytes):
        return how, match
    app = _app(saved["data"])
    how(app)
    return json.dumps(app).encode(), match


@pytest.mark.parametrize("case", list(APP_CASES))
def test_the_session_state_is_checked_before_anything_is_built(models, saved, tmp_path, case):
    import kvflash
    blob, match = _case_blob(saved, case)
    p = _write(tmp_path, "app.kvsnap", _with_app(saved["data"], blob))
    built = []

    class Counting(kvflash.Session):
        def __init__(self, *a, **kw):
            built.append(1)
            super().__init__(*a, **kw)

    with pytest.raises(kvflash.SnapshotError, match=match):
        Counting.load(p, models["llama"], threads=1)
    assert built == []      # refused before a session (its pool, its runtime) was made


def test_a_qk_snapshot_from_before_windows_scores_one_window(models, tmp_path):
    # a file written before API version 15 has no policy.qk.windows: it scored with one window, and loads so
    # (the core's reader, session_file.cpp, resolves it the same way for the C API)
    s = _session(models["llama"], policy="qk")
    s.prefill(_ids(700, 5))
    p = tmp_path / "qk.kvsnap"
    s.save(p)
    data = p.read_bytes()
    app = _app(data)
    assert app["policy"]["qk"]["windows"] == s.policy.windows
    del app["policy"]["qk"]["windows"]
    old = _load(_write(tmp_path, "old.kvsnap", _with_app(data, app)), models["llama"])
    assert old.policy.name == "qk" and old.policy.windows == 1 and old.tokens == s.tokens
    assert _load(p, models["llama"]).policy.windows == s.policy.windows


def test_a_restore_refuses_a_malformed_session_state_and_changes_nothing(models, saved, tmp_path):
    target = _Target(models["llama"])
    for case in ("max_ctx-str", "scores-type", "deep", "layout"):
        blob, match = _case_blob(saved, case)
        p = _write(tmp_path, case + ".kvsnap", _with_app(saved["data"], blob))
        _refused(target, p, match)
    target.still_works()


def test_load_builds_nothing_for_another_model_file(models, saved):
    import kvflash
    built = []

    class Counting(kvflash.Session):
        def __init__(self, *a, **kw):
            built.append(1)
            super().__init__(*a, **kw)

    with pytest.raises(kvflash.SnapshotError, match="another model file"):
        Counting.load(saved["path"], models["other"], threads=1)
    assert built == []


def test_the_file_cannot_lift_the_models_trained_context(models, tmp_path):
    # a session past the model's 4096 trained tokens, saved: loading it needs the caller's allow_long_ctx
    s = _session(models["llama"], max_ctx=8192, allow_long_ctx=True)
    s.prefill(_ids(300, 3))
    p = tmp_path / "long.kvsnap"
    s.save(p)
    assert _app(p.read_bytes())["config"]["allow_long_ctx"] is True
    with pytest.raises(ValueError, match="above the 4096 tokens this model was trained for"):
        _load(p, models["llama"])
    t = _load(p, models["llama"], allow_long_ctx=True)
    assert t.tokens == s.tokens and _gen(t, 8) == _gen(s, 8)


# ---------------------------------------------------------------- no paths from the file

def test_a_snapshot_names_no_file_and_the_drafter_is_the_callers(models, tmp_path):
    import kvflash
    model = models["llama"]
    s = _session(model, policy="drafter", drafter=model, tau=8)
    s.prefill(_ids(700, 14))
    p = tmp_path / "d.kvsnap"
    s.save(p)
    data = p.read_bytes()
    for name in (model, os.path.basename(model), os.path.dirname(model)):
        assert name.encode() not in data, name
    assert "path" not in _app(data)["policy"]["drafter"]
    # no drafter given and none next to the model: refused, asking for one
    with pytest.raises(ValueError, match="was taken with the drafter policy .* pass drafter="):
        _load(p, model)
    # the caller's drafter is the one used
    other = str(tmp_path / "drafter-copy.gguf")
    shutil.copy(model, other)
    t = _load(p, model, drafter=other)
    assert t.policy.name == "drafter" and t.policy.path == other
    assert t.tokens == s.tokens
    # one found next to the caller's model, as Session finds it
    d = tmp_path / "m"
    (d / "drafter").mkdir(parents=True)
    shutil.copy(model, d / "model.gguf")
    shutil.copy(model, d / "drafter" / "x.gguf")
    t = _load(p, str(d / "model.gguf"))
    assert t.policy.path == str(d / "drafter" / "x.gguf")
    with pytest.raises(ValueError, match="missing.gguf. is neither an existing file"):
        _load(p, model, drafter=str(tmp_path / "missing.gguf"))
    assert isinstance(kvflash.SnapshotError("x"), ValueError)


# ---------------------------------------------------------------- the model fingerprint

def _gguf_with_big_table(pad_bytes: int, extra_rows: int):
    """A GGUF whose metadata is pad_bytes long (the tensor table starts past it) and whose data holds an extra
    [N_EMBD, extra_rows] f32 tensor after the model's, as (bytes, {tensor name: (data offset, nbytes)})."""
    kv = gguf_corpus.base_kv() + [("test.pad", gguf_corpus.STR, "p" * pad_bytes)]
    tensors = gguf_corpus.base_tensors() + [["test.big", [gguf_corpus.N_EMBD, extra_rows], gguf_corpus.T_F32]]
    blob = gguf_corpus.build(kv, tensors)
    # where each tensor's data lies: the data section is the file's last bytes, tensors padded to ALIGN
    sizes = [gguf_corpus._nbytes(d, t) for _, d, t in tensors]
    data_at = len(blob) - sum(gguf_corpus._pad(n) for n in sizes)
    where, off = {}, data_at
    for (name, _, _), n in zip(tensors, sizes):
        where[name] = (off, n)
        off += gguf_corpus._pad(n)
    return blob, data_at, where


def test_the_fingerprint_covers_the_whole_tensor_table_and_every_tensors_data(tmp_path):
    MiB = 1 << 20
    blob, data_at, where = _gguf_with_big_table(5 * MiB, 6000)
    size = len(blob)
    # The bytes below lie outside what a fingerprint of the file's first 4 MiB and 1 MiB at its middle and
    # end would read: the tensor table (past 4 MiB of metadata) and the first tensors' data.
    old_windows = [(0, 4 * MiB), (size // 2, size // 2 + MiB), (size - MiB, size)]

    def outside(at):
        return not any(a <= at < b for a, b in old_windows)

    name_at = blob.index(b"blk.0.attn_q.weight")
    q_at = where["blk.0.attn_q.weight"][0] + 5
    big_at, big_n = where["test.big"]
    assert size > 6 * MiB and outside(name_at) and outside(q_at)
    base = tmp_path / "base.gguf"
    base.write_bytes(blob)
    fp = core.model_fingerprint(str(base))

    def variant(name, at, value=None):
        b = bytearray(blob)
        b[at] = value if value is not None else b[at] ^ 0x01
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(bytes(b))
        return core.model_fingerprint(str(p))

    assert variant("name", name_at + len("blk.0.attn_q.weigh"), ord("H")) != fp    # the tensor table
    assert variant("meta", blob.index(b"ppp") + 1000, ord("q")) != fp              # the metadata
    assert variant("q", q_at) != fp                                                 # a tensor's first bytes
    assert variant("mid", big_at + big_n // 2) != fp                               # a large tensor's middle
    assert variant("end", big_at + big_n - 3) != fp                                # and its end
    # the same bytes elsewhere: the same fingerprint; a file changed in place is read again
    copy = tmp_path / "copy.gguf"
    shutil.copy(base, copy)
    assert core.model_fingerprint(str(copy)) == fp
    b = bytearray(blob)
    b[q_at] ^= 0x02
    base.write_bytes(bytes(b))
    st = os.stat(base)
    os.utime(base, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert core.model_fingerprint(str(base)) != fp
    # a file ggml's parser does not read is no model
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="does not read it as a GGUF"):
        core.model_fingerprint(str(junk))


def test_a_snapshot_of_a_model_differing_past_the_old_sampled_bytes_is_refused(models, tmp_path):
    # Two model files alike in their first 4 MiB and in 1 MiB at their middle and end, which differ in one
    # weight near a tensor's start between: a snapshot of one is refused by a session over the other.
    from tinygguf import write_tiny_model
    a = tmp_path / "a.gguf"
    write_tiny_model(a, "llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=2048, seed=1,
                     extra={"test.pad": "p" * (5 << 20)})
    import gguf
    size = os.path.getsize(a)
    MiB = 1 << 20
    old_windows = [(0, 4 * MiB), (size // 2, size // 2 + MiB), (size - MiB, size)]
    starts = [int(t.data_offset) for t in gguf.GGUFReader(str(a)).tensors]
    at = next(o + 10 for o in starts if not any(lo <= o + 10 < hi for lo, hi in old_windows))
    assert size > 6 * MiB
    b = bytearray(a.read_bytes())
    b[at] ^= 0x01
    (tmp_path / "b.gguf").write_bytes(bytes(b))
    s = _session(str(a), max_ctx=1024, kvflash=None)
    s.prefill(_ids(100, 1))
    p = tmp_path / "a.kvsnap"
    s.save(p)
    t = _session(str(tmp_path / "b.gguf"), max_ctx=1024, kvflash=None)
    with pytest.raises(core.SnapshotError, match="another model file"):
        t.restore(p)
    with pytest.raises(core.SnapshotError, match="another model file"):
        _load(p, str(tmp_path / "b.gguf"))
    assert np.array_equal(_load(p, str(a)).logits(), s.logits())
