"""Long prompts from files and their progress (issue 35): `kvflash generate -f FILE` / `-f -`, `kvflash chat
--file`, `Session.prefill(progress=...)` and the CLI's progress line."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tinygguf import write_tiny_chat_model  # noqa: E402

import kvflash  # noqa: E402
from kvflash import cli  # noqa: E402
from kvflash.session import PrefillProgress  # noqa: E402


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "small.gguf"
    write_tiny_chat_model(p, seed=7)
    return str(p)


def _session(small, **kw):
    kw.setdefault("kvflash", 512)
    return kvflash.Session(small, max_ctx=4096, policy=kw.pop("policy", "qk"), threads=1, verbose=False, **kw)


def _ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def test_prefill_reports_progress_per_piece_and_once_finished(small):
    s = _session(small)
    seen = []
    assert s.prefill(_ids(2000), progress=seen.append) == 2000
    assert all(isinstance(p, PrefillProgress) for p in seen)
    done = [p.done for p in seen]
    # while it fits the pool one ubatch (512), then 64-token pieces with live eviction; the final report last
    assert done[0] == 512 and done[-2] == done[-1] == 2000 and done == sorted(done), done
    assert [p.finished for p in seen] == [False] * (len(seen) - 1) + [True]
    assert all(p.total == 2000 for p in seen) and len(seen) > 10
    assert seen[0].page_outs == 0 and seen[-1].page_outs == s.stats["page_outs"] > 0
    assert seen[-1].tok_s > 0 and seen[-1].eta_s == 0 and seen[len(seen) // 2].eta_s > 0
    line = seen[len(seen) // 2].line()
    assert line.startswith(f"prefill {seen[len(seen) // 2].done}/2000 tokens (") and "tok/s, ETA" in line
    assert "page-outs" in seen[-1].line() and "ETA" not in seen[-1].line()


def test_a_progress_hook_that_raises_ends_the_prefill_with_nothing_kept(small):
    s = _session(small)
    s.prefill(_ids(100, 1))
    before = (s.n_past, list(s.tokens), s.logits())

    def stop_at_1000(p):
        if p.done >= 1000:
            raise KeyError("enough")

    with pytest.raises(KeyError, match="enough"):
        s.prefill(_ids(2000), progress=stop_at_1000)
    assert (s.n_past, list(s.tokens)) == before[:2]
    np.testing.assert_array_equal(s.logits(), before[2])
    s.pager.check_invariants()
    with pytest.raises(TypeError, match="progress"):
        s.prefill(_ids(10), progress="loud")
    assert s.n_past == 100


def test_generate_and_chat_pass_progress_to_their_prefill(small):
    s = _session(small, kvflash=None, policy="lru")
    seen = []
    list(s.generate(_ids(700, 2), max_tokens=2, progress=seen.append))
    assert seen[-1].finished and seen[-1].total == 700
    seen.clear()
    list(s.chat([{"role": "user", "content": "hello " * 50}], max_tokens=1, progress=seen.append))
    assert seen and seen[-1].finished


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_printer_rewrites_one_line_on_a_terminal_and_is_silent_for_short_prompts():
    tty = _Tty()
    pr = cli.PrefillPrinter(tty)
    pr(PrefillProgress(64, 128, 0.1, 0, False))
    pr(PrefillProgress(128, 128, 0.2, 0, True))
    assert tty.getvalue() == ""   # under half a second: nothing
    pr = cli.PrefillPrinter(tty)
    for i in range(1, 9):
        pr(PrefillProgress(i * 100, 800, 0.5 + i * 0.3, i, False))
    pr(PrefillProgress(800, 800, 3.2, 8, True))
    out = tty.getvalue()
    assert out.startswith("\r[kvflash] prefill 100/800 tokens (12%)") and out.endswith(" 8 page-outs\x1b[K\n")
    assert out.count("\n") == 1 and out.count("\r") == 9, out   # every 0.25 s at most: each of these
    log = io.StringIO()
    pr = cli.PrefillPrinter(log)
    for i in range(1, 30):
        pr(PrefillProgress(i * 10, 300, i * 0.5, 0, False))
    pr(PrefillProgress(300, 300, 15.0, 0, True))
    lines = log.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("[kvflash] prefill 300/300 tokens (100%) in 15.0 s"), lines


def _kvflash(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "kvflash", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_generate_reads_the_prompt_from_a_file_or_stdin(small, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox " * 150)
    common = ["-m", small, "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1", "-n", "4", "--temp", "0"]
    a = _kvflash("generate", *common, "-f", str(doc), "--progress")
    assert a.returncode == 0, a.stderr
    assert "[kvflash] prefill " in a.stderr and "tokens (100%)" in a.stderr   # --progress with stderr not a TTY
    b = _kvflash("generate", *common, "-f", "-", stdin=doc.read_text())
    assert b.returncode == 0 and b.stdout == a.stdout, (a.stdout, b.stdout, b.stderr)
    assert "[kvflash] prefill" not in b.stderr   # not a terminal, no --progress: quiet
    c = _kvflash("generate", *common, doc.read_text())
    assert c.stdout == a.stdout   # the same prompt as an argument


@pytest.mark.parametrize("args, msg", [
    (["-f", "/nonexistent/doc.txt"], "/nonexistent/doc.txt: No such file or directory"),
    (["-f", "{dir}"], "Is a directory"),
    (["-f", "{bin}"], "not UTF-8 text"),
    (["-f", "{empty}"], "the prompt is empty"),
    ([], "a prompt or -f FILE"),
    (["-f", "{empty}", "hello"], "a prompt or -f FILE"),
])
def test_a_bad_prompt_file_is_one_line(small, tmp_path, capsys, args, msg):
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "empty").write_text("")
    args = [a.format(dir=tmp_path, bin=tmp_path / "bin", empty=tmp_path / "empty") for a in args]
    assert cli.main(["generate", "-m", small, "-t", "1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and err.startswith("kvflash: ") and "\n" not in err, err


def test_chat_about_a_file_reads_it_before_the_first_question(small, tmp_path):
    doc = tmp_path / "notes.txt"
    doc.write_text("A note about the mill and the river. " * 80)
    r = _kvflash("chat", "-m", small, "--kvflash", "512", "--kvflash-policy", "lru", "-t", "1", "-n", "3",
                 "--file", str(doc), stdin="What is it about?\n")
    assert r.returncode == 0, r.stderr
    assert f"[kvflash] {doc}: " in r.stderr and "tokens in context; ask about it" in r.stderr
    assert r.stdout.startswith("> ")
    r = _kvflash("chat", "-m", small, "-t", "1", "--file", str(tmp_path / "missing.txt"), stdin="")
    assert r.returncode == 2 and r.stderr.strip().endswith("missing.txt: No such file or directory"), r.stderr


def test_prefill_rescore_from_the_command_line(small, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    common = ["generate", "-m", small, "--kvflash", "512", "--kvflash-policy", "qk", "-t", "1", "-n", "2", "--temp",
              "0", "-f", str(doc)]
    assert cli.main([*common, "--kvflash-prefill-rescore", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "prefill_rescore must be an integer >= 0" in err and err.startswith("kvflash: ") and "\n" not in err, err
    assert cli.main([*common, "--kvflash-prefill-rescore", "1"]) == 0


def test_exact_prefill_flag_defaults_to_auto():
    """--kvflash-exact-prefill: 'auto' when absent (Session's 'auto': up to the core's cap, longer where the
    model's paged layers are few), 'on' as a bare flag, 'on' / 'off' / 'auto' spelled out; anything else is refused by the parser."""
    import argparse

    from kvflash._args import exact_prefill_arg

    p = argparse.ArgumentParser()
    cli._session_args(p)
    assert exact_prefill_arg(p.parse_args([]).kvflash_exact_prefill) == "auto"
    assert exact_prefill_arg(p.parse_args(["--kvflash-exact-prefill"]).kvflash_exact_prefill) is True
    for v, want in (("on", True), ("off", False), ("auto", "auto")):
        assert exact_prefill_arg(p.parse_args(["--kvflash-exact-prefill", v]).kvflash_exact_prefill) == want
    with pytest.raises(SystemExit):
        p.parse_args(["--kvflash-exact-prefill", "maybe"])
    with pytest.raises(SystemExit, match="must be 'on', 'off' or 'auto'"):
        exact_prefill_arg("maybe")


def test_chunk_tokens_flag_defaults_to_auto(small, capsys):
    """--kvflash-chunk-tokens: 'auto' when absent, which pages a 512-token pool in 16-token chunks (the core's
    rule: 24 free chunks) and a 2048-token one in 64-token chunks; a number is taken as it is; anything else is
    refused by the parser with a message."""
    import argparse

    p = argparse.ArgumentParser()
    cli._session_args(p)
    assert p.parse_args([]).kvflash_chunk_tokens == "auto"
    assert p.parse_args(["--kvflash-chunk-tokens", "32"]).kvflash_chunk_tokens == 32
    for bad in ("x", "0", "-16"):
        with pytest.raises(SystemExit):
            p.parse_args(["--kvflash-chunk-tokens", bad])
        assert "expected 'auto' or a positive integer" in capsys.readouterr().err
    base = ["-m", str(small), "-t", "1", "--kvflash-policy", "lru", "--max-ctx", "4096", "--no-progress"]
    assert cli._make_session(p.parse_args([*base, "--kvflash", "512"])).chunk_tokens == 16
    assert cli._make_session(p.parse_args([*base, "--kvflash", "2048"])).chunk_tokens == 64
    assert cli._make_session(p.parse_args([*base, "--kvflash", "512", "--kvflash-chunk-tokens", "64"])).chunk_tokens == 64
