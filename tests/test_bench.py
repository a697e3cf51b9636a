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
    ("rescore", ["--contexts", "1024", "--repeats", "1", "--policies", "qk,drafter"]),
    ("ab", ["--contexts", "1024", "--needles", "1", "--repeats", "1", "--steps", "4", "--policy", "qk"]),
    ("memory", ["--contexts", "2048"]),
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
    if routine == "rescore":
        assert "drafter" in text and "qk" in text
    if routine == "memory":
        rows = data["results"][0]["rows"]
        modes = {(r["mode"], r["host"]) for r in rows}
        assert {("full", "-"), ("kvflash", "ram"), ("kvflash", "file")} <= modes, modes
        for r in rows:   # each cell measured in a process of its own
            assert r["rss_mib"] > 0 and r["rss_anon_mib"] > 0 and r["rss_mib"] >= r["rss_anon_mib"]
            if r["mode"] == "kvflash":
                assert r["host_mib"] > 0 and r["host_reserved_mib"] >= r["host_mib"]


def test_bad_arguments_are_clear(tiny, capsys):
    with pytest.raises(SystemExit):
        cli.main(["needle", "--policies", "nope"])
    assert "unknown" in capsys.readouterr().err
