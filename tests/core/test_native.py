"""The one-pass C statistics kernel (``monitor_v2.native``), checked against NumPy in
float64 on the same buffers, and the ways it is built, cached, refused and switched off.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from msprobe.core.monitor_v2 import native

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


@pytest.fixture(scope="module")
def kernel():
    k = native.load()
    assert k is not None, "the one-pass kernel did not build: is a C compiler (gcc) installed?"
    return k


def _expected(values: np.ndarray):
    v = values.astype(np.float64)
    finite_or_inf = v[~np.isnan(v)]
    nans = int(np.isnan(v).sum())
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "min": float("nan") if nans else float(finite_or_inf.min()),
            "max": float("nan") if nans else float(finite_or_inf.max()),
            "sum": float(v.sum()),
            "norm": float(np.sqrt((v * v).sum())),
            "nans": nans,
        }


def _stats(kernel, arr: np.ndarray, code: int, threads: int = 1):
    (mn, mx, total, norm), nans = kernel.stats(arr.ctypes.data, arr.size, code, threads)
    return {"min": mn, "max": mx, "sum": total, "norm": norm, "nans": nans}


def _check(got, want, rel=1e-6):
    assert got["nans"] == want["nans"]
    for op in ("min", "max", "sum", "norm"):
        g, w = got[op], want[op]
        if np.isnan(w) or np.isinf(w):
            assert (np.isnan(g) and np.isnan(w)) or g == w, (op, g, w)
        else:
            scale = max(abs(w), want["norm"] * 1e-3 if op == "sum" else 0.0)
            assert abs(g - w) <= rel * scale + 1e-30, (op, g, w)


# Sizes around the vector width (16), the float block (4096) and the per-thread minimum (2^20).
SIZES = [1, 15, 16, 17, 4095, 4096, 4097, 4096 * 3 + 7, (1 << 20) + 33, 3 * (1 << 20) + 5]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", [1, 3])
def test_float32_matches_numpy(kernel, n, threads):
    arr = (np.random.default_rng(n).standard_normal(n) * 3 + 0.25).astype(np.float32)
    _check(_stats(kernel, arr, native.F32, threads), _expected(arr))


@pytest.mark.parametrize("n", [17, 4097, (1 << 20) + 33])
def test_float16_matches_numpy(kernel, n):
    if native.F16 not in kernel.dtype_codes:
        pytest.fail("this compiler has no _Float16; the engine would use ATen for fp16")
    arr = (np.random.default_rng(n).standard_normal(n) * 50).astype(np.float16)
    _check(_stats(kernel, arr, native.F16), _expected(arr))


@pytest.mark.parametrize("n", [17, 4097, (1 << 20) + 33])
def test_bfloat16_matches_numpy(kernel, n):
    # bf16 is the top half of an fp32 word: truncating fp32 bits gives exact bf16 values.
    f32 = (np.random.default_rng(n).standard_normal(n) * 1e4).astype(np.float32)
    bf16_bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    values = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    _check(_stats(kernel, bf16_bits, native.BF16), _expected(values))


@pytest.mark.parametrize("where", ["first", "vector body", "block edge", "tail", "second thread"])
def test_a_single_nan_is_counted_and_never_hidden(kernel, where):
    n = 2 * (1 << 20) + 21
    arr = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    index = {"first": 0, "vector body": 100, "block edge": 4095, "tail": n - 1, "second thread": n - 5000}[where]
    arr[index] = np.nan
    got = _stats(kernel, arr, native.F32, threads=2)
    assert got["nans"] == 1
    assert all(np.isnan(got[op]) for op in ("min", "max", "sum", "norm"))


def test_infinities_without_nan(kernel):
    arr = np.array([1.0, np.inf, -np.inf, 2.0] * 9, dtype=np.float32)
    got = _stats(kernel, arr, native.F32)
    assert got["min"] == -np.inf and got["max"] == np.inf and got["nans"] == 0
    assert np.isnan(got["sum"]) and got["norm"] == np.inf


@pytest.mark.parametrize("value", [1e18, 1e20, 3e38])
def test_large_values_do_not_overflow_the_float_accumulators(kernel, value):
    # Squares of values above 1.8e19 overflow fp32, and so do 4096-element fp32 block
    # sums of squares above 1e17: such blocks are summed again in double.
    arr = np.full(10_000, value, dtype=np.float32)
    arr[::7] *= -0.5
    got = _stats(kernel, arr, native.F32)
    assert np.isfinite(got["norm"]) and np.isfinite(got["sum"])
    _check(got, _expected(arr), rel=1e-6)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


LOAD_AND_REPORT = (
    "import json, logging; logging.basicConfig(level=logging.INFO)\n"
    "from msprobe.core.monitor_v2 import native\n"
    "k = native.load()\n"
    "print(json.dumps(None if k is None else k.path))\n"
)


@pytest.fixture
def group_writable_umask():
    """A umask of 002 (common on shared machines) for the processes this test starts."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_built_once_per_cache_directory_and_reused(tmp_path, group_writable_umask):
    env = {native.ENV_CACHE: str(tmp_path)}
    first = _run(LOAD_AND_REPORT, env)
    assert first.returncode == 0, first.stderr
    path = json.loads(first.stdout)
    assert path and os.path.dirname(path) == str(tmp_path)
    built = os.stat(path).st_mtime_ns
    second = _run(LOAD_AND_REPORT, env)
    assert json.loads(second.stdout) == path, "our own build is trusted whatever the umask"
    assert os.stat(path).st_mtime_ns == built, "a cached build is reused, not rebuilt"
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


