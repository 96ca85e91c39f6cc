"""Runtime: target resolution, the compiled-kernel cache, precompilation, the CLI (no GPU needed)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mok.config import MoKConfig
from mok.kernels import get_kernel
from mok.kernels.variants import combine_variant
from mok.plan import plan_for
from mok.runtime import arch as arch_mod
from mok.runtime.cache import KernelCache

SMALL = combine_variant(64, 2, True)  # a real kernel that compiles in well under a second


# ---- arch ---------------------------------------------------------------------------------

def test_dsl_target_nests_and_holds_one_thread_at_a_time():
    """The DSL's target is one setting per process: a nested block restores its enclosing
    block's target, and another thread's block waits until this one ends."""
    import threading

    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    seen = []

    def other_thread():
        with arch_mod.dsl_target("sm_100a"):
            seen.append(envar.arch)

    with arch_mod.dsl_target("sm_90a"):
        with arch_mod.dsl_target("sm_100a"):
            assert envar.arch == "sm_100a"
        assert envar.arch == "sm_90a"  # (a plain del here went back to the environment's)
        other = threading.Thread(target=other_thread)
        other.start()
        other.join(timeout=0.5)
        assert other.is_alive() and not seen and envar.arch == "sm_90a"  # it waits for this block
    other.join(timeout=10)
    assert seen == ["sm_100a"]

def test_explicit_arch_wins_and_is_normalised(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert arch_mod.resolve_arch("SM_90a") == "sm_90a"
    assert arch_mod.resolve_arch() == "sm_100a"


@pytest.mark.parametrize("bad,words", [("sm_90", "needs the arch-specific target sm_90a"), ("sm_80", "expected one of sm_90a"), ("hopper", "expected one of")])
def test_unsupported_arch_is_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        arch_mod.resolve_arch(bad)


def test_bad_env_arch_names_the_variable(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_86")
    with pytest.raises(ValueError, match="CUTE_DSL_ARCH: arch: expected one of"):
        arch_mod.resolve_arch()


def test_no_silent_default_without_gpu(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="cannot tell which GPU to build for"):
        arch_mod.resolve_arch()


def test_unsupported_gpu_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"no kernels for NVIDIA A100 \(compute capability 8.0\)"):
        arch_mod.device_arch()


# ---- cache --------------------------------------------------------------------------------

def test_first_get_compiles_then_memory_then_disk(tmp_path):
    cache = KernelCache(tmp_path)
    fn = get_kernel(SMALL, "sm_90a", cache)
    assert (cache.stats.compiles, cache.stats.disk_loads) == (1, 0)
    assert get_kernel(SMALL, "sm_90a", cache) is fn
    assert cache.stats.memory_hits == 1
    fresh = KernelCache(tmp_path)  # as a new process would see it
    get_kernel(SMALL, "sm_90a", fresh)
    assert (fresh.stats.compiles, fresh.stats.disk_loads) == (0, 1)


def test_key_separates_config_and_arch(tmp_path):
    cache = KernelCache(tmp_path)
    get_kernel(SMALL, "sm_90a", cache)
    get_kernel(SMALL, "sm_100a", cache)
    get_kernel(combine_variant(64, 2, False), "sm_90a", cache)
    assert cache.stats.compiles == 3
    assert sorted((e["key"]["arch"], e["key"]["config"]["has_shared"]) for e in cache.entries()) == [
        ("sm_100a", True), ("sm_90a", False), ("sm_90a", True)
    ]


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "missing_object"])
def test_corrupt_entry_is_rebuilt(tmp_path, damage):
    get_kernel(SMALL, "sm_90a", KernelCache(tmp_path))
    (entry,) = KernelCache(tmp_path).entries()
    obj = entry["path"]
    meta = obj[:-2] + ".json"
    if damage == "truncate":
        with open(obj, "r+b") as f:
            f.truncate(100)
    elif damage == "flip":
        data = bytearray(open(obj, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(obj, "wb").write(bytes(data))
    elif damage == "meta":
        open(meta, "w").write("{not json")
    else:
        os.remove(obj)
    cache = KernelCache(tmp_path)
    get_kernel(SMALL, "sm_90a", cache)
    assert (cache.stats.compiles, cache.stats.disk_loads) == (1, 0)
    again = KernelCache(tmp_path)
    get_kernel(SMALL, "sm_90a", again)
    assert (again.stats.compiles, again.stats.disk_loads) == (0, 1)


def test_stale_record_is_rebuilt(tmp_path):
    get_kernel(SMALL, "sm_90a", KernelCache(tmp_path))
    (entry,) = KernelCache(tmp_path).entries()
    meta_path = entry["path"][:-2] + ".json"
    meta = json.loads(open(meta_path).read())
    meta["key"]["dsl_version"] = "0.0.0"  # an entry written by another DSL under this name
    open(meta_path, "w").write(json.dumps(meta))
    cache = KernelCache(tmp_path)
    get_kernel(SMALL, "sm_90a", cache)
    assert cache.stats.compiles == 1


_RACE = """
import sys
from mok.config import MoKConfig
from mok.kernels import get_kernel
from mok.kernels.variants import combine_variant
from mok.runtime.cache import KernelCache
cache = KernelCache(sys.argv[1])
get_kernel(combine_variant(64, 2, True), "sm_90a", cache)
print(cache.stats.compiles, cache.stats.disk_loads)
"""


def test_concurrent_processes_compile_once(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    results = [tuple(map(int, p.communicate(timeout=300)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(c for c, _ in results) == 1 and sum(d for _, d in results) == 2


# ---- precompile and the CLI ---------------------------------------------------------------

def _mok(*args, cache_dir, machine_arch=None):
    env = dict(os.environ, MOK_CACHE_DIR=str(cache_dir))
    env.pop("CUTE_DSL_ARCH", None)
    if machine_arch:  # what the DSL believes this machine is, as on a GPU machine of that arch
        env["CUTE_DSL_ARCH"] = machine_arch
    return subprocess.run([sys.executable, "-m", "mok", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("arch,machine_arch", [("sm_90a", None), ("sm_100a", None), ("sm_100a", "sm_90a")])
def test_precompile_then_second_run_compiles_nothing(tmp_path, arch, machine_arch):
    ep_size = 8 if arch == "sm_90a" else 1  # (SM100 at one GPU: its EP kernels are the test below's)
    shape = ["--hidden", "256", "--intermediate", "128", "--experts", "16", "--topk", "4", "--shared-intermediate", "256",
             "--ep-size", str(ep_size)]
    config = MoKConfig(hidden=256, intermediate=128, num_experts=16, topk=4, shared_intermediate=256, ep_size=ep_size)
    expected = len(plan_for(config, arch).variants())
    assert expected >= 2
    first = _mok("precompile", "--arch", arch, *shape, cache_dir=tmp_path, machine_arch=machine_arch)
    assert first.returncode == 0, first.stderr
    assert f"{arch}: {expected} compiled, 0 already in the cache" in first.stdout
    second = _mok("precompile", "--arch", arch, *shape, cache_dir=tmp_path, machine_arch=machine_arch)
    assert f"{arch}: 0 compiled, {expected} already in the cache" in second.stdout
    listing = _mok("cache", "list", cache_dir=tmp_path)
    gathered = ep_size == 1  # (at EP > 1 the combine reads the [T, k] slots the peers pushed)
    assert f"combine(gathered={gathered}, has_shared=True, hidden=256, topk=4)" in listing.stdout and arch in listing.stdout
    assert f"{expected} entries" in listing.stdout
    cleared = _mok("cache", "clear", cache_dir=tmp_path)
    assert f"removed {expected} entries" in cleared.stdout
    assert "0 entries" in _mok("cache", "list", cache_dir=tmp_path).stdout


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_precompile_one_launch_adds_the_one_launch_forwards(tmp_path, arch):
    """--one-launch: what MoKConfig(one_launch=True) needs, i.e. also the expert-parallel one-launch
    forward (with and without h) at EP > 1, and the gather of the rows it keeps for the backward
    (the multi-launch forward keeps the rows it pulled); the rest is what the plain config needs,
    already cached. The same on Hopper and on SM100 (its own one-launch kernel)."""
    shape = ["--hidden", "256", "--intermediate", "128", "--experts", "16", "--topk", "4", "--ep-size", "2"]
    base = MoKConfig(hidden=256, intermediate=128, num_experts=16, topk=4, shared_intermediate=None, ep_size=2)
    keys = lambda config: {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(config, arch).variants()}  # noqa: E731
    plain, one = keys(base), keys(MoKConfig(**{**base.as_dict(), "one_launch": True}))
    added = one - plain
    assert sorted(name for name, _ in added) == ["expert_mlp", "expert_mlp", "gather"]
    assert sorted(dict(c)["save_h"] for name, c in added if name == "expert_mlp") == [False, True]
    assert all(dict(c)["ep_world"] == 2 for name, c in added if name == "expert_mlp")
    first = _mok("precompile", "--arch", arch, *shape, "--shared-intermediate", "0", cache_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    second = _mok("precompile", "--arch", arch, *shape, "--shared-intermediate", "0", "--one-launch", cache_dir=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"{arch}: 3 compiled, {len(one) - 3} already in the cache" in second.stdout
    assert "ep_world=2" in _mok("cache", "list", cache_dir=tmp_path).stdout


def test_precompile_refuses_bad_arch_and_shapes(tmp_path):
    bad = _mok("precompile", "--arch", "sm_90", cache_dir=tmp_path)
    assert bad.returncode == 1 and "sm_90a" in bad.stderr
    bad = _mok("precompile", "--arch", "sm_90a", "--hidden", "100", cache_dir=tmp_path)
    assert bad.returncode == 1 and "hidden: expected a multiple of 8 (16-byte bf16 vectors), got 100" in bad.stderr
    bad = _mok("precompile", "--arch", "sm_100a", "--hidden", "136", "--intermediate", "256", "--ep-size", "1", "--precision", "mxfp8",
               cache_dir=tmp_path)  # before compiling anything
    assert bad.returncode == 1 and "precision='mxfp8': expected widths that are multiples of 16 (16-byte E4M3 rows), got {'hidden': 136" in bad.stderr
    # a configuration whose layer would not run on the arch: refused, not a list of kernels nobody uses
    bad = _mok("precompile", "--arch", "sm_90a", "--precision", "mxfp8", "--ep-size", "1", cache_dir=tmp_path)
    assert bad.returncode == 1 and "does not run on sm_90a: precision='mxfp8': needs block-scaled MMAs" in bad.stderr
    assert "On the command line: --precision mxfp8_emulated" in bad.stderr  # (what to pass instead)
    bad = _mok("precompile", "--arch", "sm_100a", "--precision", "fp8_block", "--ep-size", "1", cache_dir=tmp_path)
    assert bad.returncode == 1 and "does not run on sm_100a: precision='fp8_block' on sm_100a runs on its block-scaled MMAs and needs " \
        "fp8_scales='power_of_two'" in bad.stderr
    assert not list(tmp_path.glob("*/*.o"))


def test_the_expert_parallel_backward_combine_is_precompiled():
    """ep_moe_backward sums dx over the pushed [T, k] slots with unit weights: that combine is listed."""
    config = MoKConfig(hidden=256, intermediate=128, num_experts=8, topk=2, shared_intermediate=128, ep_size=2)
    want = combine_variant(256, 2, True, gathered=False, unit_weights=True)
    assert any((v.name, v.config) == (want.name, want.config) for v in plan_for(config, "sm_90a").variants())


def test_cache_clear_takes_kernel_names_only_and_listing_skips_damaged_records(tmp_path):
    """`cache clear --kernel ..` must not delete the folder above the cache; a record that parses
    but is not an entry's is skipped by the listing, as unreadable ones are."""
    (tmp_path / "sibling").mkdir()
    (tmp_path / "sibling" / "keep.txt").write_text("x")
    cache = KernelCache(tmp_path / "cache")
    for name in ("..", "/tmp", "a/b"):
        with pytest.raises(ValueError, match="name: expected a kernel name"):
            cache.clear(name)
    assert (tmp_path / "sibling" / "keep.txt").exists()
    (tmp_path / "cache" / "combine").mkdir(parents=True)
    (tmp_path / "cache" / "combine" / "x.json").write_text("{}")
    assert cache.entries() == []
    listing = _mok("cache", "list", cache_dir=tmp_path / "cache")
    assert listing.returncode == 0 and "0 entries" in listing.stdout, listing.stderr


