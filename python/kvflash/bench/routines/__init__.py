"""The bench routines.  Each takes a BenchConfig and returns a report.Result.

Every comparison is made inside one run, interleaved (full then kvflash, the order alternating per
repeat), so drift of a shared machine hits both sides; spreads are printed, never hidden.
"""
from __future__ import annotations

from ._shared import passkey_chunks, rank_of, rank_text, span_rank  # noqa: F401 (bench/drafter_rank.py)
from .ab import run_ab
from .attention import run_attention
from .chat import run_chat
from .decode import run_decode
from .demo import run_demo
from .exact import run_exact
from .load import run_load
from .memory import run_memory
from .paging import run_paging
from .prefill import run_prefill
from .recall import run_needle
from .rescore import run_rescore
from .ruler import run_ruler
from .serve import run_serve
from .snapshot import run_snapshot

ROUTINES = {"demo": run_demo, "decode": run_decode, "memory": run_memory, "paging": run_paging, "prefill": run_prefill,
            "needle": run_needle, "ab": run_ab, "rescore": run_rescore,
            "snapshot": run_snapshot, "serve": run_serve, "load": run_load,
            "attention": run_attention, "ruler": run_ruler, "exact": run_exact, "chat": run_chat}
