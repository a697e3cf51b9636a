"""Shared pieces of the bench: configuration, statistics, progress, machine info, sessions."""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

MIB = 2**20
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- configuration
@dataclasses.dataclass
class BenchConfig:
    """Everything a routine needs; written beside every result (STYLE 9: full config with each row)."""

    routine: str = "ab"
    preset: str = "quick"
    model: str = "smollm2-135m"
    threads: Optional[int] = None
    kv_type: str = "q8_0"
    pools: list = dataclasses.field(default_factory=lambda: [512])
    policy: str = "qk"                 # kvflash policy for decode/prefill/ab (the CLI's default)
    policies: list = dataclasses.field(default_factory=lambda: ["lru", "drafter", "qk"])  # needle columns
    drafter: Optional[str] = None
    drafter_layers: Optional[int] = None   # None: the policy's default
    drafter_pool: Optional[int] = None     # None: the policy's default; 0: a full cache
    drafter_queries: Optional[int] = None  # None: the policy's default (16)
    drafter_contrast: Optional[int] = None  # None: the policy's default (32; 0: off)
    drafter_spread: Optional[int] = None    # None: the policy's default (4; 0: off)
    tau: int = 64
    repeats: int = 2
    contexts: list = dataclasses.field(default_factory=lambda: [1024, 2048])
    decode_steps: int = 16
    rescore_periods: int = 4           # ab: the decode window spans this many rescore periods (+1 token)
    control: str = "full"              # ab, decode, prefill: the A/A control's configuration ("full" or "kvflash")
    needles: int = 2
    depths: list = dataclasses.field(default_factory=lambda: [10, 50, 90])
    answer_tokens: int = 12
    memory_prefill: bool = False       # memory: a real prefill per cell instead of driving the pager alone
    memory_cells: list = dataclasses.field(default_factory=lambda: ["full", "ram", "file", "auto"])
    needle_full: bool = True           # needle: include the full-cache mode (off: reuse an earlier run's full rows)
    tail_chunks: Optional[int] = None  # kvflash sessions' tail window in chunks (None: the Session's default)
    split: str = "reporting"           # needle prompts: "tuning" (parameter searches) or "reporting" (figures)
    haystacks: list = dataclasses.field(default_factory=lambda: ["prose", "ledger"])  # reporting haystacks
    asks: list = dataclasses.field(default_factory=lambda: ["chat"])   # needle: chat template and/or raw completion
    clients: int = 8                   # serve: concurrent streaming clients
    parallel: int = 2                  # serve: the server's slots for the concurrent clients
    client_prompt: int = 512           # serve: prompt tokens per concurrent client (each distinct)
    client_tokens: int = 32            # serve: tokens each concurrent client asks for
    load_seconds: int = 90             # load: how long the clients send requests
    attn_kv_types: list = dataclasses.field(default_factory=lambda: ["q8_0"])   # attention: KV types
    attn_threads: list = dataclasses.field(default_factory=lambda: [1, 2])      # attention: thread counts
    ruler_tasks: list = dataclasses.field(default_factory=lambda: ["single", "multikey", "multivalue", "multiquery",
                                                                   "aggregate"])     # ruler: tasks
    ruler_residencies: list = dataclasses.field(default_factory=lambda: [8, 16, 32])  # ruler: pool = context / N
    ruler_aggregate_residencies: list = dataclasses.field(default_factory=lambda: [4, 8])  # ruler: the guard's
    chunk_tokens: Optional[int] = None     # kvflash sessions' chunk (None: the Session's default, 64)
    prefill_piece: Optional[int] = None    # kvflash sessions' prefill piece once the pool is full (None: a chunk)
    ruler_log: Optional[str] = None        # ruler: the trial log that resumes a run (default <out>/trials.jsonl)
    ruler_logged_only: bool = False        # ruler: the table from the log alone, nothing measured
    exact_prompts: int = 16                # exact: prompts per context
    exact_tokens: int = 256                # exact: greedy tokens per prompt
    exact_draft: Optional[int] = None      # exact: drafts per round (None: the session's adaptive choice)
    exact_prefill: bool = False            # kvflash sessions prefill as the full cache does (Session(exact_prefill=True))
    prefill_rescore: int = 0               # qk rescore every N pooled prefill pieces (Session(prefill_rescore=N))
    prefill_reread: bool = False           # the settle re-reads the chosen chunks in place (Session(prefill_reread=True))
    seed: int = 1234
    # where sessions compute: "cpu", or a GPU as Session takes it ("vulkan:0", "cuda:0", "auto"); memory, paging
    # and decode measure the device's pool there (paging: a standalone Pager on the device)
    device: str = "cpu"
    quiet: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- statistics
