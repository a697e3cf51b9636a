"""qwen3moe, qwen35 and qwen35moe (issue 38) on tiny random-weight GGUFs (tinygguf.write_tiny_hybrid).

1. Logits for every token against llama.cpp's own forward pass (libllama from the pinned sdist,
   tests/llama_ref.py; marker `peer`), batched and one token at a time, f16 K/V on both sides.
   Tolerance: normalised error ||kvflash - llama.cpp|| / ||llama.cpp|| <= 2e-3 over the whole
   [tokens, vocab] array, and the argmax of >= 97% of rows the same.  Why that much: llama.cpp's
   attention without flash attention rounds Q and the softmax weights to f16 to multiply them with the
   f16 cache, kvflash's pool kernel keeps them in f32; on a *dense* qwen3 of the same dims that
   difference alone measures 2e-4 (1 layer) to 4e-4 (4 layers) (test_dense_control), and the families
   here measure 2e-5 (hybrids: one attention layer in four) to 6e-4 (qwen3moe, 4 attention layers; the
   same 5e-4 with every expert used, so routing adds nothing).  The router's weights are scaled
   (router_scale) so top-k has a margin; a rare flipped tie moves a row, which the argmax bound allows.
2. MTP / nextn blocks after the trunk are skipped: the same trunk with and without them, bit for bit.
3. The recurrent state: a batch equals its one-token steps bit for bit; a truncate within the
   snapshots, to a checkpoint and beyond both; an interrupted prompt changes nothing; a chat's second
   turn re-reads from a checkpoint, not from the start.
4. Exact mode over a pool far smaller than the prompt: the full cache's greedy tokens and logits, bit
   for bit (the state rolled back to the kept token after each verification; MoE under one-row products).
5. Bad files are clear errors.
6. Snapshots carry the recurrent state and its host checkpoints (format version 3): a round trip
   mid-decode continues bit for bit, a truncate after a load re-reads from a restored checkpoint, a
   version 2 file still loads where there is no recurrent state and is refused, saying why, where
   there is one; a RECR section that disagrees with its header is refused.
"""
from __future__ import annotations

import os
import struct
import sys
import zlib

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")
import kvflash  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import familyutil  # noqa: E402
import llama_ref  # noqa: E402
from tinygguf import write_tiny_hybrid, write_tiny_model  # noqa: E402

ARCHS = ["qwen3moe", "qwen35", "qwen35moe"]
HYBRIDS = ["qwen35", "qwen35moe"]
NE_TOL = 2e-3
ARGMAX_MIN = 0.97


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    out = {}
    for arch in ARCHS:
        nextn = 1 if arch in HYBRIDS else 0
        out[arch] = write_tiny_hybrid(d / f"{arch}.gguf", arch, seed=3, nextn_layers=nextn)
    out["qwen35-trunk"] = write_tiny_hybrid(d / "qwen35-trunk.gguf", "qwen35", seed=3)
    return out


def _ids(n, seed, V=266):
    return familyutil.ids(n, seed, V)


_runtime = familyutil.runtime
_session = familyutil.session


# --------------------------------------------------------------------------- 1. llama.cpp
@pytest.mark.peer
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-token"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_llama_cpp(models, arch, batched):
    info = models[arch]
    toks = _ids(160, seed=1)
    ref = llama_ref.logits(info["path"], toks, batched=batched, threads=2 if batched else 1)  # one token: 2 threads only spin
    rt = _runtime(info["path"])
    got = rt.eval(toks, all_logits=True) if batched else np.stack([rt.eval(toks[i:i + 1]) for i in range(len(toks))])
    assert got.shape == ref.shape
    ne = llama_ref.normalized_error(got, ref)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    assert ne <= NE_TOL, (arch, ne)
    assert agree >= ARGMAX_MIN, (arch, agree)


@pytest.mark.peer
def test_dense_control(tmp_path):
    """The tolerance's baseline: a dense qwen3 of the same dims, the family kvflash matched long before."""
    info = write_tiny_model(tmp_path / "q3.gguf", "qwen3", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                            n_ff=96, seed=3, tie_embeddings=False)
    toks = _ids(160, seed=1)
    ne = llama_ref.normalized_error(_runtime(info["path"]).eval(toks, all_logits=True), llama_ref.logits(info["path"], toks))
    assert 1e-6 < ne <= NE_TOL / 2


# --------------------------------------------------------------------------- 2. MTP blocks
def test_mtp_blocks_are_skipped(models):
    toks = _ids(100, seed=2)
    with_mtp = _runtime(models["qwen35"]["path"]).eval(toks, all_logits=True)
    trunk = _runtime(models["qwen35-trunk"]["path"]).eval(toks, all_logits=True)
    assert np.array_equal(with_mtp, trunk)


