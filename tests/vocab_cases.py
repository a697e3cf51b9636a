"""llama.cpp's tokenizer test vectors (ggml-vocab-*.gguf with .inp / .out, from the pinned sdist's models/
directory, fetched by kvflash._registry.vocab_dir()), read as llama.cpp's read_tests reads them: the one
reader tests/test_tokenizer.py and tests/test_vocab_core.py share."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SEP = "\n__ggml_vocab_test__\n"


def _registry():
    # from the source tree's file, as tests/test_tokenizer.py loads its modules (no installed package needed)
    spec = importlib.util.spec_from_file_location("_kvflash_vocab_registry",
                                                  Path(__file__).resolve().parents[1] / "python" / "kvflash" / "_registry.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


try:
    VOCAB_DIR: Path | None = Path(_registry().vocab_dir())
    VOCAB_DIR_ERROR = None
except Exception as e:  # no registry access and nothing cached
    VOCAB_DIR, VOCAB_DIR_ERROR = None, f"{type(e).__name__}: {e}"

needs_vocab = pytest.mark.skipif(VOCAB_DIR is None, reason=f"vocab dir unavailable ({VOCAB_DIR_ERROR})")


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    """(input text, expected ids) pairs of ggml-vocab-NAME."""
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    raw = Path(str(base) + ".inp").read_bytes().decode("utf-8")
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    lines = Path(str(base) + ".out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{name}: {len(inputs)} inputs but {len(lines)} outputs"
    return [(s, [int(x) for x in o.split()]) for s, o in zip(inputs, lines)]
