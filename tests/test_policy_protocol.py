"""The policy protocol (issue 37): one registry for built-ins and a user's policies, a read-only view that is
not the session, requirements the session reads instead of probing, and a swapped policy reconfiguring the
core's scorer."""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

import kvflash
from kvflash import _core
from kvflash.policies import (BasePolicy, ChunkView, Requirements, policy_entry, register_policy,
                              registered_policies, unregister_policy)
from kvflash.scoring import DrafterPolicy, QKPolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygguf import write_small_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_small_llama(tmp_path_factory.mktemp("proto") / "tiny.gguf", seed=3)


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32).tolist()


def _session(path, **kw):
    return kvflash.Session(path, **dict(dict(max_ctx=4096, kvflash=512, tau=16, threads=1, verbose=False), **kw))


class KeepChunk(BasePolicy):
    """A user's policy with one setting: keeps chunk `keep` (and the earlier ones, a little)."""
    name = "test-keep-chunk"
    made = []

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.calls = 0
        KeepChunk.made.append(self)

    def score(self, view):
        self.calls += 1
        s = -np.arange(view.n_chunks, dtype=np.float32) / 100
        s[min(self.keep, view.n_chunks - 1)] = 10.0
        return s

    def spec(self):
        return {"keep": self.keep}


@pytest.fixture
def registered():
    register_policy(KeepChunk.name, KeepChunk, settings={"keep": lambda v: isinstance(v, int) and 0 <= v < 64})
    yield KeepChunk.name
    unregister_policy(KeepChunk.name)


def test_builtins_are_registered_as_a_users_policy_is():
    assert {"lru", "qk", "qk-bound", "qk-mean", "drafter"} <= set(registered_policies())
    assert policy_entry("qk").key == "qk" and policy_entry("drafter").key == "drafter"
    assert policy_entry("lru").settings is None
    with pytest.raises(ValueError, match="registered already"):
        register_policy("qk", QKPolicy)
    with pytest.raises(ValueError, match="factory"):
        register_policy("test-x", 3)
    with pytest.raises(ValueError, match="key"):
        register_policy("test-x", QKPolicy, key="name")


def test_a_registered_user_policy_by_name_and_through_a_snapshot(tiny, tmp_path, registered):
    s = _session(tiny, policy=registered)
    pol = s.policy
    assert isinstance(pol, KeepChunk) and pol.keep == 2 and "policy=test-keep-chunk" in s.banner
    pol.keep = 5
    s.prefill(_tokens(64 * 12, 1))           # outgrows the pool: the post-prompt rescore asks the policy
    assert pol.calls == 1 and s.pager.chunk_table()["block"][5] >= 0
    p = tmp_path / "user.kvsnap"
    s.save(p)
    t = kvflash.Session.load(p, tiny, threads=1)   # by name: the registry's factory with the saved settings
    assert isinstance(t.policy, KeepChunk) and t.policy is not pol and t.policy.keep == 5
    assert t.tokens == s.tokens
    np.testing.assert_array_equal(t.last_scores, s.last_scores)
    a = list(s.generate(max_tokens=24, ignore_eos=True))
    b = list(t.generate(max_tokens=24, ignore_eos=True))
    assert a == b and t.policy.calls >= 1
    # the saved settings are held to the check the name is registered with now
    register_policy(KeepChunk.name, KeepChunk, settings={"keep": lambda v: v < 3}, replace=True)
    with pytest.raises(kvflash.SnapshotError, match=r"policy.settings.keep = 5 is out of range"):
        kvflash.Session.load(p, tiny, threads=1)
    unregister_policy(KeepChunk.name)
    with pytest.raises(kvflash.SnapshotError, match="no policy of that name is registered"):
        kvflash.Session.load(p, tiny, threads=1)
    register_policy(KeepChunk.name, KeepChunk, settings={"keep": lambda v: isinstance(v, int)})


def test_a_registered_policy_whose_factory_refuses_the_settings(tiny, tmp_path, registered):
    s = _session(tiny, policy=KeepChunk(keep=40))
    s.prefill(_tokens(300, 2))
    p = tmp_path / "k.kvsnap"
    s.save(p)

    def picky(keep):
        raise ValueError(f"keep {keep} is not allowed")

    register_policy(KeepChunk.name, picky, settings={"keep": lambda v: True}, replace=True)
    with pytest.raises(kvflash.SnapshotError, match="the policy's settings: keep 40 is not allowed"):
        kvflash.Session.load(p, tiny, threads=1)


def test_a_spec_that_breaks_its_schema_is_refused_at_save(tiny, tmp_path, registered):
    s = _session(tiny, policy=KeepChunk(keep=99))   # outside its registered check
    s.prefill(_tokens(100))
    with pytest.raises(ValueError, match="keep = 99 fails its registered check"):
        s.save(tmp_path / "no.kvsnap")
    assert not (tmp_path / "no.kvsnap").exists()


def test_unknown_names_and_bad_objects_are_refused_clearly(tiny):
    with pytest.raises(ValueError, match="unknown policy 'nope'.*'lru'"):
        _session(tiny, policy="nope")
    with pytest.raises(ValueError, match="score"):
        _session(tiny, policy=object())

    class NoScore(BasePolicy):
        name = "no-score"

    with pytest.raises(ValueError, match="no score"):
        _session(tiny, policy=NoScore())

    class Nameless:
        def score(self, view):
            return None

    with pytest.raises(ValueError, match="name"):
        _session(tiny, policy=Nameless())

    class Legacy:
        name = "legacy"
        n_capture = 40

        def score(self, view):
            return None

    with pytest.raises(ValueError, match="declare requirements"):
        _session(tiny, policy=Legacy())

    class BadReq(Legacy):
        requirements = {"n_capture": 4}

    with pytest.raises(ValueError, match="requirements must be"):
        _session(tiny, policy=BadReq())
    with pytest.raises(ValueError, match="n_capture"):
        Requirements(n_capture=0)
    with pytest.raises(ValueError, match="extra_bytes"):
        Requirements(extra_bytes=-1)


