"""ggml's RPC backend as kvflash uses it (issue 22, first part): the server subcommand on loopback, a
client's HELLO that turns every connection failure into an exception (ggml's own client aborts the
process), bytes through a remote buffer bit-exact, and the guard that keeps kvflash's CPU attention op
away from remote devices."""
from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("gguf")
core = pytest.importorskip("kvflash._core")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_tiny_hybrid, write_tiny_model  # noqa: E402


def _tiny(tmp_path, arch: str, n_layer: int = 2):
    """A tiny random model (gemma3: six layers with a 16-token sliding window, so some layers are global)."""
    kw = dict(n_layer=n_layer, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256)
    if arch == "gemma3":
        kw.update(n_layer=6, gemma_sliding_window=16)
    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch, **kw)
    return str(path), kw["n_layer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    return _start_server()[1]


def test_server_answers_with_its_memory(server):
    free, total = core.rpc_device_memory(server)
    assert total > 0 and 0 < free <= total


def test_bytes_through_a_remote_buffer_are_bit_exact(server):
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()   # 3 MiB: a pool block's worth
    back = core.rpc_round_trip(server, data)
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    assert core.rpc_round_trip(server, b"") == b""


def test_no_server_is_an_exception_not_an_abort():
    port = _free_port()   # nothing listens there
    with pytest.raises(RuntimeError, match="cannot connect"):
        core.rpc_device_memory(f"127.0.0.1:{port}")


def test_something_else_on_the_port_is_an_exception():
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port = lst.getsockname()[1]

    def answer_garbage():
        conn, _ = lst.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer_garbage, daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match="did not answer as a ggml RPC server"):
        core.rpc_device_memory(f"127.0.0.1:{port}")
    t.join(5)
    lst.close()


@pytest.mark.parametrize("bad", ["127.0.0.1", ":50052", "host:0", "host:70000", "host:12ab", "host:"])
def test_endpoints_are_checked(bad):
    with pytest.raises(ValueError, match="rpc endpoint"):
        core.check_rpc_endpoint(bad)