# --------------------------------------------------------------------------- 3. the recurrent state
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("ubatch", [1, 7, 64, 512])
def test_a_batch_is_its_steps(models, arch, ubatch):
    toks = _ids(150, seed=4)
    rt1 = _runtime(models[arch]["path"])
    steps = np.stack([rt1.eval(toks[i:i + 1]) for i in range(len(toks))])
    got = _runtime(models[arch]["path"], ubatch=ubatch).eval(toks, all_logits=True)
    assert np.array_equal(got, steps)


def test_truncate_within_the_snapshots_and_beyond(models):
    path = models["qwen35"]["path"]
    toks = _ids(300, seed=5)
    rt = _runtime(path)
    rt.eval(toks[:200])                      # two pieces: the first ends at the chunk boundary it crosses
    assert rt.checkpoints == [192]
    seen = {200: rt.last_logits().copy()}
    for i in range(200, 271):
        rt.eval(toks[i:i + 1])
        seen[i + 1] = rt.last_logits().copy()
    assert rt.max_rewind < 14
    # within the snapshots: the state is the one it had
    rt.truncate(267)
    rt.eval(toks[267:268])
    assert np.array_equal(rt.last_logits(), seen[268])
    # to a checkpoint (a chunk boundary passed one token at a time)
    cks = rt.checkpoints
    assert cks == [192, 256]
    c = cks[1]
    rt.truncate(c)
    rt.eval(toks[c:c + 1])
    assert np.array_equal(rt.last_logits(), seen[c + 1])
    # to the checkpoint the batched eval left, and the same tokens again in one piece
    rt.truncate(192)
    rt.eval(toks[192:270])
    assert np.array_equal(rt.last_logits(), seen[270])
    # beyond both: refused, nothing changed
    n = rt.n_past
    far = 150
    assert far < min(rt.checkpoints + [n]) and n - far > rt.max_rewind
    with pytest.raises(ValueError, match="recurrent"):
        rt.truncate(far)
    assert rt.n_past == n
    rt.eval(toks[n:n + 1])
    assert np.array_equal(rt.last_logits(), seen[n + 1])


@pytest.mark.parametrize("pool", [None, 256], ids=["full", "pool256"])
def test_checkpoints_thin_with_age_and_keep_the_newest_boundaries(models, pool):
    """Every eval leaves a checkpoint at the last boundary it crossed; over the limit the thinning keeps the
    oldest and the newest two, the rest spaced about geometrically with age (a pooled prompt checkpoints
    after every chunk-sized piece, which is where the thinning has most to choose from)."""
    path = models["qwen35"]["path"]
    kw = {} if pool is None else {"pool_tokens": pool}
    rt = _runtime(path, chunk_tokens=16, ubatch=128, max_ctx=4096, **kw)
    toks = _ids(3400, seed=19)
    rt.eval(toks[:900])
    for i in range(900, 3400, 10):   # turns of 10 tokens: long enough for the thinning to reach its steady state
        rt.eval(toks[i:i + 10])
        cks = rt.checkpoints
        last = rt.n_past // 16 * 16
        assert len(cks) <= 8 and all(c % 16 == 0 for c in cks) and cks == sorted(set(cks))
        assert cks[-1] == last, (rt.n_past, cks)
        if last - 16 >= 912:     # both boundaries crossed one token at a time (the batched prompt: its pieces' ends)
            assert cks[-2] == last - 16, (rt.n_past, cks)
    gaps = np.diff(cks)
    assert gaps[0] >= gaps[-1] and cks[0] <= 512    # older ones sparser; the oldest kept


def test_an_interrupted_prompt_changes_nothing(models):
    path = models["qwen35moe"]["path"]
    toks = _ids(400, seed=6)
    rt, twin = _runtime(path, ubatch=64), _runtime(path, ubatch=64)
    for r in (rt, twin):
        r.eval(toks[:100])

    def stop(done, total, *_):
        if done >= 128:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rt.eval(toks[100:400], progress=stop)
    assert rt.n_past == 100
    assert np.array_equal(rt.eval(toks[100:160], all_logits=True), twin.eval(toks[100:160], all_logits=True))


