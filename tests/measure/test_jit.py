"""JIT compile counting. On the CPU machine (interpreter) counting is unsupported and must say so; the hook
mechanics (chaining, restoring, nesting, keys, disk-cache detection) are driven with the keyword arguments Triton
passes its hooks; the real compile counting runs on a GPU (@pytest.mark.gpu)."""

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JitFunctionInfo

from moebench.measure import jit as jitmod
from moebench.measure.jit import JitCounter, triton_cache_dir

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=keep) * factor, mask=keep)


def _launch(x, out, block):
    _scale_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), 3.0, BLOCK=block)


# ------------------------------------------------------------------------------------------------ interpreter


@pytest.mark.skipif(not INTERPRETING, reason="checks the interpreter's behaviour")
def test_unsupported_under_interpreter_says_so():
    assert JitCounter.supported is False
    x = torch.randn(100)
    out = torch.full_like(x, float("nan"))
    with JitCounter() as counter:
        assert counter.supported is False
        _launch(x, out, 32)  # runs, interpreted: no compile, no hook
    torch.testing.assert_close(out, x * 3.0)
    assert counter.count is None and counter.seconds is None
    s = counter.summary()
    assert s["supported"] is False and s["compiles"] == "unsupported" and s["compile_s"] == "unsupported"
    assert "TRITON_INTERPRET" in s["reason"] and s["cache_dir"] == triton_cache_dir()
    json.dumps(s)


def test_triton_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_dir() == str(tmp_path)


# ------------------------------------------------------------------------------------------------ hook mechanics


def _fake_call(jit_function, key=("spec", "opts"), block=64, warmup=False, device=0):
    """The keyword arguments Triton's JITFunction._call_hook passes (triton 3.6 and 3.9)."""
    compile_info = {"key": key, "signature": {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "factor": "fp32",
                                              "BLOCK": "constexpr"},
                    "device": device, "constants": {(4,): block}, "num_warps": 4, "num_ctas": 1, "num_stages": 3,
                    "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}],
                    "is_warmup": warmup}
    return dict(key=key, repr="_scale_kernel[...]", fn=JitFunctionInfo("tests.test_jit", "_scale_kernel", jit_function),
                compile=compile_info, is_manual_warmup=warmup, already_compiled=False)