def test_unwritable_cache_directory_builds_in_a_temporary_one(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    result = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(blocker / "cache")})
    assert result.returncode == 0, result.stderr
    path = json.loads(result.stdout)
    assert path and not path.startswith(str(tmp_path))


def test_without_a_compiler_the_reason_is_logged_and_none_returned(tmp_path):
    result = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(tmp_path), "CC": str(tmp_path / "no-such-cc")})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) is None
    assert "one-pass statistics kernel is not used" in result.stderr
    assert "no-such-cc" in result.stderr


def test_a_compiler_error_is_logged_and_none_returned(tmp_path):
    result = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(tmp_path), "CC": "false"})
    assert json.loads(result.stdout) is None
    assert "exited with 1" in result.stderr


def test_switched_off_by_environment_variable(tmp_path):
    result = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(tmp_path), native.ENV_SWITCH: "0"})
    assert json.loads(result.stdout) is None
    assert os.listdir(tmp_path) == [], "nothing is built when switched off"


def test_a_cached_library_others_may_write_is_not_loaded(tmp_path):
    env = {native.ENV_CACHE: str(tmp_path)}
    first = _run(LOAD_AND_REPORT, env)
    path = json.loads(first.stdout)
    os.chmod(path, 0o777)  # as if planted in a shared directory
    second = _run(LOAD_AND_REPORT, env)
    assert second.returncode == 0, second.stderr
    other = json.loads(second.stdout)
    assert other and other != path and not other.startswith(str(tmp_path)), other


LOAD_AND_USE = (
    "import ctypes, json, logging, struct; logging.basicConfig(level=logging.INFO)\n"
    "from msprobe.core.monitor_v2 import native\n"
    "k = native.load()\n"
    "buf = ctypes.create_string_buffer(struct.pack('3f', 1.0, -2.0, 4.0))\n"
    "print(json.dumps([k.path, k.stats(ctypes.addressof(buf), 3, native.F32)[0]]))\n"
)


def _built_name(tmp_path) -> str:
    """The file name the kernel is cached under on this machine (built once in a scratch cache)."""
    scratch = tmp_path / "scratch_cache"
    first = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(scratch)})
    path = json.loads(first.stdout)
    assert path, first.stderr
    return path


