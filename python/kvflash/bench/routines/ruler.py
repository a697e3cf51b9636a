"""RULER-style retrieval per task, residency and policy (the `ruler` routine).

Per trial the full cache answers once, then per residency (pool = context / N) one pooled prefill is made
under LRU and saved to a snapshot; every policy restores it, rescores as `Session.prefill` would after a
prompt that outgrew the pool (the re-read of the prompt's tail included), and answers.  A pooled prefill
does not depend on the policy (no rescore runs inside it), so this equals a prefill per policy, and
costs one prefill per residency.  The drafter policy is one object shared by the residencies: its own
cache of the trial's history is fed once.

Long matrices run in parts: with a log file (``--log``, default ``<out>/trials.jsonl``) each finished trial
is appended as it ends and trials already in the log are not run again, so a run cut short (or split
across sessions) resumes where it stopped and the table is built from every logged trial.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..common import BenchConfig, Progress, Unavailable, ctx_label, drafter_variant_kw, open_session, qk_variant
from ..report import Result
from ..ruler import GENRE_HAYSTACKS, LIST_TASKS, RulerBuilder, score
from ._shared import BASE_COLS, _base, _long_note, passkey_chunks, rank_of


def _residencies(cfg: BenchConfig, task: str) -> list:
    """Residency denominators for a task: the aggregation guard at 1/4 and 1/8 (the issue's), the rest at
    the configured ones."""
    return sorted(set(cfg.ruler_aggregate_residencies if task in LIST_TASKS else cfg.ruler_residencies))


def _trial_key(D: int, task: str, hay: str, i: int) -> str:
    return f"{D}:{task}:{hay}:{i}"


def _load_log(path: Optional[Path], cfg: BenchConfig) -> dict:
    """Trials already logged with this configuration (their key -> record)."""
    done: dict = {}
    if path is None or not path.exists():
        return done
    want = _log_identity(cfg)
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            have = rec.get("identity") or {}
            if all(have.get(k) == v for k, v in want.items()):   # a setting added later reads as its default
                done[rec["key"]] = rec
    return done


def _log_identity(cfg: BenchConfig) -> dict:
    """What must match for a logged trial to be reused: everything that changes a prompt or an answer."""
    return {"model": cfg.model, "kv_type": cfg.kv_type, "split": cfg.split, "seed": cfg.seed,
            "chunk_tokens": cfg.chunk_tokens, "tail_chunks": cfg.tail_chunks, "drafter": cfg.drafter,
            "prefill_piece": cfg.prefill_piece,
            "reserve": cfg.answer_tokens,
            # only when set, so logs written before the option still match its default
            **({"exact_prefill": True} if cfg.exact_prefill else {}),
            **({"prefill_rescore": cfg.prefill_rescore} if cfg.prefill_rescore else {}),
            **({"prefill_reread": True} if cfg.prefill_reread else {})}


def _drafter(cfg: BenchConfig, **over):
    """The drafter policy object shared by every residency (None: no drafter, with the reason); `over`:
    DrafterPolicy keywords that override the --drafter-* options (a ``drafter:c64`` setting)."""
    from kvflash.models import resolve_model
    from kvflash.scoring import DrafterPolicy
    from kvflash._pool import find_drafter
    path = resolve_model(cfg.drafter) if cfg.drafter else find_drafter(resolve_model(cfg.model))
    if path is None:
        return None, "no drafter found next to the model; pass --drafter"
    pairs = (("layers", cfg.drafter_layers), ("pool", cfg.drafter_pool), ("n_queries", cfg.drafter_queries),
             ("contrast", cfg.drafter_contrast), ("spread", cfg.drafter_spread))
    return DrafterPolicy(path, threads=cfg.threads, **{**{k: v for k, v in pairs if v is not None}, **over}), None


def first_line(text: str, final: bool = False) -> Optional[str]:
    """The answer's first line with a letter or digit once it has ended (final: or the text has ended), lines
    before it skipped -- blank ones, or a bare ':' (a base model often breaks the line after the answer
    prefix, or writes its colon first); None while no such line has ended."""
    lines = text.split("\n")
    for line in lines if final else lines[:-1]:
        if any(ch.isalnum() for ch in line):
            return line.strip()
    return None


def _answer(s, n_tokens: int) -> tuple:
    """The greedy answer: its first line with a letter or digit (first_line), or what n_tokens gave."""
    t0 = time.perf_counter()
    text, line = "", None
    gen = s.generate(None, max_tokens=n_tokens, temperature=0.0)
    try:
        for piece in gen:
            text += piece
            line = first_line(text)
            if line is not None:
                break
    finally:
        gen.close()   # the session is free again (a snapshot restore follows)
    if line is None:
        line = first_line(text, final=True)
    return (line if line is not None else text.strip()), time.perf_counter() - t0


def _needed(s, ids: list, needles: list, last_scores) -> dict:
    """Where the chunks holding each expected value's whole needle (its key and its value) stand: kept (all
    resident), ranks under the prompt's rescore (the worst chunk of each needle; -1: protected), free slots."""
    table = s.pager.chunk_table()
    blocks, prot = table["block"], table["protected"]
    per_value = [passkey_chunks(s, ids, x) for x in needles]
    kept = [bool(cs) and all(bool(blocks[c] >= 0) for c in cs) for cs in per_value]
    ranks = None
    if last_scores is not None:
        n = len(last_scores)
        ranks = [max((rank_of(last_scores, prot[:n], c) for c in cs), default=None) for cs in per_value]
    free = int(s.pager.n_blocks - np.count_nonzero(prot & (blocks >= 0)))
    return {"kept": kept, "ranks": ranks, "free_slots": free, "chunks": per_value}