@pytest.mark.parametrize("pool", [None, 256], ids=["full", "pool256"])
@pytest.mark.parametrize("back", [0, 12], ids=["appended", "tail-redrawn"])
def test_a_chat_turn_rereads_from_a_checkpoint(models, pool, back):
    """back: the next prompt leaves the cache that many tokens before its end (a template that re-renders the
    reply's tail); 12 is past the state's snapshots (8), so the state comes back from a host checkpoint."""
    path = models["qwen35"]["path"]
    s = _session(path, pool)
    s.prefill(_ids(900, seed=7).tolist())
    "".join(s.generate(None, max_tokens=20, ignore_eos=True))
    hist = list(s.tokens)[:len(s.tokens) - back]
    new = _ids(40, seed=8).tolist()
    t0 = s.runtime.timings["tokens"]
    reused = s.continue_to(hist + new)
    reread = s.runtime.timings["tokens"] - t0
    assert len(hist) - 16 <= reused <= len(hist)
    assert len(new) <= reread <= len(new) + 16     # the new tokens plus at most one chunk
    if back:
        assert reused < len(hist)                  # not free: from the checkpoint before the cut
    # what a session that read it all at once holds
    ref = _session(path, pool)
    ref.prefill(hist + new)
    if pool is None:
        np.testing.assert_allclose(s.logits(), ref.logits(), rtol=0, atol=1e-4 * np.abs(ref.logits()).max())


# --------------------------------------------------------------------------- 4. exact mode
@pytest.mark.parametrize("arch", ARCHS)
def test_exact_greedy_is_the_full_cache(models, arch):
    path = models[arch]["path"]
    prompt = _ids(900, seed=9).tolist()
    full = _session(path)
    ex = _session(path, 256, exact=True, tau=16)
    a = "".join(full.generate(prompt, max_tokens=40, ignore_eos=True))
    b = "".join(ex.generate(prompt, max_tokens=40, ignore_eos=True))
    assert a == b and ex.tokens == full.tokens
    assert np.array_equal(ex.logits(), full.logits())
    assert ex.pager.stats["host_chunks"] > 0 and ex.stats["exact_rounds"] > 0


def test_exact_prefill_auto_on_a_hybrid(models):
    """exact_prefill='auto' reads prompts exactly up to position 16384 on the hybrids (one paged layer in four)
    and up to 4096 on qwen3moe (every layer paged); a prompt that overflows the pool leaves the full cache's
    logits, recurrent layers and all."""
    for arch in ARCHS:
        s = _session(models[arch]["path"], 256, policy="qk", exact_prefill="auto")
        assert s.exact_prefill and s.exact_prefill_until == (16384 if arch in HYBRIDS else 4096)
    path = models["qwen35"]["path"]
    prompt = _ids(900, seed=9).tolist()
    full, ep = _session(path), _session(path, 256, policy="qk", exact_prefill="auto")
    full.prefill(prompt)
    ep.prefill(prompt)
    assert ep.pager.stats["host_chunks"] > 0
    assert np.array_equal(ep.logits(), full.logits())


def test_pool_smaller_than_the_prompt_runs(models):
    """Eviction and recall with recurrent layers beside the paged ones: the pooled session decodes and its
    paged layers' chunks move; the recurrent layers' state is never paged."""
    path = models["qwen35moe"]["path"]
    s = _session(path, 256, policy="qk")
    out = "".join(s.generate(_ids(1200, seed=10).tolist(), max_tokens=30, ignore_eos=True))
    assert len(s.tokens) == 1230 and out
    st = s.pager.stats
    assert st["host_chunks"] > 0 and st["page_outs"] > 0
    assert s.runtime.n_paged_layers == 1            # one full-attention layer in four is paged


# --------------------------------------------------------------------------- 5. errors
@pytest.mark.parametrize("extra,match", [
    ({"qwen35.ssm.state_size": 0}, "state_size"),
    ({"qwen35.ssm.time_step_rank": 3}, "time_step_rank|inner_size"),
    ({"qwen35.full_attention_interval": 9}, "every layer is recurrent"),
    ({"qwen35.nextn_predict_layers": 9}, "nextn"),
])
def test_bad_hybrid_files(tmp_path, extra, match):
    bad = write_tiny_hybrid(tmp_path / "bad.gguf", "qwen35", seed=1, extra=extra)
    with pytest.raises(ValueError, match=match):
        core.Model(bad["path"], n_threads=1)


def test_moe_snapshot_round_trip_mid_decode(models, tmp_path):
    """qwen3moe has no recurrent state: its snapshots are the dense families' (pool < context, mid-decode)."""
    path = models["qwen3moe"]["path"]
    s = _session(path, 256)
    "".join(s.generate(_ids(700, seed=12).tolist(), max_tokens=10, ignore_eos=True))
    s.save(tmp_path / "m.kvf")
    want = "".join(s.generate(None, max_tokens=20, ignore_eos=True))
    r = kvflash.Session.load(tmp_path / "m.kvf", path, threads=2)
    got = "".join(r.generate(None, max_tokens=20, ignore_eos=True))
    assert got == want and r.tokens == s.tokens
    assert np.array_equal(r.logits(), s.logits())


