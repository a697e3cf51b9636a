"""The bench harness end to end on a tiny random model: every routine runs and reports (numbers are noise)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_small_llama  # noqa: E402

from kvflash.bench import cli  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_small_llama(tmp_path_factory.mktemp("bench") / "tiny.gguf", seed=5)


@pytest.mark.parametrize("routine,extra", [
    ("needle", ["--contexts", "1024", "--needles", "2", "--depths", "10,90", "--policies", "lru,qk,qk-bound"]),
    ("needle", ["--contexts", "1024", "--needles", "1", "--policies", "qk", "--no-full", "--tail-chunks", "2",
                "--haystacks", "prose"]),
    # the corpus: two genres, the question through the template and as a raw completion
    ("needle", ["--contexts", "1024", "--needles", "2", "--depths", "10,90", "--policies", "lru,qk",
                "--haystacks", "code,chat", "--ask", "chat,raw"]),
    ("rescore", ["--contexts", "1024", "--repeats", "1", "--policies", "qk,drafter,qk:q16:c64"]),
    ("ab", ["--contexts", "1024", "--needles", "2", "--steps", "4", "--policy", "qk"]),
    ("memory", ["--contexts", "2048"]),
    ("memory", ["--contexts", "1024", "--prefill", "--cells", "ram,file"]),
    ("paging", ["--repeats", "1"]),
    ("decode", ["--contexts", "600,1024", "--repeats", "2", "--steps", "4", "--policy", "qk",
                "--control", "kvflash"]),
    ("prefill", ["--contexts", "600,1024", "--repeats", "3", "--control", "kvflash"]),
    # beside the plain pooled prefill, the same with the settle's re-read of the chosen chunks and with exact prefill
    ("prefill", ["--contexts", "1024", "--repeats", "2", "--control", "kvflash", "--policy", "qk", "--prefill-reread",
                 "--exact-prefill"]),
    ("snapshot", ["--contexts", "600,1024", "--repeats", "2", "--policy", "qk"]),
    ("attention", ["--repeats", "3", "--kv-types", "q8_0,f16", "--thread-counts", "1,2"]),
    ("ruler", ["--contexts", "1024", "--needles", "1", "--residencies", "4", "--aggregate-residencies", "4",
               "--chunk-tokens", "16", "--policies", "lru,qk,drafter,qk:q16:c0,drafter:c64",
               "--haystacks", "filler,ledger", "--split", "tuning"]),
    ("ruler", ["--contexts", "1024", "--needles", "1", "--residencies", "4", "--aggregate-residencies", "4",
               "--chunk-tokens", "16", "--policies", "lru,qk,drafter,qk:q16:c0", "--haystacks", "filler,ledger",
               "--split", "tuning", "--exact-prefill"]),
    ("ruler", ["--contexts", "1024", "--needles", "1", "--residencies", "4", "--aggregate-residencies", "4",
               "--chunk-tokens", "16", "--policies", "qk", "--haystacks", "filler,ledger", "--tasks", "multikey",
               "--split", "tuning", "--prefill-reread"]),
    # RULER's other families and a corpus haystack beside the filler
    ("ruler", ["--contexts", "1024", "--needles", "1", "--residencies", "4", "--aggregate-residencies", "4",
               "--chunk-tokens", "16", "--policies", "lru,qk", "--haystacks", "chat,filler",
               "--tasks", "single,vt,cwe,fwe", "--split", "reporting"]),
    ("serve", ["--contexts", "700", "--repeats", "2", "--steps", "12", "--policy", "qk", "--clients", "4",
               "--parallel", "2", "--client-prompt", "150", "--client-tokens", "6"]),
    ("exact", ["--contexts", "1200", "--prompts", "3", "--gen-tokens", "12", "--policy", "qk"]),
    ("demo", ["--contexts", "1536", "--repeats", "5", "--policy", "qk"]),
    ("chat", ["--contexts", "1024", "--repeats", "2", "--policy", "lru"]),
])
def test_routine_runs_and_writes(tiny, tmp_path, capsys, routine, extra):
    out = tmp_path / routine
    argv = [routine, "--model", tiny, "--pool", "512", "--threads", "1", "--drafter", tiny, "-o", "json",
            "--out", str(out)] + extra
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (out / "table.md").is_file() and (out / "raw.csv").is_file() and (out / "config.json").is_file()
    text = json.dumps(data)
    if routine == "needle":
        assert "passkey chunk resident" in (out / "table.md").read_text()
        rows = data["results"][0]["rows"]
        # reporting split by default: both haystacks (unless narrowed), a rank per trial for the scored policies
        hays = extra[extra.index("--haystacks") + 1].split(",") if "--haystacks" in extra else ["prose", "ledger"]
        assert {r["haystack"] for r in rows} == set(hays)
        asks = extra[extra.index("--ask") + 1].split(",") if "--ask" in extra else ["chat"]
        assert {r.get("ask", "chat") for r in rows} == set(asks) and ("ask" in rows[0]) == ("--ask" in extra)
        if "--ask" in extra:   # a row per haystack, ask and mode; the raw records name their ask and value
            assert len(rows) == len(hays) * len(asks) * 3, rows
            raw = data["results"][0]["raw"]
            assert {(x["haystack"], x["ask"]) for x in raw} == {(h, a) for h in hays for a in asks}
            assert any("corpus" in n for n in data["results"][0]["notes"])
        qk = [r for r in rows if r["policy"] == "qk"]
        n_trials = int(extra[extra.index("--needles") + 1])
        assert qk and all(len(r["ranks"].split(" (")[0].split()) == n_trials for r in qk), qk
        assert any("reporting data" in n for n in data["results"][0]["notes"])
        if "--no-full" in extra:   # only the kvflash mode; a 2-chunk tail leaves 8 - 1 - 2 - 1 = 4 free slots
            assert [r["mode"] for r in rows] == ["kvflash"], rows
            assert rows[0]["ranks"].endswith("(4)"), rows
            assert any("last 3 chunks" in n for n in data["results"][0]["notes"])
        else:
            assert {r["mode"] for r in rows} == {"full", "kvflash"}
            assert all(r["ranks"].endswith("(2)") for r in qk), qk   # the default tail: 4 chunks + the open one
    if routine == "ab":
        rows = data["results"][0]["rows"]
        assert [r["mode"] for r in rows] == ["full", "full (A/A control)", "kvflash"], rows
        kv = rows[2]
        # the window pays for rescoring: 4 periods of 64 tokens + 1 at this context, every trial
        assert kv["window"] == 257 and kv["rescores"]["min"] >= 4, kv
        assert rows[0]["rescores"]["max"] == 0
        assert "x (" in rows[1]["speed_ratio"] and "x (" in kv["speed_ratio"]
        assert any("A/A" in n for n in data["results"][0]["notes"])
    # every result says what built it and on which weight paths
    m = data["machine"]
    assert len(m["kvflash_commit"]) == 40 or m["kvflash_commit"] == "unknown", m
    assert m["kvflash_dirty"] in (True, False, None) and m["ggml_commit"] == "0c1e570"
    assert set(m["build"]) >= {"native", "cpu_features", "cpu_extra_buffer_types", "repack"}, m["build"]
    assert "tiny.gguf" in m["weight_placement"] and all("kernels" in x or "AMX" in x
                                                         for x in m["weight_placement"]["tiny.gguf"])
    head = (out / "table.md").read_text().splitlines()[0]
    assert head.startswith(f"<!-- kvflash {m['kvflash_commit'][:12]}") and f"python -m kvflash.bench {routine}" in head
    if routine == "demo":
        res = data["results"][0]
        rows = res["rows"]
        assert [r["mode"] for r in rows] == ["full", "full (A/A control)", "kvflash"], rows
        for r in rows:   # one prompt for all, 5 decode rounds each, an answer each
            assert r["decode_tok_s"]["n"] == 5 and r["prompt_tokens"] > 1000 and r["correct"] in ("yes", "no"), r
        assert rows[2]["kv_resident_mib"] < rows[0]["kv_resident_mib"] / 2 and rows[2]["host_mib"] > 0, rows
        assert "x (" in rows[1]["speed_ratio"] and "x (" in rows[2]["speed_ratio"] and "speed_ratio" not in rows[0]
        raw = res["raw"]
        assert len(raw) == 15 and len({(x["mode"], x["round"]) for x in raw}) == 15
        # every window starts from the same depth, and a scored policy's rescore falls inside each
        for mode in ("full", "control", "kvflash"):
            assert len({x["decode_ctx"] for x in raw if x["mode"] == mode}) == 1
        assert all(x["window_rescores"] >= 1 for x in raw if x["mode"] == "kvflash")
        assert any(n.startswith("decode kvflash/full:") and "A/A" in n for n in res["notes"])
        assert any("KV resident" in n for n in res["notes"])
    if routine == "chat":
        res = data["results"][0]
        assert [(r["pool"], r["policy"]) for r in res["rows"]] == [("-", "-"), (512, "lru")], res["rows"]
        # no recurrent state: a turn reads the new tokens alone
        assert all(x["reread"] == x["new"] == 40 for x in res["raw"]), res["raw"]
        assert sum("met" in n for n in res["notes"]) == 2
    if routine == "exact":
        raw = data["results"][0]["raw"]
        assert all(len(x["tokens_sha256"]) == 16 for x in raw)
        by = {(x["mode"], x["prompt"]): x["tokens_sha256"] for x in raw}
        assert all(by[("exact", i)] == by[("full", i)] for i in range(3))   # the identity, re-checkable
        rows = data["results"][0]["rows"]
        assert [r["mode"] for r in rows] == ["full", "exact", "full (A/A control)"], rows
        assert rows[1]["identical"] == "3/3" and rows[2]["identical"] == "3/3", rows
        assert "x (" in rows[1]["speed_ratio"] and "drafts kept" not in rows[1]["acceptance"]
        assert any("A/A" in n for n in data["results"][0]["notes"])
    if routine == "decode":
        rows = data["results"][0]["rows"]
        assert [r["mode"] for r in rows] == ["full", "kvflash", "kvflash (A/A control)"] * 2, rows
        for r in rows:   # a scored policy: 4 rescore periods (64 tokens) + 1 timed in every mode
            assert r["window"] == 257 and r["decode_tok_s"]["n"] == 2, r
        kv, ctl = rows[4], rows[5]
        # a growing session keeps its rescore phase across repeats: 4 periods + 1 hold 3 or 4 rescores
        assert kv["rescores"]["min"] >= 3 and kv["rescores"]["max"] >= 4 and rows[3]["rescores"]["max"] == 0, rows
        assert "x (" in kv["speed_ratio"] and "x (" in ctl["speed_ratio"]
        assert sum("A/A" in n for n in data["results"][0]["notes"]) == 2   # a verdict per context
    if routine == "prefill" and "--prefill-reread" in extra:
        res = data["results"][0]
        assert [r["mode"] for r in res["rows"]] == ["full", "kvflash", "kvflash+reread", "kvflash+exact",
                                                    "kvflash (A/A control)"]
        raw = res["raw"]
        # only the +exact mode prefills exactly; only the +reread mode re-reads
        assert {r["mode"] for r in raw if r["exact_prefill"]} == {"kvflash+exact"}, raw
        assert {r["mode"] for r in raw if r["reread_tokens"]} == {"kvflash+reread"}, raw
        plain = {r["repeat"]: r["seconds"] for r in raw if r["mode"] == "kvflash"}
        for mode, what in (("kvflash+reread", "the settle's re-read"), ("kvflash+exact", "exact prefill")):
            rr = sorted(r["seconds"] / plain[r["repeat"]] for r in raw if r["mode"] == mode)
            note = next(n for n in res["notes"] if f"prefill with {what} over the plain" in n)
            assert f"{(rr[0] + rr[1]) / 2:.2f}x ({rr[0]:.2f}-{rr[1]:.2f}); A/A" in note, (note, rr)
            assert ("the re-read itself" in note) == (mode == "kvflash+reread"), note
    elif routine == "prefill":
        rows = data["results"][0]["rows"]
        assert [r["mode"] for r in rows] == ["full", "kvflash", "kvflash (A/A control)"] * 2, rows
        raw = [r for r in data["results"][0]["raw"] if r["context"] == 1024]
        # each repeat runs every mode, in a rotated order, from a reset session
        assert sorted(r["repeat"] for r in raw) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert [r["mode"] for r in raw if r["repeat"] == 1][0] != [r["mode"] for r in raw if r["repeat"] == 0][0]
        for r in rows:
            assert r["prefill_s"]["n"] == 3 and r["prefill_s"]["min"] > 0, r
        kv, ctl = rows[4], rows[5]
        full_s = {r["repeat"]: r["seconds"] for r in raw if r["mode"] == "full"}
        kv_s = {r["repeat"]: r["seconds"] for r in raw if r["mode"] == "kvflash" and r["pool"] == 512}
        want = sorted(full_s[i] / kv_s[i] for i in range(3))
        assert kv["speed_ratio"] == f"{want[1]:.2f}x ({want[0]:.2f}-{want[2]:.2f})", (kv, want)
        assert "x (" in ctl["speed_ratio"]
        assert sum("A/A" in n for n in data["results"][0]["notes"]) == 2   # a verdict per context
    if routine == "rescore":
        assert "drafter" in text and "qk" in text and "qk:q16:c64" in text
    if routine == "attention":
        rows = data["results"][0]["rows"]
        # q8_0: every kernel per thread count (with the tiled one: tiled f32, rows f32, tiled int8); f16: rows
        from kvflash import _core
        q8 = (["f32 dots, tiled", "f32, row", "int8 dots, tiled"] if _core.pool_attention_tiled_available()
              else ["f32, row", "int8 dots, row"])
        want = [("q8_0", th, k) for th in (1, 2) for k in q8] + [("f16", 1, "f32, row"), ("f16", 2, "f32, row")]
        assert [(r["kv_type"], r["threads"], r["kernel"].split(" (")[0].split(" at")[0].rstrip(","))
                for r in rows] == [(a, b, c.split(" at")[0]) for a, b, c in want], rows
        for r in rows:
            assert r["attn_ms"]["n"] == 3 and r["attn_gib_s"]["min"] > 0 and r["read_gib_s"]["min"] > 0, r
            assert r["kv_mib"] > 0 and r["vs_read"].endswith(")"), r
            assert r["kernel"].startswith("f32, row") == (r.get("vs_rows") is None), r
        assert len(data["results"][0]["raw"]) == len(want) * 3
    if routine == "snapshot":
        res = data["results"][0]
        ops = ["prefill", "save", "restore", "restore_again", "restore_cold", "load"]
        assert [(r["context"], r["op"]) for r in res["rows"]] == [(D, op) for D in (600, 1024) for op in ops]
        for r in res["rows"]:
            assert r["seconds"]["n"] == 2 and r["seconds"]["min"] > 0, r
            if r["op"] == "save":   # the file holds at least the KV the session holds
                assert r["file_mib"] > 0.9 * r["kv_mib"] > 0 and r["full_kv_mib"] > 0, r
            if r["op"] == "restore":   # restored logits and the next greedy tokens equal the saved session's
                assert r["exact"] == "yes", r
                h = r["tokens_sha256"]
                assert h["saved_session"] == h["restored"] and len(h["restored"]) == 16, r
            if r["op"] != "prefill":
                assert r["vs_prefill"].endswith("%)"), r
        raw = res["raw"]   # each repeat: its own prefill, and the file's size is what was written
        assert len(raw) == 4 and all(x["file_bytes"] > 0 and x["prefill"] > 0 for x in raw)
        assert sum("A/A restore" in n for n in res["notes"]) == 2
    if routine == "ruler":
        res = data["results"][0]
        rows = res["rows"]
        assert any("exact prefill" in n for n in res["notes"]) == ("--exact-prefill" in extra)
        assert any("prefill re-read" in n for n in res["notes"]) == ("--prefill-reread" in extra)
        from kvflash.bench.ruler import LIST_TASKS
        tasks = (extra[extra.index("--tasks") + 1].split(",") if "--tasks" in extra else
                 ["single", "multikey", "multivalue", "multiquery", "aggregate"])
        pols = ["full"] + extra[extra.index("--policies") + 1].split(",")
        # per task: the full cache, then each policy at 1/4 (pool 256 = 16 chunks of 16)
        assert [(r["task"], r["policy"]) for r in rows] == [(t, p) for t in tasks for p in pols], rows
        for r in rows:
            n = 1 if r["task"] in LIST_TASKS else 2   # one trial per haystack
            first = next(x for x in rows if x["task"] == r["task"])   # the task's full-cache row
            assert r["trials"] == n and 0 <= r["score"] <= 100 and r["full"] == first["score"], r
            if r["policy"] != "full":
                assert r["pool"] == 256 and r["residency"] == "1/4", r
            if "chat" in extra[extra.index("--haystacks") + 1]:   # a corpus genre: the score per haystack
                assert (r.get("by_haystack") or "").startswith("chat ") == (r["task"] not in LIST_TASKS), r
                if r["task"] not in LIST_TASKS:
                    assert ", filler " in r["by_haystack"], r
            else:
                assert "by_haystack" not in r, r
            if r["policy"] in ("qk", "drafter", "qk:q16:c0", "drafter:c64") and r["task"] not in LIST_TASKS:
                assert r["ranks"].endswith("(10)"), r   # 16 chunks - sink - 4 tail - the open one
        assert any("16 chunks of 16" in n for n in res["notes"])
        assert any(("TUNING data" if "tuning" in extra else "reporting data") in n for n in res["notes"])
        log = out / "trials.jsonl"
        lines = log.read_text().splitlines()
        n_log = sum(1 if t in LIST_TASKS else 2 for t in tasks)
        assert len(lines) == n_log   # e.g. 4 needle tasks x 2 haystacks + the aggregate list
        # a second run with the same log measures nothing again and reports the same table
        assert cli.main(argv) == 0
        again = json.loads(capsys.readouterr().out)
        assert again["results"][0]["rows"] == rows and len(log.read_text().splitlines()) == n_log
        # the table from the log alone: the same rows, nothing measured
        assert cli.main(argv + ["--logged-only"]) == 0
        assert json.loads(capsys.readouterr().out)["results"][0]["rows"] == rows
        from kvflash.bench import plots
        try:
            plt = plots._plt()
        except plots.PlotUnavailable:
            return
        png = plots._ruler_heatmap(plt, rows, out / "ruler_heatmap.png", "")
        assert png.stat().st_size > 1000
    if routine == "serve":
        res = data["results"][0]
        rows = res["rows"]
        assert [r["what"] for r in rows] == ["decode"] * 3 + ["4 concurrent clients"], rows
        for r in rows[:3]:   # greedy: the HTTP stream's text is the in-process run's, every round
            assert r["decode_tok_s"]["n"] == 2 and r["decode_tok_s"]["min"] > 0 and r["same_text"] == "yes", r
        assert "x (" in rows[0]["ratio"] and "x (" in rows[2]["ratio"] and rows[1].get("ratio") is None
        cc = rows[3]
        assert cc["done"] == "8 / 0", cc
        assert 0 < cc["ttft_p50"] <= cc["ttft_p95"] and cc["latency_p95"] >= cc["ttft_p95"], cc
        raw = [x for x in res["raw"] if x["what"] == "concurrent"]
        assert len({tuple(x.items()) for x in raw}) == 8 and all(x["tokens"] == 6 for x in raw)
        assert any("A/A control" in n for n in res["notes"])
    if routine == "paging":
        ops = {r["op"]: r for r in data["results"][0]["rows"]}
        for op in ("page_out_cold", "page_out_warm", "page_in_cold", "page_in_warm", "reselect_noop"):
            assert ops[op]["ms"]["n"] > 0, op
        assert ops["page_in_cold"]["vs_memcpy"].endswith("x")
    if routine == "memory":
        rows = data["results"][0]["rows"]
        modes = {(r["mode"], r["host"]) for r in rows}
        if "--prefill" in extra:   # real prefills, only the cells asked for
            assert modes == {("kvflash", "ram"), ("kvflash", "file")}, modes
            assert all(r["prefill_s"] > 0 for r in rows)
        else:
            assert {("full", "-"), ("kvflash", "ram"), ("kvflash", "file")} <= modes, modes
        for r in rows:   # each cell measured in a process of its own
            assert r["rss_mib"] > 0 and r["rss_anon_mib"] > 0 and r["rss_mib"] >= r["rss_anon_mib"]
            if r["mode"] == "kvflash":
                assert r["host_mib"] > 0 and r["host_reserved_mib"] >= r["host_mib"]


def test_bad_arguments_are_clear(tiny, capsys):
    with pytest.raises(SystemExit):
        cli.main(["needle", "--policies", "nope"])
    assert "unknown" in capsys.readouterr().err
    for bad in (["ruler", "--policies", "qk:x3"], ["ruler", "--policies", "qk:q0"], ["needle", "--policies", "qk:q"],
                ["ruler", "--policies", "drafter:c-1"], ["ruler", "--policies", "drafter:k4"],
                ["needle", "--policies", "drafter:c64"],
                ["ruler", "--tasks", "single,nope"], ["ruler", "--haystacks", "prose"], ["ruler", "--chunk-tokens", "48"],
                ["ruler", "--split", "tuning-indirect"], ["paging", "--device", "tpu"], ["decode", "--device", "cuda:x"]):
        with pytest.raises(SystemExit):
            cli.main(bad)
        assert "error" in capsys.readouterr().err, bad


def test_needle_splits_are_disjoint(tiny):
    """Tuning and reporting prompts share no wording; the ledger haystack carries numbers, and the passkey
    occurs exactly once in its prompt; the tuning split refuses the reporting haystack."""
    import kvflash
    from kvflash.bench.needle import NeedleBuilder, REPORTING_WORDINGS, TUNING_INDIRECT_WORDINGS, TUNING_WORDINGS
    assert not {w[0] for w in TUNING_WORDINGS + TUNING_INDIRECT_WORDINGS} & {w[0] for w in REPORTING_WORDINGS}
    rep_words = {x.strip(".,?'s").lower() for w in REPORTING_WORDINGS for x in (w[0] + " " + w[1]).split()}
    for needle, question, prefix in TUNING_INDIRECT_WORDINGS:   # no rare word of a held-out wording leaks in
        words = {x.strip(".,?'s").lower() for x in (needle + " " + question).split() if len(x) > 5}
        assert not words & rep_words, words & rep_words
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=None, threads=1, verbose=False)
    tune = NeedleBuilder(s, 1234, split="tuning").trial(0, 1500, [50])
    rep = NeedleBuilder(s, 1234, split="reporting", haystack="prose").trial(0, 1500, [50])
    led = NeedleBuilder(s, 1234, split="reporting", haystack="ledger")
    assert s.detokenize(tune.ids) != s.detokenize(rep.ids)
    assert "The passkey is" in s.detokenize(tune.ids)
    for i in range(3):
        t = led.trial(i, 1500, [10, 50, 90])
        text = s.detokenize(t.ids)
        assert sum(ch.isdigit() for ch in text) > 100 and text.count(t.value) == 1
    with pytest.raises(ValueError, match="reporting data"):
        NeedleBuilder(s, 1234, split="tuning", haystack="ledger")
    with pytest.raises(ValueError, match="reporting data"):
        NeedleBuilder(s, 1234, split="tuning-indirect", haystack="ledger")
    ind = NeedleBuilder(s, 1234, split="tuning-indirect").trial(0, 1500, [50])
    assert "The code is" in s.detokenize(ind.ids) and ind.value in s.detokenize(ind.ids)


def test_passkey_span_and_rank():
    """A passkey that straddles a chunk edge is kept only when all its chunks are; its rank is the worst of them."""
    import numpy as np
    from kvflash.bench.routines import passkey_chunks, rank_of, rank_text, span_rank

    class Tok:   # one byte per token
        @staticmethod
        def bytes_of(ids, skip_special=True):
            data = bytes(ids)
            return data, np.arange(1, len(data) + 1)

    class S:
        tokenizer, chunk_tokens = Tok(), 4

    ids = list(b"abcdef12345xyz")          # '12345' at tokens 6-10: chunks 1 and 2
    assert passkey_chunks(S, ids, "12345") == [1, 2]
    assert passkey_chunks(S, ids, "123") == [1, 2] and passkey_chunks(S, ids, "12") == [1]
    assert passkey_chunks(S, ids, "999") == []
    scores = np.array([9.0, 5.0, 1.0, 3.0])
    prot = np.array([True, False, False, False])
    rr = [rank_of(scores, prot, c) for c in (1, 2)]
    assert rr == [0, 2] and span_rank(rr) == 2 and rank_text(rr) == "0+2"
    assert rank_text([rank_of(scores, prot, 0)]) == "p" and span_rank([-1, -1]) == -1


def test_ruler_answer_is_the_first_line_with_text():
    """A base model may break the line after the answer prefix before answering: blank lines first are
    skipped, the answer ends with the first line that has text."""
    from kvflash.bench.routines.ruler import first_line
    assert first_line("\n\n ABCDE FGHIJ\nmore") == "ABCDE FGHIJ"
    assert first_line(" 1234567.\nQuestion") == "1234567."
    assert first_line("\n \n") is None and first_line("no end yet") is None and first_line("") is None
    assert first_line(":\n plum, tower\n") == "plum, tower" and first_line(":\n") is None
    assert first_line("no end yet", final=True) == "no end yet" and first_line(" :\n", final=True) is None
    from kvflash.bench.routines.ruler import _answer

    class Fake:   # a session whose generate() is an iterator that must be closed before the next call
        def __init__(self, pieces):
            self.pieces, self.gen = pieces, None

        def generate(self, prompt, **kw):
            assert self.gen is None or self.gen.gi_frame is None, "the previous answer's iterator is still open"
            self.gen = (p for p in self.pieces)
            return self.gen
    fake = Fake(["\n", "\n", " ABC", "DE", "\nmore", "never"])
    assert _answer(fake, 16)[0] == "ABCDE"
    assert fake.gen.gi_frame is None   # closed, not left suspended
    fake.pieces = [" 123", " 4"]
    assert _answer(fake, 16)[0] == "123 4"
    fake.pieces = [":", "\n", " visitors,", " plain\n"]
    assert _answer(fake, 16)[0] == "visitors, plain"


def test_ruler_prompts(tiny):
    """The ruler splits share no wording, key word or value word; every needle value occurs once in its
    prompt, the target near its depth; the aggregate list's common words lead by a margin; prompts fill
    their budget; scoring is RULER's share of values found."""
    import collections
    import re
    import kvflash
    from kvflash.bench import ruler
    w_t, w_r = ruler.WORDINGS["tuning"], ruler.WORDINGS["reporting"]
    assert not set(w_t.values()) & set(w_r.values())
    s = kvflash.Session(tiny, max_ctx=2048, kvflash=None, threads=1, verbose=False)
    tb, rb = ruler.RulerBuilder(s, 7, split="tuning"), ruler.RulerBuilder(s, 7, split="reporting")
    assert not {w for k in tb.keys for w in k.split("-")} & {w for k in rb.keys for w in k.split("-")}
    assert not set(tb.value_words) & set(rb.value_words)
    assert not set(ruler.aggregate_vocabulary("tuning")) & set(ruler.aggregate_vocabulary("reporting"))
    with pytest.raises(ValueError, match="split"):
        ruler.RulerBuilder(s, 7, split="tuning-indirect")
    n_values = {"single": 1, "multikey": 1, "multivalue": 4, "multiquery": 2}
    for b in (tb, rb):
        for task in ruler.NEEDLE_TASKS:
            for hay in ruler.HAYSTACKS:
                for i in range(3):
                    t = b.trial(task, hay, i, 1500)
                    text = s.detokenize(t.ids)
                    assert 1500 - 150 <= len(t.ids) <= 1500, (task, hay, len(t.ids))   # within a sentence
                    assert len(t.values) == n_values[task] and len(set(t.values)) == len(t.values)
                    for v in t.values:
                        assert text.count(v) == 1, (task, hay, v)
                    # each value's needle sentence (its key and its value) is in the prompt
                    assert len(t.needles) == len(t.values) and all(v in n and n in text
                                                                   for v, n in zip(t.values, t.needles))
                    body = text[:text.rindex("\n\n")]
                    at = body.index(t.values[0]) / len(body)
                    assert abs(100 * at - t.depth) < 20, (task, hay, t.depth, at)   # a sentence is ~7% here
                    n_needles = text.count(b.w["needle"].split("{kind}")[0])
                    assert n_needles == {"single": 1, "multikey": 4, "multivalue": 4, "multiquery": 2}[task]
                    # every inserted sentence, distractors included, each in the prompt once, needles first
                    assert len(t.inserted) == n_needles and t.inserted[:len(t.needles)] == t.needles
                    assert all(text.count(x) == 1 for x in t.inserted), (task, hay)
                    if task == "single":
                        assert t.kind == ruler.KINDS[i % 3]
                    if hay == "ledger":
                        assert sum(ch.isdigit() for ch in text) > 60   # ~15 sentences of records here
        agg = b.trial("aggregate", "list", 0, 1500)
        words = re.findall(r"[a-z]+", s.detokenize(agg.ids).split("list of words:")[1].split(".")[0])
        counts = collections.Counter(words)
        top = [w for w, _ in counts.most_common(3)]
        assert sorted(top) == sorted(agg.values)
        assert min(counts[w] for w in agg.values) >= 3 * max(c for w, c in counts.items() if w not in agg.values)
    assert ruler.score("They are 1,234,567 and 7 654 321.", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert ruler.score("Kiwi", ["kiwi"]) == 1.0 and ruler.score("", ["kiwi"]) == 0.0
    with pytest.raises(ValueError):
        ruler.score("x", [])


def test_ruler_shared_prefill_equals_a_policys_own(tiny, tmp_path):
    """What the ruler routine does per policy -- an LRU prefill restored from a snapshot, then the policy's
    post-prompt rescore and re-read -- leaves the session as Session.prefill under that policy does."""
    import numpy as np
    import kvflash
    from kvflash.bench.common import text_tokens
    from kvflash.policies import LRUPolicy
    kw = dict(max_ctx=2048, kvflash=256, threads=1, verbose=False, chunk_tokens=16, seed=3)
    own = kvflash.Session(tiny, policy="qk", **kw)
    shared = kvflash.Session(tiny, policy="qk", **kw)
    ids = [int(x) for x in text_tokens(own, 1500)]
    own.prefill(ids)
    qk = shared.policy
    shared.policy = LRUPolicy()
    shared.prefill(ids)
    shared.save(tmp_path / "p.kvfs")
    shared.prefill(ids[:40])   # move on, so the restore has something to undo
    shared.restore(tmp_path / "p.kvfs")
    shared.policy = qk
    shared._settle_prompt(ids)
    assert own.pager.stats["host_chunks"] > 0 and own.stats["rescores"] == 1
    np.testing.assert_array_equal(own.last_scores, shared.last_scores)
    a, b = own.pager.chunk_table(), shared.pager.chunk_table()
    np.testing.assert_array_equal(a["block"], b["block"])
    np.testing.assert_array_equal(own.logits(), shared.logits())
    ga = list(own.generate(None, max_tokens=8, temperature=0.0))
    gb = list(shared.generate(None, max_tokens=8, temperature=0.0))
    assert ga == gb


def test_drafter_variant_names_override_the_drafter_options(tiny):
    from kvflash.bench.common import BenchConfig, drafter_variant_kw, policy_variant_ok
    from kvflash.bench.routines.ruler import _drafter
    assert drafter_variant_kw("drafter:q8:c64:s0") == {"n_queries": 8, "contrast": 64, "spread": 0}
    assert policy_variant_ok("drafter:c64") and policy_variant_ok("qk:c64")
    for bad in ("drafter:q0", "drafter:c-1", "drafter:k4", "drafter:c", "qk:x1"):
        assert not policy_variant_ok(bad), bad
    with pytest.raises(ValueError, match="drafter:q16:c64:s4"):
        drafter_variant_kw("drafter:z1")
    cfg = BenchConfig(routine="ruler", model=str(tiny), drafter=str(tiny), drafter_contrast=16, drafter_queries=8)
    base, _ = _drafter(cfg)
    over, _ = _drafter(cfg, contrast=64)
    assert (base.contrast, base.n_queries) == (16, 8) and (over.contrast, over.n_queries) == (64, 8)