def run_ruler(cfg: BenchConfig) -> Result:
    """RULER-style tasks x residency x policy on one split, the full cache's score beside each cell."""
    from kvflash import _core
    from kvflash.policies import LRUPolicy
    from kvflash.scoring import QKPolicy

    ctxs = sorted(set(cfg.contexts))
    tasks = list(cfg.ruler_tasks)
    hays = list(cfg.haystacks)
    log_path = Path(cfg.ruler_log) if cfg.ruler_log else None
    done = _load_log(log_path, cfg)
    identity = _log_identity(cfg)
    drafters, drafter_na = {}, None   # "drafter" and each drafter:... setting -> its policy, shared by residencies
    for name in cfg.policies:
        if name == "drafter" or name.startswith("drafter:"):
            pol, drafter_na = _drafter(cfg, **({} if name == "drafter" else drafter_variant_kw(name)))
            if pol is not None:
                pol.name = name
                drafters[name] = pol
    policies = [p for p in cfg.policies if not (p == "drafter" or p.startswith("drafter:")) or p in drafters]
    floor = _core.min_pool_tokens(cfg.chunk_tokens or 64, 1, 4 if cfg.tail_chunks is None else cfg.tail_chunks)
    n_trials = sum(cfg.needles * (1 if t in LIST_TASKS else len(hays)) for t in tasks) * len(ctxs)
    res = Result("ruler", f"RULER-style retrieval ({cfg.split} split, {cfg.needles} trial(s) per haystack and cell)",
                 BASE_COLS + [("context", "context"), ("task", "task"), ("residency", "residency"),
                              ("pool", "pool"), ("policy", "policy"), ("trials", "trials"), ("score", "score %"),
                              ("full", "full cache %"), ("of_full", "of full"), ("all", "all values"),
                              ("kept", "needed chunks kept"), ("ranks", "worst needed rank (free slots)"),
                              ("rescore_ms", "prompt rescore ms"), ("decode_ms", "ms/token")] +
                 # per haystack when a corpus genre is among them (the per-genre breakdown)
                 ([("by_haystack", "score % by haystack")] if set(hays) & set(GENRE_HAYSTACKS) else []))
    tmp = tempfile.mkdtemp(prefix="kvflash-ruler-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    snap = os.path.join(tmp, "prefill.kvfs")
    with Progress(n_trials, "ruler", cfg.quiet) as pb:
        for D in ctxs:
            reserve = cfg.answer_tokens
            if cfg.ruler_logged_only:
                pb.advance(sum(cfg.needles * (1 if t in LIST_TASKS else len(hays)) for t in tasks),
                           note=f"{ctx_label(D)}: from the log")
                continue
            denoms = sorted({r for t in tasks for r in _residencies(cfg, t)})
            full = open_session(cfg, max_ctx=D, pool=None)
            sess, na = {}, {}
            for r in denoms:
                pool = D // r
                if pool < floor or pool % (cfg.chunk_tokens or 64):
                    na[r] = f"pool {pool} is below the floor {floor} (chunk {cfg.chunk_tokens or 64})"
                    continue
                pols = {"lru": LRUPolicy(), "qk": QKPolicy(), **drafters}
                pols.update({v: qk_variant(v) for v in policies if v.startswith("qk:")})
                widest = max((p for p in pols.values() if isinstance(p, QKPolicy)), key=lambda p: p.n_capture)
                try:   # the session captures the widest window any qk setting reads (each takes its tail)
                    s = open_session(cfg, max_ctx=D, pool=pool, policy=widest)
                except (Unavailable, ValueError) as e:
                    na[r] = str(e)
                    continue
                sess[r] = (s, pols)
            builder = RulerBuilder(full, cfg.seed, split=cfg.split)
            for task in tasks:
                for hay in (["list"] if task in LIST_TASKS else hays):
                    for i in range(cfg.needles):
                        key = _trial_key(D, task, hay, i)
                        if key in done:
                            pb.advance(1, note=f"{key}: logged")
                            continue
                        tr = builder.trial(task, hay, i, D - reserve)
                        rec = {"key": key, "identity": identity, "context": D, "task": task, "haystack": hay,
                               "trial": i, "kind": tr.kind, "depth": tr.depth, "values": tr.values,
                               "prompt_tokens": len(tr.ids), "modes": []}
                        pb.note(f"{ctx_label(D)} {task} {hay} #{i}: full")
                        full.reset()
                        t0 = time.perf_counter()
                        full.prefill(tr.ids, progress=pb.prefill_note(f"{ctx_label(D)} {task} #{i} full: "))
                        pre = time.perf_counter() - t0
                        ans, dt = _answer(full, tr.answer_tokens)
                        rec["modes"].append({"residency": 1, "pool": None, "policy": "full", "answer": ans,
                                             "score": score(ans, tr.values), "prefill_s": pre, "answer_s": dt,
                                             "answer_tokens": full.stats["n_past"] - len(tr.ids)})
                        for r in _residencies(cfg, task):
                            if r not in sess:
                                continue
                            s, pols = sess[r]

                            def own_prefill(name):
                                # the prefill itself depends on the policy (its rescores), or its settle needs
                                # what only a prefill keeps (the sliding layers' rows for the re-read)
                                return (cfg.prefill_rescore and isinstance(pols[name], QKPolicy)) or \
                                    (cfg.prefill_reread and name != "lru")
                            pre = None
                            if not all(own_prefill(name) for name in policies):   # one shared prefill
                                pb.note(f"{ctx_label(D)} {task} {hay} #{i}: 1/{r} prefill")
                                s.policy = pols["lru"]
                                s.reset()
                                t0 = time.perf_counter()
                                s.prefill(tr.ids, progress=pb.prefill_note(f"{ctx_label(D)} {task} #{i} 1/{r}: "))
                                pre = time.perf_counter() - t0
                                s.save(snap)
                            for name in policies:
                                s.policy = pols["lru"]
                                if not own_prefill(name):
                                    s.restore(snap)
                                s.policy = pols[name]
                                r0, t0 = s._rescore_s, time.perf_counter()
                                if own_prefill(name):
                                    # this one reads the prompt itself
                                    s.reset()
                                    s.prefill(tr.ids)
                                    mode_pre = time.perf_counter() - t0
                                else:
                                    s._settle_prompt(tr.ids)
                                    mode_pre = pre
                                settle = time.perf_counter() - t0
                                resc = s._rescore_s - r0
                                if task in LIST_TASKS:   # every occurrence counts: no chunk holds "the" value
                                    where = {"kept": None, "ranks": None, "chunks": None, "free_slots": None}
                                else:
                                    where = _needed(s, tr.ids, tr.needles,
                                                    s.last_scores if name != "lru" else None)
                                n0 = s.n_past
                                ans, dt = _answer(s, tr.answer_tokens)
                                ntok = s.n_past - n0
                                rec["modes"].append({"residency": r, "pool": s.runtime.pool_tokens, "policy": name,
                                                     "answer": ans, "score": score(ans, tr.values),
                                                     "prefill_s": mode_pre, "settle_s": settle, "rescore_s": resc,
                                                     "answer_s": dt, "answer_tokens": ntok,
                                                     "kept": where["kept"], "ranks": where["ranks"],
                                                     "free_slots": where["free_slots"],
                                                     "chunks": where["chunks"]})
                                pb.note(f"{ctx_label(D)} {task} {hay} #{i}: 1/{r} {name} {score(ans, tr.values):.2f}")
                        done[key] = rec
                        if log_path is not None:
                            log_path.parent.mkdir(parents=True, exist_ok=True)
                            with open(log_path, "a") as f:
                                f.write(json.dumps(rec) + "\n")
                        pb.advance(1, note=f"{key}: full {rec['modes'][0]['score']:.2f}")
            for r, (s, _) in sess.items():
                res.notes.append(f"{ctx_label(D)} 1/{r}: pool {s.runtime.pool_tokens} tokens, "
                                 f"{s.pager.n_blocks} chunks of {s.chunk_tokens}")
            for r, why in na.items():
                res.notes.append(f"{ctx_label(D)} 1/{r}: n/a ({why})")
            del sess, full
    try:
        os.remove(snap)
    except OSError:
        pass
    os.rmdir(tmp)
    _rows(cfg, res, done, ctxs, tasks, hays, policies)
    missing = [p for p in cfg.policies if (p == "drafter" or p.startswith("drafter:")) and p not in drafters]
    if missing:
        res.notes.append(f"{', '.join(missing)}: n/a ({drafter_na})")
    res.notes += [
        ("TUNING data (split tuning): the prompts selection parameters are chosen on; not a result"
         if cfg.split == "tuning" else
         "reporting data (split reporting: wordings, key words, value words and seeds held out from every "
         "tuning run)"),
        "score: RULER's string match, the share of the expected values found in the greedy answer (its first "
        "line with a letter or digit), mean over the trials; all values: trials with every value found; of full: the cell's score "
        "over the full cache's on the same trials",
        "one pooled prefill per trial and residency (under LRU: a prefill does not depend on the policy), "
        "restored from a snapshot for each policy, which then rescores and re-reads the prompt's tail as "
        "Session.prefill does" + (" (the policies that prefill themselves: see below)"
                                  if cfg.prefill_rescore or cfg.prefill_reread else ""),
        "needed chunks kept: trials whose chunks holding every expected value's needle sentence (its key and "
        "its value) were resident after the prompt's rescore; worst needed rank: per trial the worst rank "
        "(0 = best, p = protected) of such a chunk under the prompt's rescore, against the free slots (kept "
        "when rank < free slots)",
        "prompt rescore ms: the policy's scoring of the prompt (median); ms/token: the answer's decode"]
    if cfg.exact_prefill:
        res.notes.append("exact prefill (--exact-prefill): the kvflash sessions evaluate the prompt as the full cache "
                         "does (every position attended, paged-out rows read from the host store), so every chunk's "
                         "K/V are the full cache's and no tail is re-read; the policy then picks the residents and the "
                         "answer decodes over the pool")
    if cfg.prefill_rescore:
        res.notes.append(f"prefill rescore (--prefill-rescore {cfg.prefill_rescore}): each qk policy prefills the prompt "
                         f"itself, rescoring every {cfg.prefill_rescore} pooled piece(s) so the next pieces attend the "
                         "chunks the latest piece ranks highest (its prefill_s and settle_s are that prefill, "
                         "rescores included); lru and the drafter share the LRU prefill")
    if cfg.prefill_reread:
        res.notes.append("prefill re-read (--prefill-reread): each scoring policy prefills the prompt itself and its "
                         "settle reads the chosen chunks the pooled pieces wrote again in place with exact attention "
                         "(Session(prefill_reread=True)); its prefill_s and settle_s are that prefill, settle and "
                         "re-read included; lru shares the LRU prefill")
    if (n := _long_note(cfg, max(ctxs))):
        res.notes.append(n)
    res.raw = [dict(m, key=rec["key"], context=rec["context"], task=rec["task"], haystack=rec["haystack"],
                    trial=rec["trial"], kind=rec["kind"], depth=rec["depth"], values=" ".join(rec["values"]),
                    prompt_tokens=rec["prompt_tokens"], kept=None if m.get("kept") is None else
                    " ".join("1" if k else "0" for k in m["kept"]),
                    ranks=None if m.get("ranks") is None else " ".join("-" if x is None else str(x)
                                                                       for x in m["ranks"]),
                    chunks=None if m.get("chunks") is None else " ".join("+".join(map(str, c)) for c in m["chunks"]))
               for rec in done.values() if rec["context"] in ctxs and rec["task"] in tasks for m in rec["modes"]]
    return res


def _rows(cfg: BenchConfig, res: Result, done: dict, ctxs: list, tasks: list, hays: list, policies: list) -> None:
    for D in ctxs:
        for task in tasks:
            recs = [r for r in done.values() if r["context"] == D and r["task"] == task
                    and (task in LIST_TASKS or r["haystack"] in hays)]
            if not recs:
                continue
            full = [next(m for m in r["modes"] if m["policy"] == "full") for r in recs]
            fscore = 100.0 * statistics.mean(m["score"] for m in full)
            by_hay = task not in LIST_TASKS and bool(set(hays) & set(GENRE_HAYSTACKS))

            def per_hay(pick) -> str:
                """'code 50, chat 0': the cell's mean score per haystack, in the order asked for."""
                out = []
                for h in hays:
                    xs = [m["score"] for r in recs if r["haystack"] == h for m in r["modes"] if pick(m)]
                    if xs:
                        out.append(f"{h} {100.0 * statistics.mean(xs):.0f}")
                return ", ".join(out)
            base = {**_base(cfg), "threads": cfg.threads, "context": D, "task": task}
            res.rows.append({**base, "residency": "1", "pool": "-", "policy": "full", "trials": len(recs),
                             "score": round(fscore, 1), "full": round(fscore, 1), "of_full": "1.00",
                             "all": f"{sum(m['score'] == 1.0 for m in full)}/{len(full)}",
                             "decode_ms": _ms_per_token(full),
                             **({"by_haystack": per_hay(lambda m: m["policy"] == "full")} if by_hay else {})})
            for r in _residencies(cfg, task):
                for pol in policies:
                    ms = [m for rec in recs for m in rec["modes"] if m["residency"] == r and m["policy"] == pol]
                    if not ms:
                        continue
                    sc = 100.0 * statistics.mean(m["score"] for m in ms)
                    row = {**base, "residency": f"1/{r}", "pool": ms[0]["pool"], "policy": pol, "trials": len(ms),
                           "score": round(sc, 1), "full": round(fscore, 1),
                           "of_full": "-" if fscore == 0 else f"{sc / fscore:.2f}",
                           "all": f"{sum(m['score'] == 1.0 for m in ms)}/{len(ms)}",
                           "decode_ms": _ms_per_token(ms)}
                    if by_hay:
                        row["by_haystack"] = per_hay(lambda m, r=r, pol=pol: m["residency"] == r and m["policy"] == pol)
                    if task not in LIST_TASKS:
                        row["kept"] = f"{sum(all(m['kept']) for m in ms)}/{len(ms)}"
                    if pol != "lru":
                        row["rescore_ms"] = round(1e3 * statistics.median(m["rescore_s"] for m in ms), 1)
                    if pol != "lru" and task not in LIST_TASKS:
                        worst = []
                        for m in ms:
                            rk = [x for x in (m.get("ranks") or []) if x is not None]
                            worst.append("?" if not rk else ("p" if max(rk) < 0 else str(max(rk))))
                        row["ranks"] = " ".join(worst) + f" ({ms[-1]['free_slots']})"
                    res.rows.append(row)


def _ms_per_token(ms: list) -> Optional[float]:
    v = [1e3 * m["answer_s"] / m["answer_tokens"] for m in ms if m.get("answer_tokens")]
    return round(statistics.median(v), 1) if v else None
