"""A kernel cache built in one environment loads, compiling nothing, in a copy of it at another path.

(Issue "A newcomer's first hour": the key held the absolute path of the DSL runtime library, so a
cache precompiled in CI, in a container build step or in another venv compiled everything again.)

The "copy at another path" is what ``cp -a`` of a venv gives the packages the key and the load can
see: the installed CuTe DSL (its Python packages, compiler and runtime library: the
``nvidia_cutlass_dsl`` folder), TVM-FFI and MoK itself, copied under a temporary folder and put
first on ``PYTHONPATH``. The copy is made of hard links where the file system allows (fast, and
still other paths: nothing resolves them back to the originals, unlike a symlink), else of copies.
The subprocess checks that it really imported the DSL, its runtime library and MoK from the copy.

Also: no install path in a key, and a cache shipped read-only (an image layer, another user's) works.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_BUILD_OR_LOAD = """
import json
import cutlass, mok
from cutlass.cutlass_dsl import CuTeDSL
from mok.kernels import get_kernel
from mok.kernels.variants import combine_variant
from mok.runtime.cache import default_cache

variant = combine_variant(64, 2, True)  # the smallest real kernel: compiles in about a second
cache = default_cache()  # (in $MOK_CACHE_DIR)
get_kernel(variant, "sm_90a", cache)
try:
    import tvm_ffi
    tvm_ffi_file = tvm_ffi.__file__
except ImportError:
    tvm_ffi_file = None
print(json.dumps({
    "cutlass": cutlass.__file__, "mok": mok.__file__, "tvm_ffi": tvm_ffi_file,
    "runtime_libs": CuTeDSL._get_dsl().get_shared_libs(),
    "compiles": cache.stats.compiles, "disk_loads": cache.stats.disk_loads,
    "key": cache.key_record(variant.name, variant.config, "sm_90a"),
}))
"""


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a real copy
        shutil.copy2(src, dst)
    return dst


def _copy_environment(dest: Path) -> Path:
    """The DSL, TVM-FFI and MoK packages under ``dest`` (to be put first on PYTHONPATH)."""
    import cutlass

    import mok

    dsl_root = Path(cutlass.__file__).resolve().parents[2]  # .../nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py
    if dsl_root.name != "nvidia_cutlass_dsl":
        pytest.skip(f"CuTe DSL is not installed from its wheels here ({cutlass.__file__})")
    dest.mkdir()
    shutil.copytree(dsl_root, dest / dsl_root.name, symlinks=True, copy_function=_link_or_copy)
    try:
        import tvm_ffi

        tvm_root = Path(tvm_ffi.__file__).resolve().parent
        shutil.copytree(tvm_root, dest / tvm_root.name, symlinks=True, copy_function=_link_or_copy)
    except ImportError:
        pass
    shutil.copytree(Path(mok.__file__).resolve().parent, dest / "mok", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _run(script: str, env: dict, cwd: Path) -> dict:
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tvm_ffi", ["1", "0"], ids=["tvm_ffi", "dsl_calling"])
def test_cache_built_in_one_environment_loads_in_a_copy_at_another_path(tmp_path, tvm_ffi):
    copy = _copy_environment(tmp_path / "other-env")
    env = dict(os.environ, MOK_CACHE_DIR=str(tmp_path / "cache"), CUTE_DSL_ARCH="sm_90a", MOK_TVM_FFI=tvm_ffi)
    for name in ("PYTHONPATH", "CUTE_DSL_LIBS"):  # (CUTE_DSL_LIBS would pin both to one runtime library)
        env.pop(name, None)
    work = tmp_path / "cwd"  # not the checkout: `import mok` must not find it through the working directory
    work.mkdir()

    built = _run(_BUILD_OR_LOAD, env, work)
    assert (built["compiles"], built["disk_loads"]) == (1, 0)
    assert not any(str(copy) in p for p in [built["cutlass"], built["mok"], *built["runtime_libs"]])

    loaded = _run(_BUILD_OR_LOAD, dict(env, PYTHONPATH=str(copy)), work)
    imported = [loaded["cutlass"], loaded["mok"], *loaded["runtime_libs"]] + ([loaded["tvm_ffi"]] if loaded["tvm_ffi"] else [])
    assert loaded["runtime_libs"] and all(p.startswith(str(copy) + os.sep) for p in imported), imported
    differing = {k: (built["key"][k], loaded["key"][k]) for k in built["key"] if built["key"][k] != loaded["key"].get(k)}
    assert (loaded["compiles"], loaded["disk_loads"]) == (0, 1), f"compiled again; the key differs in {differing}"
    assert loaded["key"] == built["key"]
    # and nothing of either environment's location is in the key
    assert str(copy) not in json.dumps(loaded["key"])
    assert str(Path(built["cutlass"]).parents[2]) not in json.dumps(built["key"])


def test_key_holds_no_install_path():
    """Nothing in a key names where Python, the DSL or MoK is installed (checked in this process)."""
    import cutlass

    import mok
    from mok.runtime.cache import KernelCache

    text = json.dumps(KernelCache.key_record("combine", {"hidden": 64}, "sm_90a"))
    for place in (sys.prefix, sys.base_prefix, Path(cutlass.__file__).resolve().parents[2], Path(mok.__file__).resolve().parent):
        assert str(place) not in text
    assert "libcute_dsl_runtime.so@sha256:" in text  # the runtime library: by name and content


def test_a_path_valued_setting_is_keyed_by_name_and_content(tmp_path):
    from mok.runtime.cache import _path_free

    a, b, c = tmp_path / "a" / "libx.so", tmp_path / "b" / "libx.so", tmp_path / "b" / "liby.so"
    for path, content in ((a, b"one"), (b, b"one"), (c, b"two")):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content)
    assert _path_free(str(a)) == _path_free(str(b)) != _path_free(str(c))  # the same file elsewhere: the same key
    assert str(tmp_path) not in _path_free(f"{a}{os.pathsep}{c}") and _path_free(f"{a}{os.pathsep}{c}").count("@sha256:") == 2
    for kept in ("", "legacy", "relative/libx.so", str(tmp_path), str(tmp_path / "missing.so"), 3, None):
        assert _path_free(kept) == kept  # not naming files: kept as it is (a cache that does not move, never a wrong load)


_READ_ONLY = """
import json
from mok.config import MoKConfig
from mok.kernels import get_kernel
from mok.kernels.variants import combine_variant
from mok.runtime.cache import default_cache
from mok.runtime.precompile import precompile