def summarize(xs: Iterable[float]) -> dict:
    """Median, min, max and count of repeated measurements (never a single run reported as exact)."""
    v = [float(x) for x in xs if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def is_stat(v: Any) -> bool:
    return isinstance(v, dict) and "median" in v and "n" in v


def fmt_num(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    ax = abs(x)
    if ax >= 100:
        return f"{x:.1f}"
    if ax >= 1 or ax == 0:
        return f"{x:.{digits}f}"
    return f"{x:.{digits + 1}g}" if ax >= 1e-3 else f"{x:.2e}"


def fmt_stat(s: dict) -> str:
    """'median ± d' where d is the largest distance from the median to min or max."""
    if s.get("median") is None:
        return "-"
    m = s["median"]
    if s["n"] <= 1:
        return fmt_num(m)
    d = max(s["max"] - m, m - s["min"])
    return f"{fmt_num(m)} ± {fmt_num(d)}"


# ----------------------------------------------------------------------------- progress
class Progress:
    """A progress bar on stderr: rich if installed, else tqdm, else a plain line; silent when quiet."""

    def __init__(self, total: int, desc: str, quiet: bool = False):
        self.total, self.desc, self.quiet, self.n = max(1, total), desc, quiet, 0
        self._rich = self._tqdm = None
        self._t0 = time.perf_counter()
        self._log = not sys.stderr.isatty()  # a log file: one line per finished step, no bars
        if quiet:
            return
        if self._log:
            return
        try:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RP, TextColumn,
                                       TimeElapsedColumn)
            self._rich = RP(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                            console=_rich_console(), transient=False)
            self._rich.start()
            self._task = self._rich.add_task(desc, total=self.total, note="")
            return
        except ImportError:
            pass
        try:
            from tqdm import tqdm
            self._tqdm = tqdm(total=self.total, desc=desc, file=sys.stderr, leave=True, dynamic_ncols=True)
        except ImportError:
            self._line("")

    def _line(self, note: str, end: str = "\r") -> None:
        el = time.perf_counter() - self._t0
        if self._log:
            sys.stderr.write(f"{self.desc}: {self.n}/{self.total} [{el:6.1f}s] {note}\n")
            sys.stderr.flush()
            return
        sys.stderr.write(f"{self.desc}: {self.n}/{self.total} [{el:6.1f}s] {note}\x1b[K{end}")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        if self.quiet or self._log:
            return
        if self._rich is not None:
            self._rich.update(self._task, note=text)
        elif self._tqdm is not None:
            self._tqdm.set_postfix_str(text, refresh=True)
        else:
            self._line(text)

    def prefill_note(self, prefix: str = "", every_s: float = 0.5):
        """A Session.prefill progress hook that shows the prefill (tokens, tok/s, ETA, page-outs) as the
        bar's note, at most every every_s seconds; in a log (stderr not a terminal), a line every 10 s of
        a long prefill."""
        last = [0.0]

        def hook(p):
            if self.quiet or p.finished:
                return
            gap = 10.0 if self._log else every_s
            if p.elapsed_s - last[0] < gap:
                return
            last[0] = p.elapsed_s
            if self._log:
                sys.stderr.write(f"{self.desc}: {prefix}{p.line()}\n")
                sys.stderr.flush()
            else:
                self.note(prefix + p.line())
        return hook

    def advance(self, k: int = 1, note: str = "") -> None:
        self.n += k
        if self.quiet:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=k, note=note)
        elif self._tqdm is not None:
            self._tqdm.update(k)
            if note:
                self._tqdm.set_postfix_str(note, refresh=True)
        else:
            self._line(note)

    def close(self) -> None:
        if self.quiet:
            return
        if self._rich is not None:
            self._rich.stop()
        elif self._tqdm is not None:
            self._tqdm.close()
        else:
            self._line("done", end="\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _rich_console():
    from rich.console import Console
    return Console(file=sys.stderr)


def log(cfg: BenchConfig, msg: str) -> None:
    """A line of narration on stderr (never stdout, which carries only results)."""
    if not cfg.quiet:
        print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        import cpuinfo  # py-cpuinfo, when installed
        brand = cpuinfo.get_cpu_info().get("brand_raw")
        if brand:
            return brand
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import kvflash
    from kvflash.system import available_ram, physical_cores
    from kvflash import _core
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    info = _core.build_info()
    feats = info.get("cpu_features", {})
    return {
        "kvflash_commit": info.get("kvflash_commit"),
        "kvflash_dirty": info.get("kvflash_dirty"),   # the tree it was built from had uncommitted changes
        # the flags that choose ggml's kernels: -march=native, the instruction sets ggml-cpu was built for,
        # the extra weight buffers this CPU offers, and whether KVFLASH_NO_REPACK kept every weight mapped
        # (weight_placement, filled in as models are opened, says what each model's weights ran)
        "build": {"native": info.get("native"), "build_type": info.get("build_type"),
                  "compiler": info.get("compiler"),
                  "cpu_features": sorted(k for k, v in feats.items() if v not in ("0", "", None)),
                  "cpu_extra_buffer_types": info.get("cpu_extra_buffer_types"), "repack": info.get("repack")},
        "weight_placement": WEIGHT_PLACEMENT,
        "cpu": cpu_model(),
        "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(),
        "ram_total_gib": None if mem_total is None else round(mem_total / 2**30, 1),
        "ram_available_gib": round(available_ram() / 2**30, 1),
        "backend": getattr(_core, "backend", "CPU"),   # the routines' device replaces it (cli.main)
        "devices": info.get("devices"),                 # what ggml sees in this build (GPU backends' devices, the CPU)
        "ggml_version": kvflash.ggml_version,
        "ggml_commit": kvflash.ggml_commit,
        "kvflash_version": kvflash.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "os": platform.platform(),
        "loadavg_at_start": None if load is None else [round(x, 2) for x in load],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ----------------------------------------------------------------------------- sessions
# model file name -> its weight_placement, for every model a routine opened (machine.json records it)
WEIGHT_PLACEMENT: dict = {}


class Unavailable(Exception):
    """A cell that cannot be measured in this build (reported as n/a with the reason)."""


def model_label(model: str) -> str:
    return Path(model).stem if os.sep in model or model.endswith(".gguf") else model


_QK_KEYS = {"q": "n_queries", "c": "contrast", "s": "spread", "k": "carry", "w": "windows"}
_DRAFTER_KEYS = {"q": "n_queries", "c": "contrast", "s": "spread"}


def _variant_kw(name: str, keys: dict) -> dict:
    """``base:q16:c64`` -> {"n_queries": 16, "contrast": 64} over `keys` (letter -> keyword); KeyError,
    ValueError or IndexError for a part that does not parse."""
    kw = {}
    for part in name.split(":")[1:]:
        kw[keys[part[0]]] = int(part[1:])
    return kw


def qk_variant(name: str, check: bool = False):
    """A qk policy with its own settings, named ``qk:q16:c64:s4:k16:w3`` (any of q = n_queries, c = contrast,
    s = spread, k = carry, w = windows; the rest at qk's defaults), for comparing settings in one run on one prefill.
    check=True: True when the name parses, False otherwise."""
    from kvflash.scoring import QKPolicy
    try:
        pol = QKPolicy(**_variant_kw(name, _QK_KEYS))
    except (KeyError, ValueError, IndexError):
        if check:
            return False
        raise ValueError(f"qk variant {name!r}: use qk:q16:c64:s4:k16:w3 (q n_queries, c contrast, s spread, "
                         f"k carry, w windows; integers)") from None
    if check:
        return True
    pol.name = name
    return pol


def drafter_variant_kw(name: str, check: bool = False):
    """The DrafterPolicy keywords of a drafter setting named ``drafter:q16:c64:s4`` (any of q = n_queries,
    c = contrast, s = spread; the rest from the --drafter-* options or the policy's defaults), for comparing
    drafter settings in one run on one prefill.  check=True: True when the name parses, False otherwise."""
    try:
        kw = _variant_kw(name, _DRAFTER_KEYS)
        if any(v < (1 if k == "n_queries" else 0) for k, v in kw.items()):
            raise ValueError
    except (KeyError, ValueError, IndexError):
        if check:
            return False
        raise ValueError(f"drafter variant {name!r}: use drafter:q16:c64:s4 (q n_queries, c contrast, s spread; "
                         f"integers)") from None
    return True if check else kw


def policy_variant_ok(name: str) -> bool:
    """A ``qk:...`` or ``drafter:...`` setting name that parses."""
    return (name.startswith("qk:") and qk_variant(name, check=True)) or \
        (name.startswith("drafter:") and drafter_variant_kw(name, check=True))



def open_session(cfg: BenchConfig, *, max_ctx: int, pool: Optional[int], policy: str = "lru", **session_kw):
    """A Session for one mode: pool=None is the full cache.  Raises Unavailable with the reason
    for policies this build lacks; a drafter that falls back to LRU is returned with .fallback set.
    session_kw: more Session keywords (host=, host_path=)."""
    import kvflash
    from kvflash.models import resolve_model
    kw = dict(model=cfg.model, max_ctx=max_ctx, kvflash=pool, kv_type=cfg.kv_type, threads=cfg.threads,
              tau=cfg.tau, seed=cfg.seed, verbose=False, **session_kw)
    if cfg.device != "cpu":
        kw["device"] = cfg.device
    n_train = _n_ctx_train(cfg)
    if max_ctx > n_train:
        kw["allow_long_ctx"] = True
    if pool is None:
        kw["policy"] = "lru"
    else:
        kw["policy"] = qk_variant(policy) if isinstance(policy, str) and policy.startswith("qk:") else policy
        if cfg.tail_chunks is not None:
            kw["tail_window_chunks"] = cfg.tail_chunks
        if cfg.chunk_tokens is not None:
            kw["chunk_tokens"] = cfg.chunk_tokens
        if cfg.prefill_piece is not None:
            kw["prefill_piece"] = cfg.prefill_piece
        if cfg.exact_prefill:
            kw.setdefault("exact_prefill", True)    # (a routine comparing with and without passes it)
        if cfg.prefill_rescore:
            kw["prefill_rescore"] = cfg.prefill_rescore
        if cfg.prefill_reread:
            kw.setdefault("prefill_reread", True)   # (a routine comparing with and without passes it)
        if policy == "drafter" and cfg.drafter:
            kw["drafter"] = cfg.drafter
            pairs = (("layers", cfg.drafter_layers), ("pool", cfg.drafter_pool),
                     ("n_queries", cfg.drafter_queries), ("contrast", cfg.drafter_contrast),
                     ("spread", cfg.drafter_spread))
            opts = {k: v for k, v in pairs if v is not None}
            if opts:
                from kvflash.scoring import DrafterPolicy
                kw["policy"] = DrafterPolicy(resolve_model(cfg.drafter), threads=cfg.threads, **opts)
    try:
        s = kvflash.Session(**kw)
    except ValueError as e:
        msg = str(e)
        if "not available" in msg or "unknown policy" in msg:
            raise Unavailable(msg) from None
        raise
    s.bench_fallback = pool is not None and isinstance(policy, str) and policy != s.policy.name
    WEIGHT_PLACEMENT[s.model_path.name] = list(s.runtime.model.weight_placement)
    return s


_N_TRAIN: dict = {}


def _n_ctx_train(cfg: BenchConfig) -> int:
    if cfg.model not in _N_TRAIN:
        import kvflash
        from kvflash.models import resolve_model
        m = kvflash.Model(str(resolve_model(cfg.model)), 1)
        _N_TRAIN[cfg.model] = int(m.hparams["n_ctx_train"])
    return _N_TRAIN[cfg.model]


def mode_label(pool: Optional[int], policy: Optional[str] = None) -> str:
    return "full" if pool is None else f"kvflash-{policy}" if policy else "kvflash"


def haystack_text() -> str:
    return (HERE / "haystack.txt").read_text(encoding="utf-8")


_TEXT_TOKENS: dict = {}


def text_tokens(session, n: int) -> np.ndarray:
    """n token ids of natural text (the haystack, wrapped around when longer)."""
    key = str(session.model_path)
    toks = _TEXT_TOKENS.get(key)
    if toks is None:
        toks = np.asarray(session.tokenize(haystack_text(), add_special=False), dtype=np.int32)
        _TEXT_TOKENS[key] = toks
    reps = -(-n // len(toks))
    return np.tile(toks, reps)[:n] if reps > 1 else toks[:n].copy()


def decode_steps(session, n: int) -> tuple[float, float]:
    """Decode n tokens greedily through the public generate() (so a scored policy's rescoring is
    paid for, as a user would pay it); returns (wall seconds, native compute ms)."""
    c0 = session.runtime.timings["compute_ms"]
    t0 = time.perf_counter()
    for _ in session.generate(None, max_tokens=n, temperature=0.0, ignore_eos=True):
        pass
    dt = time.perf_counter() - t0
    return dt, session.runtime.timings["compute_ms"] - c0


def token_hash(ids) -> str:
    """sha256 of token ids as little-endian int32 (the first 16 hex digits): kept beside an identity a routine
    claims (exact mode, snapshots), so the claim can be checked again from the result alone."""
    import hashlib
    return hashlib.sha256(np.asarray(list(ids), dtype="<i4").tobytes()).hexdigest()[:16]


def kv_resident_bytes(session) -> int:
    return int(session.runtime.pool_bytes + session.runtime.swa_bytes)


def ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)
