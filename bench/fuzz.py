#!/usr/bin/env python
"""Coverage-guided fuzzing (libFuzzer, clang, ASan/UBSan) of what kvflash reads from files it is given.

  --target gguf      the GGUF loader and the C API (bench/fuzz/fuzz_gguf.cpp), seeded with the 80 files of
                     tests/gguf_corpus.py (one valid model and its corrupt variants)
  --target snapshot  snapshot files read, checked and applied against tiny runtimes
                     (bench/fuzz/fuzz_snapshot.cpp over tests/snapshot_models.py's models), seeded with
                     snapshots the target writes of each runtime at a few states
  --target session   the session's JSON inside a snapshot, checked against a header, and the JSON parser's
                     round trip (bench/fuzz/fuzz_session.cpp), seeded with a document of each policy form

Builds bench/fuzz (every core source, cmake/sources.cmake, instrumented for coverage and ASan/UBSan), runs
the target for --runs executions or --max-time seconds, and records what libFuzzer reports: executions,
their rate, coverage, corpus, and every finding (crash-, leak-, timeout-, oom- files) with the sanitizer's
report.  The committed regression inputs (bench/fuzz/regressions/TARGET/: earlier findings) are a corpus
directory of every run, so each run first replays them; --keep-findings adds a run's findings there.

Needs clang with libFuzzer (Debian: apt-get install clang).  The ggml source is the one the main build
uses (-DKVFLASH_GGML_SOURCE, or the pinned download).  Only the standard library: CI runs it with a
bare Python.

Usage: python bench/fuzz.py --target gguf|snapshot|session [--runs N | --max-time S] [--seed 1] [--build build-fuzz]
                            [--out DIR] [--keep-findings]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("gguf", "snapshot", "session")


def build(build_dir: str, ggml_source: str | None) -> None:
    cc, cxx = shutil.which("clang"), shutil.which("clang++")
    if not cc or not cxx:
        sys.exit("clang not found: the fuzz targets need clang and libFuzzer (Debian: apt-get install clang)")
    cfg = ["cmake", "-S", os.path.join(ROOT, "bench", "fuzz"), "-B", build_dir, "-G", "Ninja",
           f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}", "-DCMAKE_BUILD_TYPE=Release"]
    if ggml_source:
        cfg.append(f"-DKVFLASH_GGML_SOURCE={ggml_source}")
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir], check=True)


def git_facts() -> dict:
    """kvflash's commit, and whether the tree differs from it outside bench/results/ (results written by
    runs, this one's included, are not the code under test; they are listed apart)."""
    def git(*a):
        r = subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True)
        return r.stdout.rstrip("\n") if r.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=all")
    if status is None:
        return {"commit": git("rev-parse", "HEAD"), "dirty": None}
    paths = [line[3:] for line in status.splitlines() if line]
    results = [p for p in paths if p.startswith("bench/results/")]
    return {"commit": git("rev-parse", "HEAD"), "dirty": len(paths) > len(results), "changed_results": results}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def seed(target: str, exe: str, work: str, env: dict) -> tuple[str, int]:
    """The seed directory for target, written; (its path, how many files)."""
    d = os.path.join(work, "seed")
    os.makedirs(d, exist_ok=True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    if target == "gguf":
        import gguf_corpus
        gguf_corpus.write(d)
    else:
        subprocess.run([exe], env=dict(env, KVFLASH_FUZZ_WRITE_SEEDS=d), check=True, stdout=subprocess.DEVNULL)
    return d, len(os.listdir(d))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=TARGETS, required=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--runs", type=int, help="executions (default 100000 unless --max-time)")
    g.add_argument("--max-time", type=int, help="seconds of fuzzing (libFuzzer's -max_total_time)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(ROOT, "build-fuzz"))
    ap.add_argument("--no-build", action="store_true", help="use the targets already in --build")
    ap.add_argument("--ggml-source", default=os.environ.get("KVFLASH_GGML_SOURCE"))
    ap.add_argument("--work", help="corpus and artifacts directory (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=10, help="seconds one input may take")
    ap.add_argument("--out", help="directory for fuzz.json, fuzz.log and the findings")
    ap.add_argument("--keep-findings", action="store_true",
                    help="copy findings into bench/fuzz/regressions/TARGET/ (replayed by every later run and by ctest)")
    a = ap.parse_args(argv)
    if a.runs is None and a.max_time is None:
        a.runs = 100000

    if not a.no_build:
        build(a.build, a.ggml_source)
    exe = os.path.join(a.build, f"fuzz_{a.target}")
    work = a.work or tempfile.mkdtemp(prefix=f"kvflash-fuzz-{a.target}-")
    corpus, art = (os.path.join(work, d) for d in ("corpus", "artifacts"))
    for d in (corpus, art):
        os.makedirs(d, exist_ok=True)
    env = dict(os.environ, KVFLASH_FUZZ_DIR=work, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1")
    if a.target == "snapshot":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import snapshot_models
        models = os.path.join(work, "models")
        snapshot_models.write(models)
        env["KVFLASH_FUZZ_MODELS"] = models
    seed_dir, n_seed = seed(a.target, exe, work, env)
    regressions = os.path.join(ROOT, "bench", "fuzz", "regressions", a.target)
    n_regressions = len([f for f in os.listdir(regressions) if not f.startswith(".")]) \
        if os.path.isdir(regressions) else 0
    budget = [f"-runs={a.runs}"] if a.runs is not None else [f"-max_total_time={a.max_time}"]
    # new units go to the first directory (the work corpus); the seeds and the regressions are only read
    cmd = [exe, *budget, f"-seed={a.seed}", f"-timeout={a.timeout}", "-rss_limit_mb=2048", "-print_final_stats=1",
           f"-artifact_prefix={art}/", corpus, seed_dir] + ([regressions] if os.path.isdir(regressions) else [])
    print("$", " ".join(shlex.quote(x) for x in cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = r.stderr
    stats = dict(re.findall(r"^stat::(\w+):\s+(\d+)", log, re.M))
    done = re.findall(r"^#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/", log, re.M)
    inited = re.findall(r"^#(\d+)\s+INITED\s+cov: (\d+) ft: (\d+) corp: (\d+)/", log, re.M)
    executed = int(stats.get("number_of_executed_units", done[-1][0] if done else 0))
    findings = [dict(file=f, bytes=os.path.getsize(os.path.join(art, f))) for f in sorted(os.listdir(art))]
    applied = re.findall(r"^fuzz_snapshot: (\d+) inputs, (\d+) applied", log, re.M)
    reports = re.findall(r"^(==\d+==ERROR: .*|.*runtime error: .*|SUMMARY: .*)$", log, re.M)
    clang = subprocess.run(["clang", "--version"], capture_output=True, text=True).stdout.splitlines()
    result = dict(target=a.target,
                  command="python " + " ".join(shlex.quote(x) for x in [sys.argv[0]] + (argv or sys.argv[1:])),
                  fuzzer_command=" ".join(shlex.quote(x) for x in cmd), returncode=r.returncode, runs=a.runs,
                  max_time_s=a.max_time, executed=executed, wall_s=wall,
                  exec_per_s=int(stats["average_exec_per_sec"]) if "average_exec_per_sec" in stats else None,
                  seed_files=n_seed, regression_inputs=n_regressions, seed=a.seed,
                  coverage_after_seeds=dict(cov=int(inited[-1][1]), ft=int(inited[-1][2]), corpus=int(inited[-1][3]))
                  if inited else None,
                  coverage=dict(cov=int(done[-1][1]), ft=int(done[-1][2]), corpus=int(done[-1][3])) if done else None,
                  snapshot_inputs_applied=dict(inputs=int(applied[-1][0]), applied=int(applied[-1][1]))
                  if applied else None,
                  peak_rss_mb=int(stats["peak_rss_mb"]) if "peak_rss_mb" in stats else None,
                  findings=findings, reports=reports[:20],
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  kvflash=git_facts(),
                  machine=dict(platform=platform.platform(), cpu=cpu_model(),
                               cpus=len(os.sched_getaffinity(0)), clang=clang[0] if clang else None))
    print(json.dumps(result, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fuzz.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(a.out, "fuzz.log"), "w") as f:
            f.write(log[-20000:])
        for x in findings:
            shutil.copy(os.path.join(art, x["file"]), os.path.join(a.out, x["file"]))
    if a.keep_findings and findings:
        os.makedirs(regressions, exist_ok=True)
        for x in findings:
            shutil.copy(os.path.join(art, x["file"]), os.path.join(regressions, x["file"]))
    ok = r.returncode == 0 and not findings and (a.runs is None or executed >= a.runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
