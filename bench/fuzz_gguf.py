#!/usr/bin/env python
"""Coverage-guided fuzzing of the GGUF loader (libFuzzer, clang) for a number of runs.

Builds bench/fuzz (the loader, the C API and ggml's gguf parser instrumented for
coverage and ASan/UBSan; see bench/fuzz/fuzz_gguf.cpp), seeds a corpus with
tests/gguf_corpus.py (one valid model and its corrupt variants), runs the target for
--runs executions and records what libFuzzer reports: executions, coverage, corpus, and
every finding (crash-, leak-, timeout-, oom- files) with the sanitizer's report.

Needs clang with libFuzzer (Debian: apt-get install clang).  The ggml source is the
one the main build uses (-DKVFLASH_GGML_SOURCE, or the pinned download).

Usage: python bench/fuzz_gguf.py [--runs 100000] [--seed 1] [--build build-fuzz] [--out DIR]
"""
from __future__ import annotations

import argparse
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


def build(build_dir: str, ggml_source: str | None) -> str:
    cc, cxx = shutil.which("clang"), shutil.which("clang++")
    if not cc or not cxx:
        sys.exit("clang not found: the fuzz target needs clang and libFuzzer (Debian: apt-get install clang)")
    cfg = ["cmake", "-S", os.path.join(ROOT, "bench", "fuzz"), "-B", build_dir, "-G", "Ninja",
           f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}", "-DCMAKE_BUILD_TYPE=Release"]
    if ggml_source:
        cfg.append(f"-DKVFLASH_GGML_SOURCE={ggml_source}")
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build_dir], check=True)
    return os.path.join(build_dir, "fuzz_gguf")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(ROOT, "build-fuzz"))
    ap.add_argument("--ggml-source", default=os.environ.get("KVFLASH_GGML_SOURCE"))
    ap.add_argument("--work", help="corpus and artifacts directory (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=10, help="seconds one input may take")
    ap.add_argument("--out", help="directory for fuzz.json, fuzz.md and the findings")
    a = ap.parse_args(argv)

    exe = build(a.build, a.ggml_source)
    work = a.work or tempfile.mkdtemp(prefix="kvflash-fuzz-")
    seed, corpus, art = (os.path.join(work, d) for d in ("seed", "corpus", "artifacts"))
    for d in (corpus, art):
        os.makedirs(d, exist_ok=True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import gguf_corpus
    n_seed = len(gguf_corpus.write(seed))
    cmd = [exe, f"-runs={a.runs}", f"-seed={a.seed}", f"-timeout={a.timeout}", "-rss_limit_mb=2048",
           "-print_final_stats=1", f"-artifact_prefix={art}/", corpus, seed]
    env = dict(os.environ, KVFLASH_FUZZ_DIR=work,
               ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    print("$", " ".join(shlex.quote(x) for x in cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = r.stderr
    stats = dict(re.findall(r"^stat::(\w+):\s+(\d+)", log, re.M))
    done = re.findall(r"^#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/", log, re.M)
    executed = int(stats.get("number_of_executed_units", done[-1][0] if done else 0))
    findings = []
    for name in sorted(os.listdir(art)):
        findings.append(dict(file=name, bytes=os.path.getsize(os.path.join(art, name))))
    reports = re.findall(r"^(==\d+==ERROR: .*|.*runtime error: .*|SUMMARY: .*)$", log, re.M)
    result = dict(command="python " + " ".join(shlex.quote(x) for x in [sys.argv[0]] + (argv or sys.argv[1:])),
                  fuzzer_command=" ".join(shlex.quote(x) for x in cmd), returncode=r.returncode, runs=a.runs,
                  executed=executed, wall_s=wall, seed_files=n_seed, seed=a.seed,
                  coverage=dict(cov=int(done[-1][1]), ft=int(done[-1][2]), corpus=int(done[-1][3])) if done else None,
                  peak_rss_mb=int(stats["peak_rss_mb"]) if "peak_rss_mb" in stats else None,
                  findings=findings, reports=reports[:20],
                  machine=dict(platform=platform.platform(), cpus=len(os.sched_getaffinity(0)),
                               clang=subprocess.run(["clang", "--version"], capture_output=True,
                                                    text=True).stdout.splitlines()[0]))
    print(json.dumps(result, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fuzz.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(a.out, "fuzz.log"), "w") as f:
            f.write(log[-20000:])
        for x in findings:
            shutil.copy(os.path.join(art, x["file"]), os.path.join(a.out, x["file"]))
    return 0 if r.returncode == 0 and not findings and executed >= a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