cache = default_cache()
get_kernel(combine_variant(64, 2, True), "sm_90a", cache)  # in the cache
get_kernel(combine_variant(64, 2, False), "sm_90a", cache)  # not in it
try:
    precompile(MoKConfig(hidden=256, intermediate=128, num_experts=16, topk=4, shared_intermediate=None, ep_size=1), "sm_90a", cache)
    refused = None
except OSError as err:
    refused = str(err)
print(json.dumps({"compiles": cache.stats.compiles, "disk_loads": cache.stats.disk_loads, "refused": refused}))
"""


def _read_only(source, mount, *argv) -> list[str]:
    """``argv`` run with ``source`` mounted read-only at ``mount``, in a mount namespace of its own."""
    script = 'mount --bind "$1" "$2" && mount -o remount,ro,bind "$2" && shift 2 && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", str(source), str(mount), *argv]


def test_a_read_only_cache_is_read_and_what_it_lacks_compiled_in_memory(tmp_path):
    """A cache shipped in an image layer or owned by another user: its entries load, a kernel it
    lacks is compiled for the process (not an error), and precompile into it is refused."""
    cache, mount = tmp_path / "cache", tmp_path / "read-only"
    mount.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("needs `unshare` (util-linux) for a read-only bind mount")
    probe = subprocess.run(_read_only(tmp_path, mount, "sh", "-c", '! touch "$0/x"', str(mount)), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a read-only bind mount in a mount namespace (root, `unshare -m`): {probe.stderr.strip()}")
    env = dict(os.environ, MOK_CACHE_DIR=str(cache), CUTE_DSL_ARCH="sm_90a")
    env.pop("PYTHONPATH", None)
    built = _run(_BUILD_OR_LOAD, env, tmp_path)
    assert built["compiles"] == 1
    before = sorted(p.name for p in cache.rglob("*"))

    res = subprocess.run(_read_only(cache, mount, sys.executable, "-c", _READ_ONLY),
                         capture_output=True, text=True, env=dict(env, MOK_CACHE_DIR=str(mount)), cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert (seen["compiles"], seen["disk_loads"]) == (1, 1)
    assert "cannot write to" in res.stderr and "compiled for this process only" in res.stderr
    assert seen["refused"] and "precompile: cannot write to the cache directory" in seen["refused"]
    assert sorted(p.name for p in cache.rglob("*")) == before  # nothing written, nothing removed
