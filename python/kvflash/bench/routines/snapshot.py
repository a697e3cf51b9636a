"""Session snapshots: save time and file size against the KV bytes, restore against re-prefilling."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..common import MIB, BenchConfig, Progress, ctx_label, open_session, summarize, text_tokens, token_hash
from ..report import Result
from ._shared import BASE_COLS, _base, _long_note, _spread

# The restore variants, timed after each repeat's prefill and save, in an order rotated per repeat.
RESTORES = ["restore", "restore_again", "restore_cold", "load"]
CHECK_TOKENS = 64


def _drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to drop the file's pages (it was fsynced by the save, so they are clean): the next
    read comes from the disk, as after a reboot (a hypervisor's own cache may still sit below)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _greedy(s, n: int) -> list:
    """The next n greedy tokens (the session's context grows by them)."""
    n0 = s.n_past
    for _ in s.generate(None, max_tokens=n, temperature=0.0, ignore_eos=True):
        pass
    return list(s.tokens[n0:])


def run_snapshot(cfg: BenchConfig) -> Result:
    """Per context D: prefill D natural-text tokens into a pooled session (timed: the re-prefill a
    restart would otherwise pay), save it (timed; the file's size set against the KV bytes of D tokens),
    then restore the file into a second, already open session of the same configuration (the server
    slot's case) twice (the second restore is the A/A control of the first), once more after the file was
    dropped from the page cache (cold), and load it as a new Session over the already loaded model.
    The restore variants run in an order rotated per repeat; the ratios to the prefill are per repeat.
    After the repeats, the restored session's logits and next greedy tokens are checked against the
    session that was saved."""
    # Long on purpose: one timing loop whose steps depend on each other (prefill, then save, then the restores of
    # that file), then the rows and the bit-exactness check over the sessions it used.
    import kvflash
    from kvflash._pool import kv_bytes_per_token
    ctxs = sorted(set(cfg.contexts))
    pool = cfg.pools[0]
    max_ctx = max(ctxs) + CHECK_TOKENS + 64
    policy = cfg.policy or "lru"
    src = open_session(cfg, max_ctx=max_ctx, pool=pool, policy=policy)
    dst = open_session(cfg, max_ctx=max_ctx, pool=pool, policy=policy)
    for s in (src, dst):
        if pool >= max_ctx or s.pager is None:
            raise ValueError(f"snapshot: pool {pool} holds the whole context ({max_ctx}): choose a smaller --pool")
    toks = text_tokens(src, max_ctx)
    # the full cache's: every layer with KV (recurrent layers have none)
    kv_per_token = kv_bytes_per_token(src.hparams, cfg.kv_type,
                                      int(src.hparams["n_layer"]) - src.model.recurrent_bytes()["layers"])
    res = Result("snapshot", f"session snapshots: save, file size and restore against re-prefilling "
                 f"(pool {pool}, policy {src.policy.name}; median ± spread of {cfg.repeats} repeats)",
                 BASE_COLS + [("pool", "pool"), ("policy", "policy"), ("context", "context"), ("op", "op"),
                              ("seconds", "seconds"), ("vs_prefill", "vs re-prefill per repeat (median, min-max)"),
                              ("mib_s", "MiB/s of file"), ("file_mib", "file MiB"), ("kv_mib", "KV MiB"), ("full_kv_mib", "full-cache KV MiB"),
                              ("file_vs_kv", "file / KV"), ("exact", "restored = saved")])
    tmp = Path(tempfile.mkdtemp(prefix="kvflash-snapbench-", dir=os.environ.get("KVFLASH_SNAPSHOT_DIR")))
    path = tmp / "session.kvfsnap"
    exact = {}
    try:
        with Progress(sum(ctxs) * cfg.repeats, "snapshot", cfg.quiet) as pb:
            for D in ctxs:
                for r in range(cfg.repeats):
                    src.reset()
                    pb.note(f"{ctx_label(D)} prefill")
                    t0 = time.perf_counter()
                    src.prefill(toks[:D], progress=pb.prefill_note(f"{ctx_label(D)}: "))
                    t_prefill = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    src.save(path)
                    t_save = time.perf_counter() - t0
                    size = path.stat().st_size
                    kv = {"pool_bytes": int(src.runtime.pool_bytes + src.runtime.swa_bytes),
                          "host_bytes": int(src.pager.stats["host_bytes"])}
                    row = {**_base(cfg, src), "context": D, "repeat": r, "prefill": t_prefill, "save": t_save,
                           "file_bytes": size, **kv}
                    k = r % len(RESTORES)
                    for op in RESTORES[k:] + RESTORES[:k]:
                        if op == "restore_cold":
                            _drop_from_page_cache(path)
                        dst.reset()
                        t0 = time.perf_counter()
                        if op == "load":
                            s3 = kvflash.Session.load(path, src.model, threads=cfg.threads)
                            row[op] = time.perf_counter() - t0
                            del s3
                        else:
                            dst.restore(path)
                            row[op] = time.perf_counter() - t0
                    res.raw.append(row)
                    pb.advance(D, note=f"{ctx_label(D)} prefill {t_prefill:.1f}s save {t_save:.2f}s "
                                       f"restore {row['restore']:.2f}s")
                # bit-exactness: the file restored into dst against src, which still holds what was saved
                dst.restore(path)
                same_logits = bool(np.array_equal(src.logits(), dst.logits()))
                a, b = _greedy(src, CHECK_TOKENS), _greedy(dst, CHECK_TOKENS)
                exact[D] = (same_logits, a == b, sum(x == y for x, y in zip(a, b)), token_hash(a), token_hash(b))
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    for D in ctxs:
        rr = [x for x in res.raw if x["context"] == D]
        size = statistics.median(x["file_bytes"] for x in rr)
        kv_bytes = rr[-1]["pool_bytes"] + rr[-1]["host_bytes"]
        full_kv = D * kv_per_token
        same_logits, same_toks, n_same, hash_src, hash_dst = exact[D]
        ex = ("yes" if same_logits and same_toks else
              f"NO: logits {'equal' if same_logits else 'differ'}, {n_same}/{CHECK_TOKENS} tokens")
        for op in ["prefill", "save"] + RESTORES:
            sec = summarize(x[op] for x in rr)
            row = {**_base(cfg, src), "pool": pool, "policy": src.policy.name, "context": D, "op": op,
                   "seconds": sec}
            if op != "prefill":
                ratios = [x[op] / x["prefill"] for x in rr]
                row["vs_prefill"] = f"{statistics.median(ratios) * 100:.2f}% ({_spread([q * 100 for q in ratios])}%)"
                row["mib_s"] = size / MIB / sec["median"] if sec["median"] else None
            if op == "save":
                row.update(file_mib=size / MIB, kv_mib=kv_bytes / MIB, full_kv_mib=full_kv / MIB,
                           file_vs_kv=f"{size / kv_bytes:.3f}")
            if op == "restore":
                row["exact"] = ex
                row["tokens_sha256"] = {"saved_session": hash_src, "restored": hash_dst}
            res.rows.append(row)
        a = [x["restore"] / x["restore_again"] for x in rr]
        target = max(x["restore"] / x["prefill"] for x in rr)
        res.notes.append(f"{ctx_label(D)}: restore / re-prefill {statistics.median([x['restore'] / x['prefill'] for x in rr]) * 100:.2f}% "
                         f"(worst repeat {target * 100:.2f}%; target <= 5%), cold "
                         f"{statistics.median([x['restore_cold'] / x['prefill'] for x in rr]) * 100:.2f}%; "
                         f"A/A restore / restore_again {statistics.median(a):.2f}x ({_spread(a)}); "
                         f"restored logits and next {CHECK_TOKENS} greedy tokens equal to the saved session's: {ex}")
    res.notes.append(f"KV MiB: what the session holds (pool + sliding-window rows + host store's used bytes); full-cache "
                     f"KV MiB: {kv_per_token:.0f} B/token x the context (every layer with KV, {cfg.kv_type}); file / KV: "
                     "the file's size over KV MiB (the file also holds the token history, the last logits, the captured "
                     "queries and, with recurrent layers, their state and host checkpoints)")
    res.notes += [
        "prefill: a fresh prefill of the context into a reset session (what a restart pays without a snapshot); "
        "save: Session.save (a temporary file beside the target, fsynced, renamed; the directory fsynced)",
        "restore: Session.restore into a second open session of the same configuration (a server slot); "
        "restore_again: the same once more (the A/A control); restore_cold: after the file's pages were dropped "
        "from the page cache (posix_fadvise DONTNEED; a hypervisor's cache below the VM may still serve it); "
        "load: Session.load, a new Session over the already loaded model (its pool and buffers allocated too)",
        "the restore variants run in an order rotated per repeat; ratios to the prefill are per repeat "
        f"(the same repeat's prefill); snapshot files in {tmp.parent}",
    ]
    if (n := _long_note(cfg, max_ctx)):
        res.notes.append(n)
    return res
