"""The ``kvflash`` command line: generate, chat, bench, models."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ._args import chunk_tokens_arg, exact_prefill_arg
from ._args import pool_arg as _pool_arg


def _session_args(p: argparse.ArgumentParser, model_flag: bool = True) -> None:
    if model_flag:
        p.add_argument("-m", "--model", default=None, help="model name (see `kvflash models`) or GGUF path")
    p.add_argument("--max-ctx", type=int, default=None, help="logical context (default: the model's trained one)")
    p.add_argument("--kvflash", default="auto", help="pool size in tokens, 'auto', or 'off' for the full cache")
    p.add_argument("--kvflash-policy", default="qk",
                   help="qk (the default: the model's own queries score chunks) | drafter (a second GGUF scores them: "
                   "--prefill-drafter, else one found beside the model, else qk) | lru | qk-bound | qk-mean")
    p.add_argument("--kvflash-tau", type=int, default=64, help="decoded tokens between rescores (minimum)")
    p.add_argument("--kvflash-exact", action="store_true", help="exact mode: draft over the pool, verify each "
                   "round over the whole context (pool and host store), so the output is the full cache's (CPU)")
    p.add_argument("--kvflash-exact-prefill", nargs="?", const="on", default="auto", choices=["on", "off", "auto"],
                   help="prompts attend the whole context (pool and host store) as the full cache's prefill does, so "
                   "every chunk's K/V are exact; decode reads the pool (CPU). auto (the default): on up to position 16384 "
                   "where the model's paged layers are at most a quarter of its layers, up to 4096 elsewhere; the "
                   "flag alone: on")
    p.add_argument("--kvflash-chunk-tokens", type=chunk_tokens_arg, default="auto", metavar="N|auto",
                   help="paging granularity in tokens; auto (the default): the largest of 64, 32, 16 that leaves at "
                   "least 24 chunks of the pool free of the sink and the tail window (a 512-token pool: 16, 1024: "
                   "32, 2048 and up: 64)")
    p.add_argument("--kvflash-prefill-rescore", type=int, default=0, metavar="N",
                   help="qk policies: rescore every N pooled pieces while a prompt is read, so later pieces attend "
                   "the chunks the latest piece ranks highest beside the recent half of the pool (0: off)")
    p.add_argument("--kvflash-prefill-reread", action="store_true",
                   help="scoring policies: when a prompt outgrew the pool, read the chunks its settle chose again in "
                   "place over the whole context (pool and host store), so decode attends their exact K/V (CPU)")
    p.add_argument("--prefill-drafter", default=None, help="drafter GGUF for the drafter policy")
    p.add_argument("--kv-type", default="q8_0", choices=["f16", "q8_0", "q4_0"])
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--allow-long-ctx", action="store_true", help="allow max_ctx above the trained context")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | vulkan[:N] (auto: a GPU when this build "
                   "has its backend and a device is visible, CUDA before Vulkan; else the CPU)")
    p.add_argument("--rpc", default=None, help="host:port[,host:port...]: run contiguous layer ranges on these "
                   "`kvflash rpc-server`s (their weights and pool slices live there; the protocol has no "
                   "authentication: trusted networks only)")
    p.add_argument("--tensor-split", default=None, help="layer shares for --rpc, comma-separated: one per server, "
                   "optionally one more for this process (the last layers); default: equal, none local")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="prefill progress on stderr (tokens, tok/s, ETA, page-outs); default: when stderr is a terminal")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no prefill progress")


def _bytes_arg(value: str) -> int:
    """A byte count: an integer, optionally with K, M, G or T (powers of 1024), e.g. 8M."""
    v = value.strip().upper()
    if v.endswith("B"):
        v = v[:-1]
    mult = 1
    if v and v[-1] in "KMGT":
        mult = 1024 ** ("KMGT".index(v[-1]) + 1)
        v = v[:-1]
    try:
        return int(float(v) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 8388608 or 8M, got {value!r}") from None


def _make_session(a):
    from . import DEFAULT_MODEL, Session
    return Session(a.model or DEFAULT_MODEL, max_ctx=a.max_ctx, kvflash=_pool_arg(a.kvflash), policy=a.kvflash_policy,
                   drafter=a.prefill_drafter, tau=a.kvflash_tau, kv_type=a.kv_type, threads=a.threads,
                   seed=a.seed, allow_long_ctx=a.allow_long_ctx, device=a.device, exact=a.kvflash_exact,
                   exact_prefill=exact_prefill_arg(a.kvflash_exact_prefill), prefill_rescore=a.kvflash_prefill_rescore,
                   prefill_reread=a.kvflash_prefill_reread, chunk_tokens=a.kvflash_chunk_tokens,
                   rpc=a.rpc,
                   tensor_split=a.tensor_split)


def _read_text(path: str) -> str:
    """A prompt file's text (``-`` reads stdin); a missing or unreadable file is a one-line error."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None