def test_cli_refuses_a_public_bind_without_allow_remote():
    r = subprocess.run([sys.executable, "-m", "kvflash", "rpc-server", "--host", "0.0.0.0", "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no authentication" in r.stderr and "--allow-remote" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvflash", "rpc-server", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--port" in r.stderr


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_custom_attention_op_is_never_sent_to_a_remote_device(tmp_path, arch):
    path, _ = _tiny(tmp_path, arch)
    m = core.Model(path, n_threads=1)
    pooled = core.Runtime(m, max_ctx=512, pool_tokens=256, chunk_tokens=16, attn="pool")
    with pytest.raises(ValueError, match="custom op"):
        pooled.check_rpc_ops(4)
    stock = core.Runtime(m, max_ctx=512, pool_tokens=256, chunk_tokens=16, attn="ggml")
    stock.check_rpc_ops(1)
    stock.check_rpc_ops(4)
    assert stock.n_past == 0 and pooled.n_past == 0


def test_pool_slice_on_a_remote_device_pages_bit_exact(server):
    """A pool whose middle layer lives on the RPC server: chunks written, paged out to the client's host
    store, recalled into other blocks, and read back through the server equal what was written (sha256
    per position), as for the local layers; each page event moves the remote layer's rows over the wire."""
    from kvflash import Pager
    C, L = 16, 3
    p = Pager(pool_tokens=256, max_ctx=1024, n_layers=L, n_embd_k=64, kv_type="q8_0", chunk_tokens=C,
              layer_endpoints=["", server, ""])
    assert p.layer_chunk_bytes == [C * 2 * 68] * L and p.chunk_bytes == sum(p.layer_chunk_bytes)
    with pytest.raises(ValueError, match="not in host memory"):
        p.k_rows(1)
    rng = np.random.default_rng(3)
    want = {}   # (layer, v, pos) -> sha256 of the row
    for pos0 in range(0, 1024, C):
        slots = p.alloc_span(pos0, C)
        assert slots is not None
        for il in range(L):
            for v in (False, True):
                rows = rng.integers(0, 256, (C, 68), dtype=np.uint8)
                p.write_rows(il, slots, rows, v=v)
                for j in range(C):
                    want[(il, v, pos0 + j)] = hashlib.sha256(rows[j].tobytes()).digest()
    assert p.stats["page_outs"] > 0 and p.stats["host_chunks"] > 0
    t = p.chunk_table()
    for c in range(1024 // C):
        if t["block"][c] < 0:
            assert p.recall(c)
        got = {(il, v): p.read_rows(il, v=v) for il in range(L) for v in (False, True)}
        for j in range(C):
            s = p.slot_of(c * C + j)
            for (il, v), rows in got.items():
                assert hashlib.sha256(rows[s].tobytes()).digest() == want[(il, v, c * C + j)], (c, j, il, v)
        t = p.chunk_table()
    assert p.stats["page_ins"] > 0
    p.check_invariants()


# --------------------------------------------------------------------------- layers on RPC servers
def _die_with_parent():
    import ctypes
    import signal
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG


def _start_server(threads: int = 1):
    """A loopback server that lives until this process ends (it dies with it).  Not killed earlier: a model or
    runtime still holding buffers there (a failed test's traceback keeps them) would make ggml's client abort
    when it frees them on a dead server."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvflash", "rpc-server", "--port", str(port), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_parent)
    ep = f"127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            core.rpc_device_memory(ep)
            return proc, ep
        except RuntimeError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"rpc-server on {ep} did not come up")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def two_servers():
    a, b = _start_server(), _start_server()
    return a[1], b[1]


def test_split_layers_follows_tensor_split():
    eps = ["h:1", "h:2"]
    assert core.split_layers(30, eps) == [("h:1", 0, 15), ("h:2", 15, 30)]
    assert core.split_layers(30, eps, [1, 2]) == [("h:1", 0, 10), ("h:2", 10, 30)]
    assert core.split_layers(30, eps, [1, 1, 1]) == [("h:1", 0, 10), ("h:2", 10, 20)]   # the rest stays local
    assert core.split_layers(30, eps, [0, 1]) == [("h:2", 0, 30)]
    for bad, msg in [([1], "2 rpc endpoints"), ([1, -1], ">= 0"), ([0, 0], "sum to zero"),
                     ([1, float("nan")], "finite")]:
        with pytest.raises(ValueError, match=msg):
            core.split_layers(30, eps, bad)
    with pytest.raises(ValueError, match="named twice"):
        core.split_layers(30, ["h:1", "h:1"])
    with pytest.raises(ValueError, match="rpc endpoint"):
        core.split_layers(30, ["nohost"])


def _greedy(rt, prompt, n):
    """Greedy tokens and every step's logits (prompt, then n one-token steps)."""
    logits = [np.array(rt.eval(prompt))]
    toks = []
    for _ in range(n):
        toks.append(int(np.argmax(logits[-1])))
        logits.append(np.array(rt.eval(np.array([toks[-1]], dtype=np.int32))))
    return toks, logits


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_layers_on_two_servers_equal_one_process(tmp_path, two_servers, arch):
    """Layers split over two loopback servers (weights, pool slices and the sliding-window ring there; the
    embedding and head here) give the single process's logits bit for bit with ggml's attention, through
    page-outs of remote pool slices, a qk rescore that recalls chunks into other blocks, and a truncate."""
    path, L = _tiny(tmp_path, arch, n_layer=4)
    # like with like: a server holds its layers mapped (plain kernels), so every weight here is mapped too
    # (repacked interleaves or AMX copies would round differently on CPUs that have them)
    local = core.Model(path, n_threads=1, repack=False)
    remote = core.Model(path, n_threads=1, rpc=list(two_servers), tensor_split=[1, 1, 1], repack=False)
    assert [(r["endpoint"], r["first"], r["last"]) for r in remote.remote_layers] == \
        [(two_servers[0], 0, round(L / 3)), (two_servers[1], round(L / 3), round(2 * L / 3))]
    assert any(p.startswith("RPC " + two_servers[0]) for p in remote.weight_placement)
    prompt = np.random.default_rng(1).integers(1, 200, 600).astype(np.int32)
    runs = []
    for m in (local, remote):
        rt = core.Runtime(m, max_ctx=1024, pool_tokens=256, chunk_tokens=16, attn="ggml", capture_queries=12)
        toks, logits = _greedy(rt, prompt, 12)
        assert rt.pager.stats["page_outs"] > 0
        # the remote layers' share of the scores is computed on their servers (the keys stay there)
        scores = rt.qk_peak_scores((rt.n_past + 15) // 16, n_queries=4, contrast=8, windows=1)   # values, not ranks
        if runs:
            np.testing.assert_allclose(scores, runs[0][2], rtol=2e-4, atol=1e-6)
            assert list(np.argsort(-scores)[:8]) == list(np.argsort(-runs[0][2])[:8])
            scores = runs[0][2]   # the same selection, so the rest compares bit for bit
        rt.pager.reselect(scores)
        t2, l2 = _greedy(rt, np.array([toks[-1]], dtype=np.int32), 8)
        rt.truncate(rt.n_past - 5)
        t3, l3 = _greedy(rt, np.array([3, 4, 5], dtype=np.int32), 4)
        runs.append((toks + t2 + t3, logits + l2 + l3, scores, dict(rt.pager.stats)))
        del rt
    (ta, la, sa, pa), (tb, lb, sb, pb) = runs
    assert pa["page_ins"] > 0 and pb["page_ins"] == pa["page_ins"]
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    del remote


def test_moe_layers_on_two_servers_equal_one_process(tmp_path, two_servers):
    """qwen3moe's routed experts (ggml_mul_mat_id, top-k by argsort) run on the servers that hold their layers:
    the single process's logits bit for bit through paging; a model with recurrent layers is refused clearly."""
    path = write_tiny_hybrid(tmp_path / "moe.gguf", "qwen3moe", seed=3)["path"]
    prompt = np.random.default_rng(2).integers(1, 250, 500).astype(np.int32)
    runs = []
    for kw in ({}, dict(rpc=list(two_servers), tensor_split=[1, 1, 1])):
        m = core.Model(path, n_threads=1, repack=False, **kw)
        rt = core.Runtime(m, max_ctx=1024, pool_tokens=256, chunk_tokens=16, attn="ggml")
        runs.append(_greedy(rt, prompt, 10) + (rt.pager.stats["page_outs"],))
        del rt, m
    (ta, la, pa), (tb, lb, pb) = runs
    assert ta == tb and pa == pb > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    hyb = write_tiny_hybrid(tmp_path / "q35.gguf", "qwen35", seed=3)["path"]
    m = core.Model(hyb, n_threads=1, rpc=[two_servers[0]], repack=False)
    with pytest.raises(ValueError, match="recurrent layers cannot place layers on RPC servers"):
        core.Runtime(m, max_ctx=512, pool_tokens=256, chunk_tokens=16)
    del m


def _layers_of(line: str) -> set:
    """The layer numbers a weight_placement line covers ('..., layers 0-1, 3, token_embd: 2 MiB')."""
    m = re.search(r"layers ((?:\d+(?:-\d+)?(?:, )?)+)", line)
    out = set()
    for r in (m.group(1).rstrip(", ").split(", ") if m else []):
        lo, _, hi = r.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


@pytest.mark.parametrize("wtype", ["q4_0", "q8_0", "f32"])
def test_weight_placement_names_the_kernels_of_every_tensor(tmp_path, two_servers, wtype):
    """Every layer's weights are in a weight_placement line that names the kernels they run: with repack=False
    (or KVFLASH_NO_REPACK=1) ggml-cpu's plain kernels for all; an RPC split names its servers' ranges."""
    path = tmp_path / f"{wtype}.gguf"
    write_tiny_model(path, "llama", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
                     weight_type=wtype)
    plain = core.Model(str(path), n_threads=1, repack=False).weight_placement
    assert len(plain) == 1 and plain[0].startswith("CPU mapped (ggml-cpu's plain kernels), layers 0-3, token_embd")
    default = core.Model(str(path), n_threads=1).weight_placement   # repacked or AMX where this CPU offers it
    covered = set()
    for line in default:
        assert re.search(r"\((.*kernels.*|AMX tiles.*)\)", line), line
        if "one-token copies" not in line:
            covered |= _layers_of(line)
    assert covered == {0, 1, 2, 3}, default
    split = core.Model(str(path), n_threads=1, rpc=list(two_servers), tensor_split=[1, 1, 2], repack=False)
    lines = split.weight_placement
    assert lines[0].startswith("CPU mapped (ggml-cpu's plain kernels), layers 2-3, token_embd"), lines
    for ep, layer, line in zip(two_servers, (0, 1), lines[1:]):
        assert line.startswith(f"RPC {ep}, layers {layer}-{layer} (mapped there: the server's plain CPU kernels)")
    assert len(lines) == 3
    del split


def test_remote_layers_refuse_what_a_server_cannot_run(tmp_path, two_servers):
    path, _ = _tiny(tmp_path, "llama", n_layer=2)
    m = core.Model(path, n_threads=1, rpc=[two_servers[0]])
    with pytest.raises(ValueError, match="RPC server cannot run"):
        core.Runtime(m, max_ctx=512, pool_tokens=256, chunk_tokens=16, attn="pool")
    rt = core.Runtime(m, max_ctx=512, pool_tokens=256, chunk_tokens=16)   # "auto": ggml's attention
    with pytest.raises(ValueError, match="RPC servers"):
        rt.eval(np.array([1, 2, 3], dtype=np.int32), exact=True)
    with pytest.raises(ValueError, match="RPC servers"):
        rt.eval(np.array([1, 2, 3], dtype=np.int32), one_row_products=True)
    assert rt.n_past == 0
    rt.eval(np.array([1, 2, 3], dtype=np.int32))
    assert rt.n_past == 3
    del rt, m


def test_a_server_that_is_not_there_fails_the_load_not_the_process(tmp_path):
    path, _ = _tiny(tmp_path, "llama", n_layer=2)
    with pytest.raises(RuntimeError, match="cannot connect"):
        core.Model(path, n_threads=1, rpc=[f"127.0.0.1:{_free_port()}"])
    with pytest.raises(ValueError, match="tensor_split"):
        core.Model(path, n_threads=1, rpc=["127.0.0.1:1"], tensor_split=[1, 1, 1])


@pytest.mark.model
def test_smollm2_split_15_15_over_two_servers_greedy_identical():
    """Issue 22's identity figure: SmolLM2-135M, 15 layers on each of two loopback servers, pool 512, a
    prompt longer than the pool: 64 greedy tokens (and their logits) identical to the single process with
    ggml's attention at the same thread count (2 everywhere)."""
    import kvflash
    path = kvflash.resolve_model("smollm2-135m")
    from kvflash.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(path)
    text = ("The weather was calm and the river ran slowly past the old mill. " * 40 +
            "The secret passkey is 48213. Remember it. " +
            "Farmers carried their grain along the road to the market in the valley. " * 25 +
            "\nWhat is the secret passkey? The passkey is")
    prompt = np.array(tok.encode(text), dtype=np.int32)
    assert len(prompt) > 900
    a, b = _start_server(2), _start_server(2)
    # Like with like: the servers multiply by their layers' weights as mapped (ggml-cpu's plain kernels), so the
    # one-process reference keeps every weight mapped too.  On a CPU with AMX (or one whose repack takes Q4_1),
    # the default load would multiply one-token graphs by converted copies that round differently.
    remote = core.Model(str(path), n_threads=2, rpc=[a[1], b[1]], repack=False)
    assert [(r["first"], r["last"]) for r in remote.remote_layers] == [(0, 15), (15, 30)]
    local = core.Model(str(path), n_threads=2, repack=False)
    for m in (local, remote):
        assert all("plain" in line for line in m.weight_placement), m.weight_placement
    out = []
    for m in (local, remote):
        rt = core.Runtime(m, max_ctx=2048, pool_tokens=512, attn="ggml")
        toks, logits = _greedy(rt, prompt, 64)
        out.append((toks, logits, rt.pager.stats["page_outs"]))
        del rt
    del remote   # its weights leave the servers
    (ta, la, pa), (tb, lb, pb) = out
    assert pa > 0 and pb == pa
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kw, msg", [
    (dict(rpc=["127.0.0.1:1"], exact=True), "RPC servers"),
    (dict(rpc="127.0.0.1:1", exact_prefill=True), "RPC servers"),
    (dict(tensor_split=[1, 1]), "needs rpc endpoints"),
    (dict(rpc=["127.0.0.1"]), "rpc endpoint"),
    (dict(rpc=["127.0.0.1:1"], tensor_split="1,x"), "tensor_split must be numbers"),
])
def test_session_checks_its_rpc_arguments_before_loading(kw, msg):
    import kvflash
    with pytest.raises(ValueError, match=msg):
        kvflash.Session("/nonexistent.gguf", verbose=False, **kw)


def test_c_api_loads_a_model_split_over_servers(tmp_path, two_servers):
    """kvflash_model_load_rpc loads over live servers; a dead endpoint, a split of the wrong length and an
    empty endpoint list are error strings, not aborts."""
    import ctypes
    from kvflash import capi
    lib = ctypes.CDLL(str(capi.library_path()))
    V, I32 = ctypes.c_void_p, ctypes.c_int32
    lib.kvflash_model_load_rpc.restype = V
    lib.kvflash_model_load_rpc.argtypes = [ctypes.c_char_p, I32, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float),
                                           ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    lib.kvflash_model_free.argtypes = [V]
    path, _ = _tiny(tmp_path, "llama", n_layer=4)
    err = ctypes.create_string_buffer(512)
    split = (ctypes.c_float * 3)(1, 1, 2)
    m = lib.kvflash_model_load_rpc(path.encode(), 1, ",".join(two_servers).encode(), split, 3, err, 512)
    assert m, err.value.decode()
    lib.kvflash_model_free(m)
    dead = f"127.0.0.1:{_free_port()}".encode()
    assert not lib.kvflash_model_load_rpc(path.encode(), 1, dead, None, 0, err, 512)
    assert b"cannot connect" in err.value
    assert not lib.kvflash_model_load_rpc(path.encode(), 1, two_servers[0].encode(), split, 3, err, 512)
    assert b"tensor_split" in err.value
    assert not lib.kvflash_model_load_rpc(path.encode(), 1, b",", None, 0, err, 512)
    assert b"no endpoint" in err.value