# --------------------------------------------------------------------------- 6. snapshots of the state
def _sections(path):
    b = open(path, "rb").read()
    assert b[:8] == b"KVFLSNAP"
    ver, n = struct.unpack_from("<II", b, 8)
    at, out = 16, []
    for _ in range(n):
        tag = b[at:at + 4]
        _, ln = struct.unpack_from("<IQ", b, at + 4)
        out.append([tag, b[at + 16:at + 16 + ln]])
        at += 16 + ln
    return ver, out


def _write_sections(path, ver, secs):
    o = bytearray(b"KVFLSNAP" + struct.pack("<II", ver, len(secs)))
    for tag, p in secs:
        o += tag + struct.pack("<IQ", zlib.crc32(p), len(p)) + p
    open(path, "wb").write(bytes(o))


def _as_version_2(src, dst):
    """What kvflash before format 3 wrote: no RECR section, HEAD without its last three fields."""
    ver, secs = _sections(src)
    assert ver == core.SNAPSHOT_VERSION == 3 and secs[-1][0] == b"RECR"
    secs = secs[:-1]
    secs[0][1] = secs[0][1][:-16]     # i32 recurrent layers, u64 state floats, i32 checkpoints
    _write_sections(dst, 2, secs)


@pytest.mark.parametrize("pool", [None, 256], ids=["full", "pool256"])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_snapshot_round_trip_mid_decode(models, tmp_path, arch, pool):
    path = models[arch]["path"]
    s = _session(path, pool)
    "".join(s.generate(_ids(700, seed=12).tolist(), max_tokens=10, ignore_eos=True))
    cks = s.runtime.checkpoints
    assert len(cks) >= 2
    s.save(tmp_path / "h.kvf")
    want = "".join(s.generate(None, max_tokens=20, ignore_eos=True))
    r = kvflash.Session.load(tmp_path / "h.kvf", path, threads=2)
    assert r.runtime.checkpoints == cks
    got = "".join(r.generate(None, max_tokens=20, ignore_eos=True))
    assert got == want and r.tokens == s.tokens
    assert np.array_equal(r.logits(), s.logits())
    if pool:
        assert r.pager.stats["host_chunks"] > 0


def test_a_truncate_after_a_load_rereads_from_a_restored_checkpoint(models, tmp_path):
    path = models["qwen35"]["path"]
    s = _session(path, 256)
    "".join(s.generate(_ids(700, seed=13).tolist(), max_tokens=10, ignore_eos=True))
    s.save(tmp_path / "t.kvf")
    r = kvflash.Session.load(tmp_path / "t.kvf", path, threads=2)
    n = len(s.tokens) - 40            # past the SSM snapshots: only a host checkpoint reaches it
    assert n - max(c for c in s.runtime.checkpoints if c <= n) > 0
    for x in (s, r):
        t0 = x.runtime.timings["tokens"]
        x.truncate(n)
        assert x.runtime.timings["tokens"] - t0 <= 64 + 16   # from the checkpoint, not from the start
    assert r.tokens == s.tokens and np.array_equal(r.logits(), s.logits())
    a = "".join(s.generate(None, max_tokens=12, ignore_eos=True))
    assert "".join(r.generate(None, max_tokens=12, ignore_eos=True)) == a


def test_version_2_files(models, tmp_path):
    # without a recurrent state a version 2 file loads as it always did
    moe = models["qwen3moe"]["path"]
    s = _session(moe, 256)
    "".join(s.generate(_ids(500, seed=14).tolist(), max_tokens=5, ignore_eos=True))
    s.save(tmp_path / "m3.kvf")
    _as_version_2(tmp_path / "m3.kvf", tmp_path / "m2.kvf")
    want = "".join(s.generate(None, max_tokens=10, ignore_eos=True))
    r = kvflash.Session.load(tmp_path / "m2.kvf", moe, threads=2)
    assert "".join(r.generate(None, max_tokens=10, ignore_eos=True)) == want
    # with one it is refused, saying why, and the session is as it was
    hyb = models["qwen35"]["path"]
    h = _session(hyb)
    h.prefill(_ids(300, seed=15).tolist())
    h.save(tmp_path / "h3.kvf")
    _as_version_2(tmp_path / "h3.kvf", tmp_path / "h2.kvf")
    with pytest.raises(ValueError, match="format version 2.*recurrent"):
        kvflash.Session.load(tmp_path / "h2.kvf", hyb, threads=2)
    h.prefill(_ids(20, seed=16).tolist())
    before, logits = list(h.tokens), h.logits().copy()
    with pytest.raises(ValueError, match="format version 2.*recurrent"):
        h.restore(tmp_path / "h2.kvf")
    assert h.tokens == before and np.array_equal(h.logits(), logits)
    h.restore(tmp_path / "h3.kvf")
    assert len(h.tokens) == 300