class PrefillPrinter:
    """Prefill progress on stderr: one line rewritten in place on a terminal, a line every few seconds in a
    log; silent for prompts that take under ``quiet_under_s`` (half a second; 0 when --progress asked for it).
    Called with a ``PrefillProgress``."""

    def __init__(self, stream=None, every_s: Optional[float] = None, quiet_under_s: float = 0.5):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (0.25 if self.tty else 5.0)
        self.quiet_under_s = quiet_under_s
        self._last = None   # elapsed_s of the last line shown

    def __call__(self, p) -> None:
        early = p.elapsed_s < self.quiet_under_s
        if not p.finished and (early or (self._last is not None and p.elapsed_s - self._last < self.every_s)):
            return
        if p.finished and self._last is None and early:
            return
        self._last = p.elapsed_s
        line = "[kvflash] " + p.line()
        self.stream.write(("\r" + line + "\x1b[K" + ("\n" if p.finished else "")) if self.tty else line + "\n")
        self.stream.flush()


def _progress_for(a):
    """The prefill progress hook the flags ask for: --progress / --no-progress, else on when stderr is a TTY."""
    if a.progress is None:
        return PrefillPrinter() if sys.stderr.isatty() else None
    return PrefillPrinter(quiet_under_s=0.0) if a.progress else None


def _say_why_it_stopped(s) -> None:
    """Generation that ran out of context says so (stderr) rather than just stopping."""
    if s.finish_reason == "max_ctx":
        print(f"[kvflash] stopped: the context is full (max_ctx {s.max_ctx} tokens); raise --max-ctx",
              file=sys.stderr)


