"""Hostile text in a model file (issue 16): a chat template is bounded in size and
steps, SentencePiece merge derivation is not quadratic in a piece's length, and a
model vocabulary larger than the tokenizer's never samples an id it cannot decode.
Cases that ran out of memory or time before run in a child interpreter with limits."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

HOSTILE_TEMPLATES = {
    "string-mul": "{{ 'x' * 10**10 }}",
    "power": "{{ 2 ** (10 ** 10) }}",
    "nested-loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "percent-width": "{{ '%10000000000d' % 1 }}",
    "format-width": "{{ '{:>99999999999}'.format(1) }}",
    "center-filter": "{{ 'a' | center(10**10) }}",
    "format-filter": "{{ '%10000000000s' | format('x') }}",
    "output": "{% for a in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}


def _run_limited(code: str, timeout: int = 60, mem_bytes: int = 3 << 30) -> tuple[int, str]:
    """A child interpreter with an address-space limit (so a runaway allocation is a
    MemoryError there, not this machine's OOM killer) and a time limit."""
    pre = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({mem_bytes}, {mem_bytes})); "
           f"sys.path.insert(0, {HERE!r})\n")
    try:
        r = subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s"
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_chat_template_is_refused(name):
    rc, out = _run_limited(f"""
        import time
        from jinja2.exceptions import SecurityError
        from kvflash.chat_template import ChatTemplates
        t0 = time.perf_counter()
        try:
            ChatTemplates().render({HOSTILE_TEMPLATES[name]!r}, [{{"role": "user", "content": "hi"}}], True, {{}})
            print("RENDERED")
        except SecurityError as e:
            print("SecurityError", e)
        print(f"took {{time.perf_counter() - t0:.1f}} s")
    """)
    assert rc == 0 and "SecurityError chat template refused" in out, (rc, out[-2000:])


def test_ordinary_templates_still_render():
    from kvflash.chat_template import ChatTemplates
    src = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ '%-6s' % 'x' }}{{ '{:>4}'.format(1) }}"
           "{{ 'ab' * 3 }}{{ 2 ** 10 }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    msgs = [{"role": "user", "content": f"m{i} " + "word " * 50} for i in range(2000)]
    out = ChatTemplates().render(src, msgs, True, {})
    assert out.endswith("<|assistant|>") and out.count("<|user|>") == 2000 and "x        1ababab1024" in out


def test_generation_blocks_render_their_body():
    """transformers' {% generation %} block (poolside's Laguna templates) renders its body in the enclosing
    scope, as llama.cpp's template engine treats it; a hostile body inside it is bounded like any other;
    an unclosed block is a template syntax error, not a crash."""
    import jinja2
    from jinja2.exceptions import SecurityError
    from kvflash.chat_template import ChatTemplates
    ct = ChatTemplates()
    src = ("{% for m in messages %}{%- if m.role == 'assistant' -%}{%- generation -%}<a>{{ m.content }}</a>"
           "{%- endgeneration -%}{%- else -%}<u>{{ m.content }}</u>{%- endif -%}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ct.render(src, msgs, False, {}) == "<u>hi</u><a>yo</a>"
    assert ct.render("{% generation %}{% set x = 3 %}{% endgeneration %}{{ x }}", msgs, False, {}) == "3"
    with pytest.raises(SecurityError):
        ct.render("{% generation %}{{ 'x' * 10**10 }}{% endgeneration %}", msgs, False, {})
    with pytest.raises(jinja2.exceptions.TemplateSyntaxError):
        ct.render("{% generation %}unclosed", msgs, False, {})


def test_step_budget_restores_the_previous_tracer():
    from kvflash.chat_template import ChatTemplates
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    sys.settrace(tracer)
    try:
        ChatTemplates().render("{{ messages | length }}", [{"role": "user", "content": "x"}], True, {})
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert seen  # the caller's tracer kept seeing calls outside the template


def test_spm_merges_are_not_quadratic_in_piece_length():
    # One piece of 10^6 characters: deriving its merges was ~5 * 10^11 character copies.  No space prefix:
    # llama.cpp's SentencePiece merges by the merged piece's score, so with one "\u2581a" (-1.0) would
    # outrank "ab" (-1.5) and give [\u2581a, b], as llama.cpp does (the former tokenizers-based encoder did
    # not); without it "ab" is the merge to make.
    rc, out = _run_limited("""
        from kvflash import tokenizer as tk
        tokens = ["<unk>", "<s>", "</s>", "\\u2581a", "a", "b", "ab", "x" * 10**6]
        md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -1.5, -3.0],
              "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1],
              "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
              "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_space_prefix": False}
        t = tk.Tokenizer.from_metadata(md)
        ids = t.encode("ab", add_special=False)
        print("ab merged:", 6 in ids, "decodes", len(t.decode([7])))
    """, timeout=60)
    assert rc == 0 and "ab merged: True" in out and "decodes 1000000" in out, (rc, out[-2000:])


def test_model_vocabulary_past_the_tokenizer_is_never_sampled(tmp_path, monkeypatch):
    # The model has 300 embedding rows, its tokenizer (cut here to the first 266 tokens)
    # fewer: logits that favour the padded rows must not make the stream meet an id the
    # tokenizer cannot decode (StreamDecoder raised IndexError mid-generate).
    import kvflash
    from kvflash import tokenizer as tk
    from kvflash.gguf_metadata import read_gguf_metadata
    from tinygguf import write_tiny_model
    path = tmp_path / "padded.gguf"
    write_tiny_model(path, "llama", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_vocab=300, seed=1)

    def cut(p):
        md = dict(read_gguf_metadata(p, prefix="tokenizer."))
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            md[k] = list(md[k])[:266]
        return tk.Tokenizer.from_metadata(md)

    monkeypatch.setattr(tk.Tokenizer, "from_gguf", staticmethod(cut))
    s = kvflash.Session(str(path), max_ctx=256, kvflash=None, policy="lru", threads=1, verbose=False)
    V = s.tokenizer.n_vocab
    assert V == 266 and s.hparams["n_vocab"] == 300
    logits = np.full(300, -5.0, dtype=np.float32)
    logits[V:] = 10.0  # every padded row far ahead
    for temperature in (0.0, 1.0):
        assert s.runtime.sample(logits, temperature=temperature) < V
    s.prefill([1, 2, 3])
    text = "".join(s.generate(max_tokens=40, temperature=1.5, ignore_eos=True, seed=3))
    assert isinstance(text, str) and s.n_past == len(s.tokens) and all(t < V for t in s.tokens)
