"""What a session reports: prefill progress, its stats dict and exact mode's figures."""
from __future__ import annotations

from typing import NamedTuple, Optional


class PrefillProgress(NamedTuple):
    """Where a prefill stands (``Session.prefill(progress=...)``): tokens done of total, seconds since it
    started, chunks paged out to the host store so far, and whether this is the final report."""
    done: int
    total: int
    elapsed_s: float
    page_outs: int
    finished: bool

    @property
    def tok_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> Optional[float]:
        """Seconds left at the rate so far (None before any token is done)."""
        return (self.total - self.done) / self.tok_s if self.done and self.tok_s > 0 else None

    def line(self) -> str:
        """One line for a terminal: 'prefill 2048/8192 tokens (25%), 812 tok/s, ETA 8 s, 12 page-outs'."""
        pct = 100 * self.done // max(self.total, 1)
        eta = "" if self.finished or self.eta_s is None else f", ETA {self.eta_s:.0f} s"
        took = f" in {self.elapsed_s:.1f} s" if self.finished else ""
        return (f"prefill {self.done}/{self.total} tokens ({pct}%){took}, {self.tok_s:.0f} tok/s{eta}, "
                f"{self.page_outs} page-outs")


def spec_stats(r: dict, decode_s: float) -> dict:
    """Exact mode's figures from the core's counters (``Runtime.spec_stats``; the draft length is chosen there)."""
    return {
        "exact_rounds": r["rounds"],
        "exact_drafted": r["drafted"],
        "exact_kept": r["kept"],
        "acceptance_rate": r["kept"] / r["drafted"] if r["drafted"] else 0.0,
        "mean_kept_per_round": r["kept"] / r["rounds"] if r["rounds"] else 0.0,
        "verify_share": (r["verify_ms"] / 1e3) / decode_s if decode_s > 0 else 0.0,
    }


def session_stats(s) -> dict:
    """Session.stats: the pager's counters, the pool and host store in MiB, rescores and speeds."""
    p, rt = s.pager.stats, s.runtime
    mib = 2**20
    mat = max(1, p["materialised_chunks"])
    return {
        "mode": "kvflash" if s.kvflash else "full",
        "policy": s.policy.name + (" (fallback)" if s._policy_note else ""),
        "n_past": rt.n_past,
        "max_ctx": s.max_ctx,
        "pool_tokens": rt.pool_tokens,
        "resident_kv_mib": (rt.pool_bytes + rt.swa_bytes) / mib,
        "host_kv_mib": p["host_bytes"] / mib,
        "host_cap_mib": p["max_host_bytes"] / mib if p["max_host_bytes"] else None,
        "residency_pct": 100.0 * min(p["resident_chunks"], mat) / mat,
        "page_outs": p["page_outs"],
        "page_ins": p["page_ins"],
        "clean_skips": p["clean_skips"],
        "bytes_out": p["bytes_out"],
        "bytes_in": p["bytes_in"],
        "rescores": rt.rescores,
        "rescore_ms": 1e3 * s._rescore_s,
        "reread_tokens": rt.reread_tokens,
        "reread_ms": rt.reread_ms,
        "prefill_s": s._prefill_s,
        "decode_tok_s": s._decoded / s._decode_s if s._decode_s > 0 else 0.0,
        "threads": s.threads,
        "kv_type": s.kv_type,
        **(spec_stats(rt.spec_stats, s._decode_s) if s.exact else {}),
        **({"rpc": [dict(r) for r in s.remote_layers]} if s.remote_layers else {}),
    }