def _private_build(tmp_path, cache, extra_env=None):
    """Load with ``cache`` and a private TMPDIR; the kernel must work and leave no
    ``msprobe_native_*`` directory behind."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    res = _run(LOAD_AND_USE, {native.ENV_CACHE: str(cache), "TMPDIR": str(tmp), **(extra_env or {})})
    assert res.returncode == 0, res.stderr
    path, stats = json.loads(res.stdout)
    assert stats == [-2.0, 4.0, 3.0, pytest.approx(21 ** 0.5)]
    assert path.startswith(str(tmp)) and not os.path.exists(path), "built privately, removed once loaded"
    assert os.listdir(tmp) == [], os.listdir(tmp)
    return res


def test_a_link_planted_under_the_cached_name_is_never_followed(tmp_path):
    real = _built_name(tmp_path)  # a good library this user owns: the old check trusted it
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = cache / os.path.basename(real)
    os.symlink(real, planted)
    before = os.stat(real)
    _private_build(tmp_path, cache)
    assert planted.is_symlink() and os.readlink(planted) == real  # left alone
    assert os.stat(real).st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_directory_others_may_write_is_not_used(tmp_path, mode):
    cache = tmp_path / "shared_cache"
    cache.mkdir()
    cache.chmod(mode)
    if os.geteuid() == 0:
        os.chown(cache, -1, 65534)  # a group others are in (nogroup), not the owner's private group
    elif mode == 0o770:
        pytest.skip("needs root to give the directory a group other than this user's private group")
    res = _private_build(tmp_path, cache)
    assert os.listdir(cache) == [], "nothing is built in a directory others can write"
    assert "kernel cache" in res.stderr and "writable by" in res.stderr, res.stderr


def test_a_rejected_cached_library_leaves_no_temporary_directory(tmp_path):
    cache = tmp_path / "cache"
    first = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(cache)})
    path = json.loads(first.stdout)
    os.chmod(path, 0o666)  # as if planted, or loosened by someone else
    for _ in range(3):  # every rejected load cleans up after itself
        _private_build(tmp_path, cache)


def test_the_cache_directory_is_created_0750_whatever_the_umask(tmp_path):
    cache = tmp_path / "new" / "cache"
    old = os.umask(0)
    try:
        res = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(cache)})
    finally:
        os.umask(old)
    path = json.loads(res.stdout)
    assert os.path.dirname(path) == str(cache)
    assert oct(os.stat(cache).st_mode & 0o777) == oct(0o750)
    assert oct(os.stat(tmp_path / "new").st_mode & 0o777) == oct(0o750)
    assert not os.stat(path).st_mode & 0o022


def test_our_cached_library_with_a_second_hard_link_is_built_again_in_its_place(tmp_path):
    # perf record's build-id cache (~/.debug) hard-links every library it samples: the
    # file is still ours, but one link is the check, so every later process built a
    # private copy (seconds each) and said nothing
    cache = tmp_path / "cache"
    path = json.loads(_run(LOAD_AND_REPORT, {native.ENV_CACHE: str(cache)}).stdout)
    other = tmp_path / "debug_link.so"
    os.link(path, other)
    old_inode = os.stat(path).st_ino
    res = _run(LOAD_AND_USE, {native.ENV_CACHE: str(cache)})
    assert res.returncode == 0, res.stderr
    loaded, stats = json.loads(res.stdout)
    assert loaded == path and stats == [-2.0, 4.0, 3.0, pytest.approx(21 ** 0.5)]
    assert os.stat(path).st_nlink == 1 and os.stat(path).st_ino != old_inode, "a new file under the cache's name"
    assert os.stat(other).st_ino == old_inode, "the other link is left as it was"
    assert "2 hard links" in res.stderr and "building it again in its place" in res.stderr, res.stderr
    built = os.stat(path).st_mtime_ns
    again = _run(LOAD_AND_REPORT, {native.ENV_CACHE: str(cache)})
    assert json.loads(again.stdout) == path and os.stat(path).st_mtime_ns == built, "reused from then on"
    assert "hard links" not in again.stderr