_PATH_FLAGS = {
    "--cmake-dir": ("cmake_dir", "the CMake package directory (find_package(kvflash CONFIG): -Dkvflash_DIR=...)"),
    "--pkgconfig-dir": ("pkgconfig_dir", "the directory with kvflash.pc (PKG_CONFIG_PATH)"),
    "--include-dir": ("include_dir", "the directory with kvflash.h"),
    "--lib-dir": ("lib_dir", "the directory with libkvflash.so"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0] in _PATH_FLAGS:
        from . import capi
        try:
            capi.check_installed()
        except FileNotFoundError as e:
            print(f"kvflash: {e}", file=sys.stderr)
            return 2
        print(getattr(capi, _PATH_FLAGS[argv[0]][0])())
        return 0
    if argv and argv[0] == "bench":
        from .bench import main as bench_main
        return bench_main(argv[1:]) or 0
    ap = argparse.ArgumentParser(prog="kvflash", description="Long-context local inference with a paged KV pool.",
                                 epilog="For C/C++: " + "; ".join(f"{k}: {v[1]}" for k, v in _PATH_FLAGS.items()))
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    _session_args(g)
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (or -f FILE)")
    g.add_argument("-f", "--file", default=None, help="read the prompt from FILE ('-': stdin)")
    g.add_argument("-n", "--max-tokens", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stats", action="store_true", help="print the session stats at the end (stderr)")
    c = sub.add_parser("chat", help="interactive chat on stdin")
    _session_args(c)
    c.add_argument("-n", "--max-tokens", type=int, default=512)
    c.add_argument("--file", default=None, help="a document to chat about: read into the context before the first "
                   "question, which is asked about it ('-': stdin; the questions then need a terminal)")
    sub.add_parser("models", help="list the models kvflash can fetch by name")
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    sv.add_argument("model", help="model name (see `kvflash models`) or GGUF path")
    _session_args(sv, model_flag=False)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs an API key)")
    sv.add_argument("--port", type=int, default=8080)
    sv.add_argument("--parallel", type=int, default=1, help="slots: sessions over the one model, a pool each")
    sv.add_argument("--slot-save-path", default=None, help="directory for POST /slots/{id}?action=save|restore")
    sv.add_argument("--slot-save-max-files", type=int, default=64,
                    help="snapshots kept in --slot-save-path at most; a save past it is refused (default 64; 0: no limit)")
    sv.add_argument("--slot-save-max-bytes", type=_bytes_arg, default=8 << 30,
                    help="bytes of snapshots in --slot-save-path at most (e.g. 8G, the default; 0: no limit)")
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health); on the "
                    "command line it shows in ps: prefer --api-key-file or KVFLASH_API_KEY")
    sv.add_argument("--api-key-file", default=None, help="read the API key(s) from this file, one per line")
    sv.add_argument("--alias", default=None, help="the model's name in the API (default: the file's stem)")
    sv.add_argument("-n", "--n-predict", type=int, default=-1,
                    help="max_tokens a request may ask for, at most (-1, the default: max_ctx); above it: 400")
    sv.add_argument("--max-body-bytes", type=_bytes_arg, default=8 << 20,
                    help="largest request body (default 8M); larger: 413")
    sv.add_argument("--max-queue", type=int, default=16,
                    help="requests waiting for a busy slot, at most (default 16); one more gets 503 with Retry-After")
    sv.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a request may take from its arrival, the wait for a slot included (default 600; "
                         "0: none); past it: 504, or an error event in a stream")
    sv.add_argument("--limit-concurrency", type=int, default=None,
                    help="open connections and requests at most, past which uvicorn answers 503 "
                         "(default: --parallel + --max-queue + 32)")
    sv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                    help="a Host name to answer to besides loopback and the bound address (repeatable; '*': any). "
                         "Others get 403 (DNS rebinding)")
    sv.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                    help="a web origin (https://app.example) whose pages may call the server (repeatable; '*': any); "
                         "requests from other origins get 403")
    sv.add_argument("--ssl-key-file", default=None, help="TLS private key (PEM), with --ssl-cert-file")
    sv.add_argument("--ssl-cert-file", default=None, help="TLS certificate chain (PEM), with --ssl-key-file")
    rp = sub.add_parser("rpc-server", help="lend this machine's CPU to a client over ggml's RPC protocol "
                                           "(no authentication: loopback or trusted networks only)")
    rp.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs --allow-remote)")
    rp.add_argument("--port", type=int, default=50052)
    rp.add_argument("--threads", type=int, default=0, help="compute threads (0: every core)")
    rp.add_argument("--cache-dir", default=None, help="a directory where clients' large tensors are cached by hash")
    rp.add_argument("--allow-remote", action="store_true",
                    help="serve a non-loopback address (anyone who reaches it can run graphs on this machine)")
    sub.add_parser("bench", help="benchmarks (see `kvflash bench --help`)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "models":
            from .models import format_models, list_models
            print(format_models(list_models()))
            return 0
        if a.cmd == "serve":
            from .server import serve
            return serve(a)
        if a.cmd == "rpc-server":
            from .rpc import serve as rpc_serve
            return rpc_serve(a)
        if a.cmd == "generate":
            if (a.prompt is None) == (a.file is None):
                raise ValueError("generate takes a prompt or -f FILE (one of them)")
            prompt = a.prompt if a.file is None else _read_text(a.file)
            if not prompt:
                raise ValueError(f"{a.file}: the prompt is empty")
        doc = _read_text(a.file) if a.cmd == "chat" and a.file is not None else None
        s = _make_session(a)
        progress = _progress_for(a)
        if a.cmd == "generate":
            kw = dict(max_tokens=a.max_tokens, temperature=a.temp, top_k=a.top_k, top_p=a.top_p, progress=progress)
            it = s.chat([{"role": "user", "content": prompt}], **kw) if a.chat else s.generate(prompt, **kw)
            for piece in it:
                print(piece, end="", flush=True)
            print()
            _say_why_it_stopped(s)
            if a.stats:
                for k, v in s.stats.items():
                    print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}", file=sys.stderr)
            return 0
        if a.cmd == "chat":
            messages = []
            if doc is not None:
                # read the document now, while the first question is typed; that question's turn reuses it
                for _ in s.chat([{"role": "user", "content": doc}], add_generation_prompt=False, max_tokens=0,
                                progress=progress):
                    pass
                print(f"[kvflash] {a.file}: {s.n_past} tokens in context; ask about it", file=sys.stderr)
                if a.file == "-":   # the document came on stdin: the questions come from the terminal
                    try:
                        sys.stdin = open("/dev/tty")
                    except OSError:
                        raise ValueError("chat --file - read the document from stdin; the questions need a "
                                         "terminal (or give the document as a file)") from None
            while True:
                try:
                    line = input("> ")
                except EOFError:
                    return 0
                if not line.strip():
                    continue
                if doc is not None and not messages:
                    line = doc + "\n\n" + line
                messages.append({"role": "user", "content": line})
                reply = ""
                for piece in s.chat(messages, max_tokens=a.max_tokens, progress=progress):
                    reply += piece
                    print(piece, end="", flush=True)
                print()
                _say_why_it_stopped(s)
                messages.append({"role": "assistant", "content": reply})
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"kvflash: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