@pytest.mark.parametrize("edit,match", [
    (lambda p, f: struct.pack("<I", 0) + p[4:], "0 states"),
    (lambda p, f: struct.pack("<I", 10 ** 6) + p[4:], "states for"),
    (lambda p, f: p[:-(8 + 4 * f)] + struct.pack("<q", 5) + p[-(4 * f):], "position 5"),
    (lambda p, f: p[:-4] + struct.pack("<f", float("nan")), "not finite"),
    (lambda p, f: p[:-4], "ends early|bytes past"),
])
def test_bad_recurrent_sections(models, tmp_path, edit, match):
    path = models["qwen35"]["path"]
    s = _session(path)
    s.prefill(_ids(300, seed=17).tolist())
    s.save(tmp_path / "g.kvf")
    ver, secs = _sections(tmp_path / "g.kvf")
    floats = struct.unpack_from("<q", secs[0][1], len(secs[0][1]) - 12)[0]
    assert secs[-1][0] == b"RECR" and floats > 0
    secs[-1][1] = edit(secs[-1][1], floats)
    _write_sections(tmp_path / "bad.kvf", ver, secs)
    with pytest.raises(ValueError, match=match):
        kvflash.Session.load(tmp_path / "bad.kvf", path, threads=2)


def test_auto_pool_counts_the_recurrent_state(models):
    m = core.Model(models["qwen35"]["path"], n_threads=1)
    r = m.recurrent_bytes()
    assert r["layers"] == 3 and r["checkpoints"] == 8
    rt = core.Runtime(m, max_ctx=2048, kv_type="f16")
    state = [x for x in rt.memories if x["kind"] == "recurrent state"]
    assert len(state) == 1 and abs(state[0]["device_bytes"] - r["state_bytes"]) <= 4096   # ggml's alignment
    rt.eval(_ids(200, seed=18))
    assert rt.checkpoints
    # one host checkpoint is what a snapshot's RECR holds per state (its floats)
    from kvflash import _pool
    assert _pool.recurrent_reserve(m) == r["state_bytes"] + 9 * r["checkpoint_bytes"]
    assert core.Model(models["qwen3moe"]["path"], n_threads=1).recurrent_bytes()["state_bytes"] == 0
    # the budget the auto pool is sized from has the reserve taken out, and the banner says so
    hp = m.hparams
    per_tok = _pool.kv_bytes_per_token(hp, "q8_0", 1)
    free = (1 << 30) + m.weight_bytes + 2 * int(4096 * per_tok) + _pool.recurrent_reserve(m)
    tok, _ = _pool.auto_pool(hp, "q8_0", 1, m.weight_bytes, 1 << 20, free_bytes=free,
                             extra_bytes=_pool.recurrent_reserve(m))
    assert tok == 4096
    # (this tiny model's reserve is worth more than 256 of its tokens: without it the pool comes out larger)
    assert _pool.auto_pool(hp, "q8_0", 1, m.weight_bytes, 1 << 20, free_bytes=free)[0] > 4096
    s = _session(models["qwen35"]["path"], "auto", max_ctx=1 << 17, allow_long_ctx=True)
    assert "recurrent state" in s.auto_reason


def test_the_chat_bench_on_a_hybrid(models, tmp_path, capsys):
    """`python -m kvflash.bench chat`: on qwen35 a turn reads the new tokens plus at most one chunk."""
    import json
    from kvflash.bench import cli
    out = tmp_path / "chat"
    assert cli.main(["chat", "--model", models["qwen35"]["path"], "--contexts", "900", "--pool", "512",
                     "--policy", "lru", "--repeats", "2", "--threads", "1", "-o", "json", "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)["results"][0]
    assert len(res["raw"]) == 4
    for x in res["raw"]:
        assert x["new"] <= x["reread"] <= x["new"] + 64 and x["checkpoints"]
    assert sum("(goal: at most one chunk, 64, beyond them: met)" in n for n in res["notes"]) == 2