def _fake_jit_function(kernels=None):
    return SimpleNamespace(arg_names=["x_ptr", "out_ptr", "n", "factor", "BLOCK"],
                           device_caches={0: (kernels or {}, None, None, None, None)})


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Counting as on a GPU process (hooks fire): the mechanics below call the hooks the way Triton does."""
    monkeypatch.setattr(jitmod, "unsupported_reason", lambda: None)
    rt = triton.knobs.runtime
    saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    yield rt
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _compile(rt, kwargs, seconds=0.0):
    assert not rt.jit_cache_hook(**kwargs)
    if seconds:
        time.sleep(seconds)
    rt.jit_post_compile_hook(**kwargs)


def test_records_name_key_time_and_warmup(pretend_gpu):
    rt = pretend_gpu
    fn = _fake_jit_function()
    before = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    with JitCounter() as counter:
        assert rt.jit_cache_hook == counter._cache_hook and rt.jit_post_compile_hook == counter._post_hook
        _compile(rt, _fake_call(fn, key=("a",), block=64), seconds=0.02)
        _compile(rt, _fake_call(fn, key=("b",), block=128, warmup=True))
    assert counter.count == 2
    e0, e1 = counter.events
    assert e0.kernel == "_scale_kernel" and e0.module == "tests.test_jit"
    assert e0.key == "BLOCK=64 | x_ptr:*fp32%16, out_ptr:*fp32%16, n:i32, factor:fp32 | w4 s3"
    assert e1.key.startswith("BLOCK=128 |") and e1.warmup and not e0.warmup
    assert e0.compile_s >= 0.02 and counter.seconds >= 0.02
    assert e0.disk_cache_hit is None  # no compiled kernel to inspect: cannot tell
    s = counter.summary()
    assert s["supported"] and s["compiles"] == 2 and s["warmup_compiles"] == 1 and s["disk_cache_unknown"] == 2
    assert s["per_kernel"] == {"_scale_kernel": 2} and [k["key"] for k in s["kernels"]] == [e0.key, e1.key]
    json.dumps(s)
    assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == before


def test_chains_to_previous_hooks_and_restores_them(pretend_gpu):
    rt = pretend_gpu
    seen = []

    def prev_cache(**kw):
        seen.append(("cache", kw["key"]))
        return None

    def prev_post(**kw):
        seen.append(("post", kw["key"]))

    rt.jit_cache_hook, rt.jit_post_compile_hook = prev_cache, prev_post
    fn = _fake_jit_function()
    with JitCounter() as outer:
        with JitCounter() as inner:
            _compile(rt, _fake_call(fn, key=("k1",)))
        assert rt.jit_cache_hook == outer._cache_hook  # inner put the outer's hooks back
        _compile(rt, _fake_call(fn, key=("k2",)))
    assert rt.jit_cache_hook is prev_cache and rt.jit_post_compile_hook is prev_post
    assert inner.count == 1 and outer.count == 2
    assert seen == [("cache", ("k1",)), ("post", ("k1",)), ("cache", ("k2",)), ("post", ("k2",))]


def test_exit_out_of_order_keeps_the_newer_hook(pretend_gpu):
    rt = pretend_gpu
    seen = []
    rt.jit_cache_hook = lambda **kw: seen.append(kw["key"])
    original = rt.jit_cache_hook
    fn = _fake_jit_function()
    outer = JitCounter().__enter__()
    inner = JitCounter().__enter__()
    outer.__exit__(None, None, None)  # not the innermost: must not pull the inner counter's hook out
    assert rt.jit_cache_hook == inner._cache_hook
    _compile(rt, _fake_call(fn, key=("k",)))
    inner.__exit__(None, None, None)
    assert inner.count == 1 and outer.count == 0
    rt.jit_cache_hook(**_fake_call(fn, key=("later",)))  # the stale outer hook only forwards now
    assert seen == [("k",), ("later",)] and outer.count == 0 and original is not None


def test_previous_hook_skipping_the_compile_is_not_counted(pretend_gpu):
    rt = pretend_gpu
    rt.jit_cache_hook = lambda **kw: True  # e.g. a hook that only collects specialisations
    with JitCounter() as counter:
        assert rt.jit_cache_hook(**_fake_call(_fake_jit_function())) is True  # passed through: Triton skips
    assert counter.count == 0


def test_failed_compile_is_listed_not_counted(pretend_gpu):
    rt = pretend_gpu
    fn = _fake_jit_function()
    with JitCounter() as counter:
        rt.jit_cache_hook(**_fake_call(fn, key=("broken",)))  # the compile raises: no post hook
        _compile(rt, _fake_call(fn, key=("fine",)))
    assert counter.count == 1
    s = counter.summary()
    assert s["compiles"] == 1 and s["failed_compiles"] == 1
    assert [k["completed"] for k in s["kernels"]] == [True, False]


def test_hooks_after_exit_do_not_record(pretend_gpu):
    rt = pretend_gpu
    with JitCounter() as counter:
        hook = rt.jit_cache_hook
    hook(**_fake_call(_fake_jit_function()))
    assert counter.events == []


def test_disk_cache_hit_from_entry_age(pretend_gpu, monkeypatch, tmp_path):
    rt = pretend_gpu
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    old_hash, new_hash = "ab" * 32, "cd" * 32
    fn = _fake_jit_function({("old",): SimpleNamespace(hash=old_hash), ("new",): SimpleNamespace(hash=new_hash)})
    old_entry = tmp_path / jitmod._base32(old_hash)
    old_entry.mkdir()
    (old_entry / "k.cubin").write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old_entry / "k.cubin", (past, past))
    with JitCounter() as counter:
        _compile(rt, _fake_call(fn, key=("old",)))  # entry older than the compile: loaded from disk
        kw = _fake_call(fn, key=("new",))
        rt.jit_cache_hook(**kw)
        new_entry = tmp_path / jitmod._base32(new_hash)  # written during the compile: built
        new_entry.mkdir()
        (new_entry / "k.cubin").write_bytes(b"y")
        rt.jit_post_compile_hook(**kw)
    assert [e.disk_cache_hit for e in counter.events] == [True, False]
    assert counter.summary()["disk_cache_hits"] == 1


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_compiles_once_per_constexpr_value(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold disk cache: every first compile is built
    assert JitCounter.supported
    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    _scale_kernel.device_caches.clear()  # forget compiles of earlier tests
    with JitCounter() as counter:
        _launch(x, out, 64)
        assert counter.count == 1
        _launch(x, out, 64)  # same specialisation: cached in memory
        assert counter.count == 1
        _launch(x, out, 128)
        assert counter.count == 2
        _launch(x, out, 128)
        _launch(x, out, 64)
        assert counter.count == 2
        _scale_kernel.warmup(x, out, x.numel(), 3.0, BLOCK=256, grid=(1,))
        assert counter.count == 3
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 3.0)
    e = counter.events
    assert [ev.kernel for ev in e] == ["_scale_kernel"] * 3
    assert [ev.key.split(" | ")[0] for ev in e] == ["BLOCK=64", "BLOCK=128", "BLOCK=256"]
    assert [ev.warmup for ev in e] == [False, False, True]
    assert all(ev.compile_s > 0 for ev in e) and [ev.disk_cache_hit for ev in e] == [False, False, False]
    s = counter.summary()
    assert s["compiles"] == 3 and s["compile_s"] > 0 and s["cache_dir"] == str(tmp_path)

    # The in-memory cache forgotten, the same specialisation comes back from the disk cache: still a compile.
    _scale_kernel.device_caches.clear()
    with JitCounter() as again:
        _launch(x, out, 64)
    assert again.count == 1 and again.events[0].disk_cache_hit is True
