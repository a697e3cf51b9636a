"""The bench's load routine (issue 36) end to end on a tiny model: a few clients for a few seconds, good and
bad requests mixed; every good one completes, every bad one gets its 4xx, the server's RSS is reported."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("kvflash._core")
pytest.importorskip("gguf")
pytest.importorskip("httpx")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tinygguf import write_tiny_model  # noqa: E402

from kvflash.bench import cli  # noqa: E402


def test_load_routine(tmp_path, capsys):
    model = tmp_path / "tiny.gguf"
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    write_tiny_model(model, "llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, weight_type="f32",
                     seed=3, extra={"tokenizer.chat_template": template})
    out = tmp_path / "load"
    argv = ["load", "--model", str(model), "--pool", "512", "--threads", "1", "--contexts", "1024", "--seconds", "6",
            "--clients", "3", "--parallel", "2", "--client-prompt", "60", "--client-tokens", "4", "-o", "json",
            "--out", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert (out / "table.md").is_file() and (out / "machine.json").is_file()
    res = data["results"][0]
    rows = {r["what"]: r for r in res["rows"]}
    good, bad = rows["all good requests"], rows["all bad requests"]
    assert good["n"] > 0 and good["wrong"] == 0 and good["as_expected"] == good["n"], res["notes"]
    assert bad["n"] > 0 and bad["wrong"] == 0, res["notes"]
    assert 0 < good["ttft_p50"] <= good["ttft_p95"]
    start, end, peak = (float(x) for x in good["rss"].split(" / "))
    assert 0 < start <= peak and end <= peak
    kinds = {r["kind"] for r in res["raw"]}
    assert {"completion stream", "chat"} <= kinds and len(kinds - {"completion", "completion stream", "chat",
                                                                   "chat stream"}) >= 2
    assert all(r["ok"] for r in res["raw"])
    assert data["machine"]["kvflash_commit"] and data["config"]["argv"] == argv