def test_cache_key_holds_the_dsl_settings_that_change_code():
    """A build with the DSL's assertions on must not be loaded by a process without them (and the
    reverse): the settings are part of the key, as in the DSL's own JIT cache."""
    code = ("from mok.runtime.cache import KernelCache as K; "
            "print(K.digest(K.key_record('combine', {'hidden': 64}, 'sm_90a')))")
    digests = []
    for extra in ({}, {"CUTE_DSL_ENABLE_ASSERTIONS": "1"}, {}):
        env = {**os.environ, **extra}
        env.pop("CUTE_DSL_ENABLE_ASSERTIONS", None) if not extra else None
        digests.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300).stdout.strip())
    assert digests[0] == digests[2] and digests[0] != digests[1] and len(digests[1]) == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_says_so(tmp_path):
    res = _mok("bench", cache_dir=tmp_path)
    assert res.returncode == 2
    assert "No CUDA GPU is visible" in res.stderr and "python -m mok precompile --arch sm_90a" in res.stderr


def test_a_hang_in_an_sm100_test_ends_the_run_naming_the_test_and_the_kernel_launched_last(tmp_path):
    """tests/conftest.py's watchdog for sm100-marked tests (helpers.hang_watchdog): a block that
    outlives its time (here a sleep standing in for a launch that never returns) ends the process
    with exit code 3, the block's name and the kernel mok.ops.common.kernel_for handed out last."""
    tests = os.path.dirname(os.path.abspath(__file__))
    script = (
        "import time\n"
        "from helpers import hang_watchdog\n"
        "from mok.ops.common import kernel_for\n"
        "from mok.kernels.variants import combine_variant\n"
        "import torch\n"
        "try:\n"
        "    kernel_for(combine_variant(256, 2, False), torch.device('cpu', 0))\n"
        "except Exception:\n"
        "    pass  # (no GPU: taking the kernel is what is recorded, before any compile)\n"
        "with hang_watchdog('tests/test_x.py::test_hangs', 0.5):\n"
        "    time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tests,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)])))
    assert done.returncode == 3, done.stderr[-2000:]
    assert "tests/test_x.py::test_hangs: still running after 0.5 s (a hang?)" in done.stderr
    assert f"the kernel launched last: {combine_variant(256, 2, False).describe()}" in done.stderr
    with_no_hang = subprocess.run([sys.executable, "-c", script.replace("time.sleep(30)", "time.sleep(0.01)")], capture_output=True,
                                  text=True, timeout=60, cwd=tests,
                                  env=dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)])))
    assert with_no_hang.returncode == 0, with_no_hang.stderr[-2000:]
