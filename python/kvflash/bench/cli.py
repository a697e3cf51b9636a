"""`python -m kvflash.bench ROUTINE [options]` (also `kvflash bench ...`): argument parsing and presets."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional

from .common import BenchConfig, log, machine_info

ROUTINE_NAMES = ["demo", "ab", "attention", "decode", "memory", "paging", "prefill", "needle", "rescore", "snapshot", "serve",
                 "ruler", "exact", "load", "chat"]
# `all` leaves out ruler (its matrix takes hours: run it by name, in parts: it resumes from its trial log),
# exact (full-cache prefills of 8K-32K per context: run it by name) and load (a fixed time of traffic: by name)
ALL_ORDER = ["memory", "paging", "attention", "decode", "prefill", "needle", "rescore", "snapshot", "serve", "ab"]

# Per preset: "*" applies to every routine, then the routine's own entry.  Explicit options override both.
PRESETS = {
    # < 5 minutes on 2 cores from a fresh install (model download included) for `ab`.
    "quick": {
        "*": dict(pools=[512], repeats=2, decode_steps=16, needles=2, depths=[10, 90], contexts=[1024, 2048],
                  policy="qk"),  # no drafter needed: the fresh-install run shows a scored policy
        "decode": dict(contexts=[512, 1024, 2048]),
        "memory": dict(contexts=[1024, 2048, 8192, 32768]),
        "paging": dict(repeats=2),
        "needle": dict(),
        "rescore": dict(contexts=[2048], repeats=1, policies=["qk", "drafter"]),
        "ab": dict(contexts=[1024], needles=5),  # ≥ 5 interleaved trials, 3 modes: ~4 min here
        # the README's main command: one 4K prompt, 5 interleaved decode rounds per mode (needle early, out of the
        # pool's tail window)
        "demo": dict(contexts=[4096], repeats=5, depths=[10], haystacks=["prose"]),
        "snapshot": dict(contexts=[1024, 2048]),
        "serve": dict(contexts=[1024], decode_steps=64, clients=4, client_prompt=256, client_tokens=16),
        # ~2 min: 4 clients for 90 s on 2 slots with a 512-token pool, good and bad requests mixed
        "load": dict(contexts=[2048], pools=[512], policy="lru", clients=4, parallel=2, client_prompt=128,
                     client_tokens=16, load_seconds=90),
        "attention": dict(pools=[512, 2048], repeats=5),
        "ruler": dict(contexts=[1024], needles=1, haystacks=["filler"], ruler_residencies=[4], chunk_tokens=16,
                      ruler_aggregate_residencies=[4], policies=["lru", "qk"], split="tuning"),
        "exact": dict(contexts=[2048], exact_prompts=3, exact_tokens=32),
        "chat": dict(contexts=[2048], repeats=3),
    },
    # The committed results (bench/results/): the figures of the model-runtime issue.
    "standard": {
        "*": dict(pools=[2048], repeats=3, decode_steps=32, needles=16, depths=[10, 50, 90]),
        "decode": dict(contexts=[1024, 2048, 4096, 8192, 16384, 32768], repeats=5, control="kvflash"),
        "prefill": dict(contexts=[2048, 8192, 16384], repeats=5, control="kvflash"),
        "memory": dict(contexts=[2048, 8192, 16384, 32768, 65536, 131072], pools=[512, 2048]),
        "paging": dict(pools=[512, 2048], repeats=5),
        "needle": dict(contexts=[4096, 8192], pools=[1024, 2048], needles=16),
        "rescore": dict(contexts=[8192], pools=[768], repeats=2, policies=["qk", "drafter"]),
        # ~75 min on 2 cores: each full-cache trial at 32K prefills 32K tokens (~20 min).
        "ab": dict(contexts=[2048, 8192, 16384, 32768], needles=5, control="kvflash"),
        # ~30 min on 2 cores: five pooled prefills of 32K (~4 min each)
        "snapshot": dict(contexts=[8192, 32768], repeats=5),
        "attention": dict(pools=[512, 1024, 2048, 4096, 8192], repeats=9, attn_kv_types=["q8_0", "q4_0", "f16"]),
        "serve": dict(contexts=[4096], repeats=5, decode_steps=128, clients=8, parallel=2, client_prompt=512,
                      client_tokens=32),
        "load": dict(contexts=[4096], pools=[1024], policy="lru", clients=8, parallel=2, client_prompt=512,
                     client_tokens=32, load_seconds=600),
        # issue 18's matrix: hours on 2 cores, so run it per context (it resumes from <out>/trials.jsonl)
        "ruler": dict(model="gemma3-270m", contexts=[4096, 8192, 16384], needles=8, haystacks=["filler", "ledger"],
                      policies=["lru", "qk", "drafter"]),
        # issue 19's figures: pool 2K, 16 prompts x 256 tokens per context (SmolLM2 also 16K, Gemma-3 32K)
        "exact": dict(contexts=[8192, 32768], pools=[2048], policy="qk", exact_prompts=16, exact_tokens=256),
        "chat": dict(contexts=[4096, 16384], repeats=5, policy="lru"),
    },
    # Long contexts: for machines with time to spare (hours on 2 cores).
    "long": {
        "*": dict(pools=[2048], repeats=3, decode_steps=32, needles=16, depths=[10, 50, 90]),
        "decode": dict(contexts=[2048, 8192, 32768, 65536, 131072], pools=[2048, 4096], control="kvflash"),
        "prefill": dict(contexts=[16384, 32768, 65536], repeats=5, control="kvflash"),
        "memory": dict(contexts=[8192, 32768, 131072, 262144], pools=[2048, 4096]),
        "paging": dict(pools=[2048, 4096], repeats=5),
        "needle": dict(contexts=[8192, 16384, 32768], pools=[2048, 4096], needles=16),
        "rescore": dict(contexts=[8192, 32768], pools=[2048], repeats=2, policies=["qk", "drafter"]),
        "ab": dict(contexts=[32768, 65536, 131072], needles=8, control="kvflash"),
        "snapshot": dict(contexts=[32768, 131072], repeats=5),
        "attention": dict(pools=[2048, 8192, 16384, 32768], repeats=9, attn_kv_types=["q8_0", "q4_0", "f16"]),
        "serve": dict(contexts=[16384], repeats=5, decode_steps=128, clients=16, parallel=4, client_prompt=2048,
                      client_tokens=64),
    },
}


def _int_list(s: str) -> list:
    out = []
    for part in s.replace(" ", "").split(","):
        if not part:
            continue
        mult = 1
        if part[-1] in "kK":
            mult, part = 1024, part[:-1]
        try:
            v = int(float(part) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers (1024 or 1K), got {s!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"values must be positive, got {v}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def _str_list(s: str) -> list:
    return [x for x in s.replace(" ", "").split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvflash.bench",
        description="kvflash bench: full cache vs the paged KV pool, measured in one run. Results go to stdout "
                    "(markdown by default), progress to stderr.",
        epilog="main job: python -m kvflash.bench ab --preset quick    "
               "committed results: python -m kvflash.bench all --preset standard --out bench/results --plot")
    p.add_argument("routine", nargs="?", default="ab", choices=ROUTINE_NAMES + ["all", "plot"],
                   help="what to measure (default ab); 'all' runs every routine; "
                        "'plot' redraws PNGs from a results.json given with --from")
    p.add_argument("--preset", choices=list(PRESETS), default="quick",
                   help="sizes for contexts, repeats and trials (default quick)")
    p.add_argument("--model", "-m", default=None,
                   help="model name or GGUF path (default smollm2-135m; ruler --preset standard: gemma3-270m)")
    p.add_argument("--threads", "-t", type=int, help="compute threads (default: physical cores)")
    p.add_argument("--device", default=None,
                   help="where sessions compute: cpu (default), vulkan[:N], cuda[:N] or auto, as Session(device=...) "
                        "takes it (memory, paging and decode measure the device's pool; lavapipe needs "
                        "GGML_VK_VISIBLE_DEVICES=0)")
    p.add_argument("--kv-type", choices=["f16", "q8_0", "q4_0"], default="q8_0", help="KV cache type (default q8_0)")
    p.add_argument("--pool", type=_int_list, help="kvflash pool size(s) in tokens, comma list (e.g. 512,2048)")
    p.add_argument("--policy", default=None,
                   help="kvflash policy for decode/prefill/ab (default: qk, as the CLI's): drafter (--drafter, "
                        "else one found beside the model, else qk), lru, qk (exact keys), qk-bound, qk-mean (key "
                        "summaries)")
    p.add_argument("--policies", type=_str_list, default=None,
                   help="policies compared (needle routine default lru,drafter,qk); qk:q16:c64:s4:k16:w3 is qk with its "
                        "own settings, drafter:q16:c64:s4 the drafter with its own (ruler routine), each on the "
                        "same prefill")
    p.add_argument("--drafter", help="drafter GGUF (name or path) for the drafter policy")
    p.add_argument("--drafter-layers", type=int, default=None,
                   help="evaluate only the drafter's first N layers (default: the policy's, a quarter of them)")
    p.add_argument("--drafter-pool", type=int, default=None,
                   help="the drafter's own resident pool in tokens, 0 for a full cache (default: the policy's, 1024)")
    p.add_argument("--drafter-queries", type=int, default=None,
                   help="tail tokens whose queries score the history (default: the policy's, 16)")
    p.add_argument("--drafter-contrast", type=int, default=None,
                   help="subtract the scores of the queries N drafter tokens earlier (default: the policy's, 32; "
                        "0: off)")
    p.add_argument("--drafter-spread", type=int, default=None,
                   help="give each drafter token the peak score of the N tokens either side before the chunk "
                        "aggregation (default: the policy's, 4; 0: off)")
    p.add_argument("--tau", type=int, default=64, help="decoded tokens between rescores (default 64)")
    p.add_argument("--repeats", "-r", type=int, help="repeats per measurement (medians with min/max)")
    p.add_argument("--contexts", "-c", type=_int_list, help="context lengths, comma list (1024 or 1K)")
    p.add_argument("--steps", type=int, dest="decode_steps", help="decode steps timed per repeat")
    p.add_argument("--needles", type=int, help="needle trials per cell (ab: the repeats, one trial each)")
    p.add_argument("--split", choices=["reporting", "tuning", "tuning-indirect"], default=None,
                   help="needle prompts (needle, ab): reporting (default; held-out wordings and seeds, every "
                        "committed figure), tuning or tuning-indirect (the prompts policy parameters are chosen on)")
    p.add_argument("--haystacks", type=_str_list, default=None,
                   help="haystacks, comma list: prose, ledger (needle, ab, demo; default both; ab and demo use the "
                        "first) or filler, ledger (ruler), and for all of them the corpus genres code, chat, csv, "
                        "wiki, manual, fiction, syslog, legal, email, config ('corpus': all ten), which have "
                        "tuning documents too (--split tuning)")
    p.add_argument("--ask", dest="asks", type=_str_list, default=None,
                   help="needle: how the question is put, comma list of chat (the chat template; the default) and "
                        "raw (a raw completion: the corpus genres continue the document in its own form)")
    p.add_argument("--prefill", dest="memory_prefill", action="store_true", default=None,
                   help="memory: a real prefill of each cell's context (weights and compute buffers in the RSS) "
                        "instead of driving the pager alone")
    p.add_argument("--cells", dest="memory_cells", type=_str_list, default=None,
                   help="memory: which cells, comma list of full, ram, file, auto (default all)")
    p.add_argument("--rescore-periods", type=int, default=None,
                   help="ab: decode window in rescore periods of a scored policy (default 4; the window is "
                        "max(--steps, N x period + 1) tokens for every mode)")
    p.add_argument("--control", choices=["full", "kvflash"], default=None,
                   help="ab, decode, prefill: the A/A control row's configuration (default: full in quick, kvflash in "
                        "standard and long, where a second full cache at 32K+ would double the run)")
    p.add_argument("--no-full", dest="needle_full", action="store_false", default=None,
                   help="needle: leave out the full-cache mode (its answers depend only on the prompts: an earlier "
                        "run with the same --split, --seed, contexts and trials has them)")
    p.add_argument("--tail-chunks", type=int, default=None,
                   help="kvflash sessions' tail window in chunks, always resident (default: the Session's, 4)")
    p.add_argument("--clients", type=int, default=None,
                   help="serve, load: concurrent clients (default 8 in standard)")
    p.add_argument("--parallel", type=int, default=None, help="serve, load: the server's slots for them (default 2)")
    p.add_argument("--client-prompt", type=int, default=None,
                   help="serve, load: prompt tokens per concurrent client, each prompt distinct (default 512 in standard)")
    p.add_argument("--client-tokens", type=int, default=None,
                   help="serve, load: tokens each concurrent client asks for (default 32 in standard)")
    p.add_argument("--seconds", type=int, dest="load_seconds", default=None,
                   help="load: how long the clients send requests (default 90 in quick)")
    p.add_argument("--kv-types", type=_str_list, default=None,
                   help="attention: KV types compared, comma list of f16, q8_0, q4_0 (default q8_0; standard all three)")
    p.add_argument("--thread-counts", type=_int_list, default=None,
                   help="attention: thread counts, comma list (default 1,2)")
    p.add_argument("--tasks", type=_str_list, default=None,
                   help="ruler: tasks, comma list of single, multikey, multivalue, multiquery, aggregate (the default "
                        "five) and RULER's vt (variable tracking), cwe (common words), fwe (frequent words)")
    p.add_argument("--residencies", type=_int_list, default=None,
                   help="ruler: pools of context/N for the needle tasks, comma list of N (default 8,16,32)")
    p.add_argument("--aggregate-residencies", type=_int_list, default=None,
                   help="ruler: the same for the list tasks: the aggregation guard, cwe, fwe (default 4,8)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="kvflash sessions' chunk in tokens, dividing 256 (default: the Session's, 64)")
    p.add_argument("--prefill-piece", type=int, default=None,
                   help="kvflash sessions: tokens a pooled prefill evaluates at a time once the pool is full, a "
                        "multiple of the chunk (default: one chunk)")
    p.add_argument("--logged-only", dest="ruler_logged_only", action="store_true", default=None,
                   help="ruler: build the table from the trials already in the log; measure nothing")
    p.add_argument("--log", dest="ruler_log", default=None,
                   help="ruler: the trial log; trials already in it are not run again (default <out>/trials.jsonl)")
    p.add_argument("--prompts", dest="exact_prompts", type=int, default=None,
                   help="exact: prompts per context (default 16 with --preset standard)")
    p.add_argument("--gen-tokens", dest="exact_tokens", type=int, default=None,
                   help="exact: greedy tokens per prompt (default 256 with --preset standard)")
    p.add_argument("--exact-draft", dest="exact_draft", type=int, default=None,
                   help="exact: drafts per round (default: adaptive)")
    p.add_argument("--exact-prefill", dest="exact_prefill", action="store_true", default=None,
                   help="kvflash sessions prefill as the full cache does (every chunk's K/V exact; decode over the pool)")
    p.add_argument("--prefill-rescore", dest="prefill_rescore", type=int, default=None,
                   help="kvflash sessions with a qk policy rescore every N pooled prefill pieces, so later pieces "
                        "attend the chunks the latest piece ranks highest (Session(prefill_rescore=N); 0: off)")
    p.add_argument("--prefill-reread", dest="prefill_reread", action="store_true", default=None,
                   help="kvflash sessions with a scoring policy read the chosen chunks their pooled prefill wrote again "
                        "in place with exact attention at the settle (Session(prefill_reread=True))")
    p.add_argument("--depths", type=_int_list, help="needle depths in percent, comma list (default 10,50,90)")
    p.add_argument("--seed", type=int, default=1234, help="seed for prompts and sampling (default 1234)")
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md", help="stdout format (default md)")
    p.add_argument("--out", type=Path, help="also write table.md, results.json, rows.csv, raw.csv, config.json "
                                            "and machine.json (and the PNGs with --plot) into this folder")
    p.add_argument("--plot", action="store_true", help="write PNG plots (needs matplotlib) to --out or ./bench-plots")
    p.add_argument("--from", dest="from_", type=Path, help="with 'plot': a results.json (or its folder)")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (implied by -o json)")
    return p


def config_for(args, routine: str) -> BenchConfig:
    cfg = BenchConfig(routine=routine, preset=args.preset)
    preset = PRESETS[args.preset]
    for src in (preset.get("*", {}), preset.get(routine, {})):
        for k, v in src.items():
            setattr(cfg, k, copy.deepcopy(v))
    if args.model is not None:
        cfg.model = args.model
    cfg.threads = args.threads
    cfg.kv_type = args.kv_type
    if args.policy is not None:
        cfg.policy = args.policy
    if args.policies is not None:
        cfg.policies = args.policies
    cfg.drafter = args.drafter
    cfg.drafter_layers = args.drafter_layers
    cfg.drafter_pool = args.drafter_pool
    cfg.drafter_queries = args.drafter_queries
    cfg.drafter_contrast = args.drafter_contrast
    cfg.drafter_spread = args.drafter_spread
    cfg.tau = args.tau
    cfg.seed = args.seed
    if args.device is not None:
        cfg.device = args.device
    for k, attr in [("pool", "pools"), ("repeats", "repeats"), ("contexts", "contexts"),
                    ("decode_steps", "decode_steps"), ("needles", "needles"), ("depths", "depths"),
                    ("rescore_periods", "rescore_periods"), ("control", "control"), ("split", "split"),
                    ("haystacks", "haystacks"), ("asks", "asks"), ("memory_prefill", "memory_prefill"),
                    ("memory_cells", "memory_cells"), ("needle_full", "needle_full"),
                    ("tail_chunks", "tail_chunks"), ("clients", "clients"), ("parallel", "parallel"),
                    ("client_prompt", "client_prompt"), ("client_tokens", "client_tokens"),
                    ("kv_types", "attn_kv_types"), ("thread_counts", "attn_threads"), ("tasks", "ruler_tasks"),
                    ("residencies", "ruler_residencies"), ("aggregate_residencies", "ruler_aggregate_residencies"),
                    ("chunk_tokens", "chunk_tokens"), ("prefill_piece", "prefill_piece"), ("ruler_log", "ruler_log"),
                    ("ruler_logged_only", "ruler_logged_only"), ("exact_prompts", "exact_prompts"),
                    ("exact_tokens", "exact_tokens"), ("exact_draft", "exact_draft"),
                    ("exact_prefill", "exact_prefill"), ("prefill_rescore", "prefill_rescore"),
                    ("prefill_reread", "prefill_reread"),
                    ("load_seconds", "load_seconds")]:
        v = getattr(args, k)
        if v is not None:
            setattr(cfg, attr, v)
    cfg.quiet = args.quiet or args.output == "json"
    return cfg


def _validate(p: argparse.ArgumentParser, args) -> None:
    if args.device is not None:
        from kvflash.devices import resolve_device
        try:
            args.device = resolve_device(args.device)
        except ValueError as e:
            p.error(f"--device: {e}")
    for k in ("threads", "repeats", "decode_steps", "needles", "tau", "rescore_periods", "clients", "parallel",
              "client_prompt", "client_tokens", "exact_prompts", "exact_tokens", "load_seconds"):
        v = getattr(args, k)
        if v is not None and v < 1:
            flag = {"exact_prompts": "prompts", "exact_tokens": "gen-tokens", "load_seconds": "seconds"}.get(
                k, k.replace("_", "-"))
            p.error(f"--{flag} must be >= 1, got {v}")
    bad_c = [c for c in (args.memory_cells or []) if c not in ("full", "ram", "file", "auto")]
    if bad_c or (args.memory_cells is not None and not args.memory_cells):
        p.error(f"--cells: use full, ram, file, auto (got {args.memory_cells})")
    bad_t = [t for t in (args.kv_types or []) if t not in ("f16", "q8_0", "q4_0")]
    if bad_t or (args.kv_types is not None and not args.kv_types):
        p.error(f"--kv-types: use f16, q8_0, q4_0 (got {args.kv_types})")
    from .corpus import GENRES
    if args.haystacks and "corpus" in args.haystacks:   # every genre, in place of the word
        at = args.haystacks.index("corpus")
        args.haystacks = list(dict.fromkeys(args.haystacks[:at] + list(GENRES) + args.haystacks[at + 1:]))
    hay_ok = (("filler", "ledger") if args.routine == "ruler" else ("prose", "ledger")) + GENRES
    bad_h = [h for h in (args.haystacks or []) if h not in hay_ok]
    if bad_h or (args.haystacks is not None and not args.haystacks):
        p.error(f"--haystacks: use {', '.join(hay_ok)} or corpus (got {args.haystacks})")
    if args.split == "tuning-indirect" and any(h in GENRES for h in args.haystacks or []):
        p.error("--split tuning-indirect is the prose haystack's; the corpus genres have tuning and reporting")
    bad_a = [a for a in (args.asks or []) if a not in ("chat", "raw")]
    if bad_a or (args.asks is not None and not args.asks):
        p.error(f"--ask: use chat, raw (got {args.asks})")
    from .ruler import TASKS
    bad_k = [t for t in (args.tasks or []) if t not in TASKS]
    if bad_k or (args.tasks is not None and not args.tasks):
        p.error(f"--tasks: use {', '.join(TASKS)} (got {args.tasks})")
    if args.chunk_tokens is not None and (args.chunk_tokens < 1 or (256 % args.chunk_tokens and args.chunk_tokens % 256)):
        p.error(f"--chunk-tokens must divide 256 or be a multiple of it, got {args.chunk_tokens}")
    if args.routine == "ruler" and args.split == "tuning-indirect":
        p.error("ruler: --split is tuning or reporting")
    if args.ruler_logged_only and not (args.ruler_log or args.out):
        p.error("--logged-only needs the log: --log FILE or --out DIR (its trials.jsonl)")
    if args.exact_draft is not None and not 0 <= args.exact_draft <= 16:
        p.error(f"--exact-draft must be in [0, 16], got {args.exact_draft}")
    if args.depths and any(d > 100 for d in args.depths):
        p.error("--depths are percentages in 1..100")
    known = ("lru", "drafter", "qk", "qk-bound", "qk-mean")
    from .common import policy_variant_ok, qk_variant
    bad = [x for x in (args.policies or []) if x not in known and not policy_variant_ok(x)]
    if bad:
        p.error(f"--policies: unknown {bad}; use {', '.join(known)} (or qk:q16:c64:s4:k16:w3, qk with its "
                f"n_queries, contrast, spread, carry, windows; drafter:q16:c64:s4 in the ruler routine)")
    if any(x.startswith("drafter:") for x in args.policies or []) and args.routine != "ruler":
        p.error("--policies: drafter:... settings are compared by the ruler routine only")
    if args.policy is not None and args.policy not in known and not (args.policy.startswith("qk:")
                                                                     and qk_variant(args.policy, check=True)):
        p.error(f"--policy must be one of {', '.join(known)}, got {args.policy!r}")


def main(argv: Optional[list] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _validate(p, args)
    from . import report

    if args.routine == "plot":
        src = args.from_ or Path("bench/results")
        if src.is_dir():
            src = src / "results.json"
        if not src.is_file():
            p.error(f"plot: no results.json at {src}")
        results, config, machine = report.load_results(src)
        return _plot(results, args.out or src.parent, machine)

    from .routines import ROUTINES
    names = ALL_ORDER if args.routine == "all" else [args.routine]
    cfgs = [config_for(args, n) for n in names]
    for c in cfgs:
        if c.routine == "ruler" and c.ruler_log is None and args.out:
            c.ruler_log = str(args.out / "trials.jsonl")
    quiet = cfgs[0].quiet
    t0 = time.perf_counter()
    machine = machine_info()
    if cfgs[0].device != "cpu":   # where the sessions computed: "vulkan:0 (llvmpipe (LLVM 15.0.6, 256 bits))"
        kind, _, idx = cfgs[0].device.partition(":")
        name = ("CUDA" if kind == "cuda" else "Vulkan") + (idx or "0")
        desc = next((d["description"] for d in machine.get("devices") or [] if d.get("name") == name), None)
        machine["backend"] = cfgs[0].device + (f" ({desc})" if desc else "")
    results = []
    try:
        for cfg in cfgs:
            log(cfg, f"[bench] {cfg.routine}: preset {cfg.preset}, model {cfg.model}, pools {cfg.pools}, "
                     f"contexts {cfg.contexts}, repeats {cfg.repeats}")
            t1 = time.perf_counter()
            results.append(ROUTINES[cfg.routine](cfg))
            log(cfg, f"[bench] {cfg.routine} took {time.perf_counter() - t1:.1f}s")
    except KeyboardInterrupt:
        print("[bench] interrupted: printing what was measured", file=sys.stderr)
        if not results:
            return 130
    except Exception as e:  # a clear one-line reason, not a traceback, for expected failures
        if isinstance(e, (ValueError, FileNotFoundError, RuntimeError)) and not args.debug:
            print(f"[bench] error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise
    elapsed = time.perf_counter() - t0
    threads_used = None
    for r in results:
        for row in r.rows:
            if row.get("threads"):
                threads_used = row["threads"]
                break
    config = {"argv": list(sys.argv[1:] if argv is None else argv), "routine": args.routine,
              "preset": args.preset, "threads_used": threads_used, "elapsed_s": round(elapsed, 1),
              "routines": {c.routine: {k: v for k, v in dataclasses.asdict(c).items() if k != "quiet"} for c in cfgs}}
    first = dataclasses.asdict(cfgs[0])
    for k in ("model", "threads", "kv_type", "policy", "split", "haystacks", "asks", "drafter", "drafter_layers", "drafter_pool", "drafter_queries",
              "drafter_contrast", "drafter_spread", "tau", "seed"):
        config[k] = first[k]
    sys.stdout.write(report.render(args.output, results, config, machine))
    sys.stdout.flush()
    if args.out:
        files = report.write_out(args.out, results, config, machine)
        if not quiet:
            print(f"[bench] wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    rc = 0
    if args.plot:
        rc = _plot(results, args.out or Path("bench-plots"), machine, quiet=quiet)
    if not quiet:
        print(f"[bench] total {elapsed:.1f}s", file=sys.stderr)
    return rc


def _plot(results, folder: Path, machine: dict, quiet: bool = False) -> int:
    from .plots import PlotUnavailable, plot_all
    try:
        files = plot_all(results, folder, title_suffix=f" ({machine.get('cpu', '')}, ggml {machine.get('ggml_version', '')})")
    except PlotUnavailable as e:
        print(f"[bench] {e}", file=sys.stderr)
        return 3
    if not quiet:
        print(f"[bench] plots: {', '.join(str(f) for f in files) or 'none (no plottable routine)'}", file=sys.stderr)
    return 0