def test_the_view_is_read_only_and_not_the_session(tiny):
    seen = []

    class Look:
        name = "look"
        requirements = Requirements(n_capture=8)

        def score(self, view):
            seen.append(view)
            return None

    s = _session(tiny, policy=Look())
    s.prefill(_tokens(64 * 12, 3))
    view = seen[-1]
    assert not hasattr(view, "session") and not hasattr(view, "runtime")
    assert view.n_chunks == 12 and view.n_past == 64 * 12 and view.chunk_tokens == 64
    np.testing.assert_array_equal(view.tokens, s.tokens)
    for arr in (view.tokens, view.resident, view.protected, view.on_host):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = arr[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.n_chunks = 3
    assert view.on_host.any() and (view.on_host | view.resident).all()   # the prompt outgrew the pool
    # the scorer handles: the core's, read-only
    assert view.n_captured == 8 and view.n_paged_layers == s.runtime.n_paged_layers
    np.testing.assert_array_equal(view.captured_queries(), s.runtime.captured_queries())
    np.testing.assert_array_equal(view.history_attention(n_threads=1), s.runtime.history_attention(n_threads=1))
    data, ends = view.token_bytes()
    want_data, want_ends = s.tokenizer.bytes_of(s.tokens, skip_special=True)
    assert data == want_data and list(ends) == list(want_ends)
    assert view.target.max_ctx == 4096 and view.target.tokenizer is s.tokenizer
    # a view built by hand has no handles: its scorer methods say so
    bare = ChunkView(n_chunks=2, chunk_tokens=64, n_past=100, tokens=np.zeros(100, dtype=np.int32),
                     resident=np.ones(2, dtype=bool), protected=np.zeros(2, dtype=bool), pool_chunks=8)
    assert not bare.on_host.any() and not bare.tokens.flags.writeable
    with pytest.raises(ValueError, match="no scorer handles"):
        bare.history_attention()
    # replace() keeps the handles and makes the new arrays read-only views (the caller's stay writable)
    mine = np.arange(12) % 2 == 0
    v2 = dataclasses.replace(view, resident=mine)
    assert not v2.resident.flags.writeable and mine.flags.writeable and v2.n_captured == 8


def test_swapping_the_policy_reconfigures_the_core(tiny):
    s = _session(tiny, policy="qk")
    s.prefill(_tokens(64 * 12, 4))
    qk_scores = s.last_scores.copy()
    assert s.stats["rescores"] == 1
    keep = KeepChunk(keep=3)
    s.policy = keep                            # the core's peak scorer is replaced by the callback
    s.rescore()
    assert keep.calls == 1 and s.last_scores[3] == 10.0 and s.pager.chunk_table()["block"][3] >= 0
    s.policy = kvflash.LRUPolicy()             # scores nothing: the callback is gone
    s.rescore()
    assert keep.calls == 1
    s.policy = QKPolicy()                      # native again
    s.rescore()
    assert keep.calls == 1 and s.last_scores.shape == qk_scores.shape
    # a policy the runtime was not made for is refused, and the session keeps the one it had
    with pytest.raises(ValueError, match="captures 72"):
        s.policy = QKPolicy(n_queries=64)
    with pytest.raises(ValueError, match="chunk summaries"):
        s.policy = QKPolicy("bound")
    with pytest.raises(ValueError, match="score"):
        s.policy = "lru"
    assert isinstance(s.policy, QKPolicy) and s.policy.n_queries == 8


def test_requirements_of_the_builtins(tiny):
    r = QKPolicy().requirements
    assert r.native is not None and r.n_capture == 72 and not r.chunk_summaries and r.scores
    assert r.native.core_args(30)["n_layers"] == _core.qk_auto_layers(30)
    # every mode and aggregate is the core's scorer (QkScoring), the summary modes with chunk summaries
    assert QKPolicy(aggregate="chunk").requirements.native.core_args(30)["aggregate"] == "chunk"
    assert QKPolicy("mean").requirements.chunk_summaries and QKPolicy("mean").requirements.native.mode == "mean"
    assert not kvflash.LRUPolicy().requirements.scores

    class Tweaked(QKPolicy):                   # overrides score: the core must call it back
        def score(self, view):
            return super().score(view)

    assert Tweaked().requirements.native is None
    d = DrafterPolicy(tiny)
    assert d.requirements.extra_bytes > 0 and d.requirements.n_capture == d.n_queries
    assert "path" not in d.spec()


def test_a_subclassed_qk_scored_through_the_callback_matches_the_core(tiny):
    calls = []

    class Tweaked(QKPolicy):
        def score(self, view):
            calls.append(1)
            return super().score(view)

    toks = _tokens(64 * 12, 5)
    a, b = _session(tiny, policy="qk"), _session(tiny, policy=Tweaked())
    a.prefill(toks)
    b.prefill(toks)
    assert calls == [1]
    np.testing.assert_allclose(a.last_scores, b.last_scores, rtol=1e-6, atol=1e-9)
