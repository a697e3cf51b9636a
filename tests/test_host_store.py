"""The host store under misuse (issue 16): host="file" is exclusive, leaves nothing
behind, and turns a full disk into an error; max_host_bytes caps it (a page-out past
the cap changes nothing); reset() hands its memory back."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvflash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pagerutil import C, make  # noqa: E402


def _run_isolated(code: str, timeout: int = 120, prefix=()) -> tuple[int, str]:
    prelude = f"import sys; sys.path.insert(0, {HERE!r})\n"
    r = subprocess.run(list(prefix) + [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _fill(p, n_chunks, seed=0):
    """Write chunks 0..n_chunks-1 with distinct bytes (every layer, K and V); returns them."""
    rng = np.random.default_rng(seed)
    want = {}
    for c in range(n_chunks):
        slots = p.alloc_span(c * C, C)
        assert slots is not None
        rows = []
        for layer in range(p.n_layers):
            for kv in (p.k_rows(layer), p.v_rows(layer)):
                kv[slots] = rng.integers(0, 256, kv[slots].shape, dtype=np.uint8)
                rows.append(kv[slots].copy())
        want[c] = rows
    return want


def _check(p, want):
    for c, rows in want.items():
        if p.chunk_table()["block"][c] < 0:
            assert p.recall(c)
        slots = np.array([p.slot_of(c * C + i) for i in range(C)])
        got = [kv[slots] for layer in range(p.n_layers) for kv in (p.k_rows(layer), p.v_rows(layer))]
        assert all(np.array_equal(a, b) for a, b in zip(got, rows)), f"chunk {c} came back different"


def test_file_store_refuses_an_existing_path(tmp_path):
    path = tmp_path / "precious.bin"
    path.write_bytes(b"not kvflash's" * 100)
    with pytest.raises(ValueError, match="already exists"):
        make(host="file", host_path=path)
    assert path.read_bytes() == b"not kvflash's" * 100  # untouched (it was truncated)


def test_two_stores_given_one_path_do_not_share_it(tmp_path):
    # Before: the second store truncated and remapped the first one's file (O_TRUNC,
    # no O_EXCL): the first one's paged-out chunks came back as the second's bytes.
    path = tmp_path / "store.bin"
    a = make(host="file", host_path=path, n_embd_k=128)
    want_a = _fill(a, 16, seed=1)
    b = make(host="file", host_path=path, n_embd_k=128)  # the first one's name is gone: a new file
    want_b = _fill(b, 16, seed=2)
    _check(a, want_a)
    _check(b, want_b)
    a.check_invariants()
    b.check_invariants()


def test_file_store_leaves_nothing_behind_a_crash(tmp_path):
    path = tmp_path / "store.bin"
    rc, out = _run_isolated(f"""
        import os, signal
        from pagerutil import make, C
        p = make(host="file", host_path={str(path)!r}, n_embd_k=128)
        for c in range(16):
            p.alloc_span(c * C, C)
        assert p.stats["host_bytes"] > 0
        print("exists while alive:", os.path.exists({str(path)!r}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert rc == -9, out
    assert "exists while alive: False" in out, out
    assert not path.exists() and not list(tmp_path.iterdir())


def _small_tmpfs_prefix(tmp_path):
    """A command prefix giving the child a 1 MiB tmpfs at tmp_path/small (a user and
    mount namespace), or None where this machine does not allow it."""
    if not shutil.which("unshare"):
        return None
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mnt} && df {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs {mnt} && exec "$0" "$@"']


def test_full_disk_is_an_error_not_sigbus(tmp_path):
    prefix = _small_tmpfs_prefix(tmp_path)
    if prefix is None:
        pytest.skip("no user/mount namespaces here (unshare -rm)")
    store = tmp_path / "small" / "store.bin"
    rc, out = _run_isolated(f"""
        from pagerutil import make, C
        p = make(host="file", host_path={str(store)!r}, n_embd_k=1024, max_ctx=64 * 64)
        try:
            for c in range(64):      # ~70 KiB a chunk: the 1 MiB disk fills after a dozen
                if p.alloc_span(c * C, C) is None:
                    break
            print("NO ERROR")
        except RuntimeError as e:
            print("RuntimeError", e)
        p.check_invariants()
        print("OK", p.stats["host_chunks"])
    """, prefix=prefix)
    assert rc == 0 and "RuntimeError" in out and "No space left" in out and "OK" in out, (rc, out)


def test_host_cap_stops_with_a_clear_error_and_changes_nothing():
    # One host buffer left under the cap, and an alloc (or a reselect) that needs two
    # page-outs: before the pager reserved its buffers, the first went through and the
    # second threw, leaving a chunk placed with its span unwritten.
    chunk = make().chunk_bytes
    p = make(max_ctx=64 * 64, max_host_bytes=16 * chunk)
    want = _fill(p, 15 + 8)  # 8 resident, 15 paged out: one buffer left
    assert p.stats["host_reserved_bytes"] == 16 * chunk
    before = {k: v.copy() for k, v in p.chunk_table().items()}
    stats = p.stats

    def unchanged():
        after = p.chunk_table()
        assert all(np.array_equal(before[k], after[k]) for k in before), "a refused call changed the chunk table"
        assert p.stats["page_outs"] == stats["page_outs"] and p.stats["page_ins"] == stats["page_ins"]
        p.check_invariants()

    with pytest.raises(RuntimeError, match="host store full: max_host_bytes"):
        p.alloc_span(23 * C, 2 * C)  # two page-outs
    unchanged()
    with pytest.raises(RuntimeError, match="host store full"):
        p.reselect(-np.arange(p.n_chunks, dtype=np.float32))  # recalls 1..7: seven page-outs
    unchanged()
    assert p.scores() is None  # the refused reselect left the scores as they were
    assert p.alloc_span(23 * C, C) is not None  # one page-out: exactly at the cap
    with pytest.raises(RuntimeError, match="host store full"):
        p.recall(3)  # its block would come from a resident chunk that has no copy yet
    p.truncate(8 * C)  # frees blocks and copies: what was paged out comes back intact
    _check(p, {c: want[c] for c in range(8)})
    p.check_invariants()
    assert p.stats["max_host_bytes"] == 16 * chunk


def test_session_stops_at_the_host_cap_and_stays_consistent(tmp_path):
    sys.path.insert(0, HERE)
    from tinygguf import write_small_llama
    path = write_small_llama(tmp_path / "m.gguf", seed=4)
    s = kvflash.Session(path, max_ctx=4096, kvflash=512, policy="lru", threads=1, verbose=False,
                        max_host_bytes=512 << 10)
    cap_chunks = (512 << 10) // s.pager.chunk_bytes
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 250, 512 + C * (cap_chunks - 2))]
    s.prefill(ids)
    with pytest.raises(RuntimeError, match="host store full"):
        for _ in s.generate(max_tokens=4 * C, ignore_eos=True):
            pass
    assert s.finish_reason == "error"
    assert s.n_past == len(s.tokens) and s.pager.stats["host_reserved_bytes"] <= 512 << 10
    s.pager.check_invariants()
    with pytest.raises(RuntimeError, match="host store full"):
        s.prefill(ids[: 4 * C])  # a whole prompt refused at the cap: none of it stays
    assert s.n_past == len(s.tokens)
    s.reset()
    assert s.pager.stats["host_reserved_bytes"] == 0
    s.prefill(ids[:700])


def test_reset_returns_host_memory():
    p = make(max_ctx=64 * 64)
    _fill(p, 40)
    assert p.stats["host_reserved_bytes"] > 0
    p.reset()
    assert p.stats["host_reserved_bytes"] == 0 and p.stats["host_bytes"] == 0
    want = _fill(p, 30, seed=5)  # and the store grows again as before
    _check(p, want)
    p.check_invariants()
