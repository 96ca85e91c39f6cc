"""tools/sass_stalls.py reads ncu's source-page CSV export (CPU; a synthetic export of two kernels);
mok.bench's interleaved timer (GPU); perf/bench_layer.py's --set parser (CPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sass_stalls", ROOT / "tools" / "sass_stalls.py")
sass_stalls = importlib.util.module_from_spec(spec)
sys.modules["sass_stalls"] = sass_stalls  # (dataclasses look their module up)
spec.loader.exec_module(sass_stalls)

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","# Samples","stall_long_sb","stall_no_inst","stall_long_sb (Not Issued)"'


def test_stall_shares_and_hottest_instructions_per_kernel(tmp_path):
    export = tmp_path / "rep_sass.csv"
    export.write_text("\n".join([
        '"Kernel Name","gemm_a",',
        HEADER,
        '"0x10","HGMMA.64x128x16.F32.BF16 R24","1,200","1,200","200","1,000","7"',
        '"0x20","SHF.L.U32 R28, R100, 0x10, RZ","600","600","600","0","9"',
        '"0x30","  EXIT","","",""',  # a row shorter than the header is skipped
        '"Kernel Name","gemm_b",',
        HEADER,
        '"0x40","NANOSLEEP.SYNCS 0x989680","5","5","5","0","0"',
    ]) + "\n")
    a, b = sass_stalls.read_source_page(str(export))
    assert (a.name, len(a.rows), b.name, len(b.rows)) == ("gemm_a", 2, "gemm_b", 1)
    shares = a.stall_shares()
    assert list(shares) == ["stall_no_inst", "stall_long_sb"]  # "(Not Issued)" columns are not reasons
    assert abs(shares["stall_no_inst"] - 1000 / 1800) < 1e-12 and abs(shares["stall_long_sb"] - 800 / 1800) < 1e-12
    hottest = a.hottest(1)
    assert hottest == [(1200 / 1800, "0x10", "stall_no_inst", "HGMMA.64x128x16.F32.BF16 R24")]
    assert b.stall_shares() == {"stall_long_sb": 1.0, "stall_no_inst": 0.0}
    text = sass_stalls.report(a, top=2)
    assert "2 SASS instructions" in text and "SHF.L.U32" in text


@pytest.mark.gpu
def test_interleaved_timing_takes_the_callables_in_turn_and_measures_each():
    """mok.bench.time_ms_interleaved: after the warm-up each repeat times one batch of every
    callable, the first one rotating; a kernel that spins three times as long measures ~3x."""
    import torch

    from mok.bench import time_ms_interleaved

    calls = []

    def spinning(name, cycles):
        def fn():
            calls.append(name)
            torch.cuda._sleep(cycles)
        return fn

    fns = {"short": spinning("short", 1_000_000), "long": spinning("long", 3_000_000), "mid": spinning("mid", 2_000_000)}
    ms = time_ms_interleaved(fns, batch=2, repeats=4, warmup=1)
    names = list(fns)
    want = names + [names[(r + i) % 3] for r in range(4) for i in range(3) for _ in range(2)]
    assert calls == want
    assert set(ms) == set(names) and all(v > 0 for v in ms.values())
    assert 2.4 < ms["long"] / ms["short"] < 3.6 and 1.6 < ms["mid"] / ms["short"] < 2.4


def test_bench_layer_helpers_count_experts_without_bincount_and_compare_results_bit_for_bit():
    """mok.bench (what perf/bench_layer.py and perf/bench_ep.py use): the baseline's expert offsets
    equal bincount's (without its host sync on CUDA); same_bits compares tensors and tuples of them
    (Gradients) exactly, None as None."""
    import torch

    from mok.bench import expert_offsets, same_bits
    flat = torch.randint(0, 7, (1000,))
    assert torch.equal(expert_offsets(flat, 9), torch.bincount(flat, minlength=9).cumsum(0).int())
    a = torch.randn(4, 3)
    b = a.clone()
    b.view(torch.int32)[2, 1] ^= 1  # one bit of one element
    assert same_bits((a, None, (a, a)), (a.clone(), None, (a, a.clone())))
    assert not same_bits((a, None), (b, None)) and not same_bits(a, None) and not same_bits((a,), (a, a))


def test_gpu_sampler_reads_nvidia_smi_lines_and_skips_what_does_not_parse():
    """mok.bench.parse_samples: "clock, power, temperature" lines as floats; a line cut short when
    the sampler stops, "[N/A]" values and blank lines are skipped (CPU)."""
    from mok.bench import parse_samples

    text = "1980, 412.53, 41\n\n1455, 698.10, 63\n[N/A], 700.00, 64\n1470, 69"
    assert parse_samples(text) == [(1980.0, 412.53, 41.0), (1455.0, 698.1, 63.0)]
    assert parse_samples("") == []


def test_nvidia_smi_command_lines_for_one_reading_and_for_sampling():
    """mok.bench.smi_command: the one-shot reading keeps units, the sampler's drops them (its lines
    are parsed as numbers) and repeats every period (CPU)."""
    from mok.bench import GpuSampler, smi_command

    once = smi_command("clocks.sm,power.draw", 1)
    assert once == ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader", "-i", "1"]
    sampled = smi_command(GpuSampler.FIELDS, 0, units=False, period_ms=50)
    assert sampled[1:] == [f"--query-gpu={GpuSampler.FIELDS}", "--format=csv,noheader,nounits", "-i", "0", "-lms=50"]


@pytest.mark.gpu
def test_sustained_timing_warms_up_then_times_and_samples_the_clock():
    """mok.bench.time_ms_sustained: untimed calls for ``seconds``, then timed ones for as long; a
    kernel that spins twice as long measures ~2x, and the sampler saw the SM clock (nvidia-smi)."""
    import shutil
    import time

    import torch

    from mok.bench import time_ms_sustained

    calls = []

    def spin(cycles):
        def fn():
            calls.append(cycles)
            torch.cuda._sleep(cycles)
        return fn

    start = time.perf_counter()
    short, gpu = time_ms_sustained(spin(1_000_000), seconds=0.3)
    assert time.perf_counter() - start >= 0.6 and short > 0 and len(calls) >= 10
    long, _ = time_ms_sustained(spin(2_000_000), seconds=0.3)
    assert 1.6 < long / short < 2.4
    if shutil.which("nvidia-smi"):
        assert gpu["samples"] >= 1 and 100 < gpu["clock_mhz"] < 5000 and gpu["power_w"] > 0



def test_variant_setting_parses_a_tunable_setting_into_its_type_and_refuses_the_rest():
    """perf/bench_layer.py's --set NAME=VALUE (and perf/step_kernels.py's): a name of
    mok.kernels.variants.TUNABLE_SETTINGS, its value a literal of the setting's type (a list or set
    for a frozenset, an int for a float); anything else an argparse error naming what was
    expected; applying it changes what the variants read, the FP8 gate/up GEMM's config here."""
    import argparse

    spec = importlib.util.spec_from_file_location("bench_layer", ROOT / "perf" / "bench_layer.py")
    bench_layer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_layer)
    from mok.kernels import variants

    assert bench_layer.variant_setting("ISSUE_ORDER=[]") == ("ISSUE_ORDER", frozenset())
    assert bench_layer.variant_setting("ISSUE_ORDER={'plain'}") == ("ISSUE_ORDER", frozenset({"plain"}))
    assert bench_layer.variant_setting("PROMOTIONS_YIELD=1") == ("PROMOTIONS_YIELD", 1.0)
    assert bench_layer.variant_setting("DEEP_TURNS={'plain': 8}") == ("DEEP_TURNS", {"plain": 8})
    for text, message in (("ISSUE_ORDER", "NAME=VALUE"), ("SWIGLU_BACKWARD_TILE_N=64", "NAME=VALUE"),
                          ("DEEP_TURNS=8", "expected a dict"), ("PROMOTIONS_YIELD=half", "Python literal")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            bench_layer.variant_setting(text)
    gate_up = dict(operand="e4m3_block", epilogue="swiglu_save", topk=8)
    default = variants.ISSUE_ORDER
    try:
        bench_layer.apply_variant_settings([bench_layer.variant_setting("ISSUE_ORDER=[]")])
        assert "ordered_issue" not in variants.grouped_gemm_variant(2048, 7168, **gate_up).config
        bench_layer.apply_variant_settings([bench_layer.variant_setting("ISSUE_ORDER=['swiglu_save']")])
        assert variants.grouped_gemm_variant(2048, 7168, **gate_up).config["ordered_issue"] is True
    finally:
        variants.ISSUE_ORDER = default


def load_compare_trees():
    spec = importlib.util.spec_from_file_location("compare_trees", ROOT / "perf" / "compare_trees.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the project's git repository")
def test_compare_trees_takes_a_commits_package_and_names_what_it_refuses(tmp_path):
    """perf/compare_trees.py: the base commit's mok package written from git (HEAD's here: the
    same files as the tree's where the tree is clean, an __init__ at least); an unknown commit, an
    unknown config, a config with a shared expert or skewed routing, an unknown pass: SystemExit
    naming the option and what was given."""
    compare_trees = load_compare_trees()
    commit = compare_trees.commit_of("HEAD")
    assert len(commit) == 40 and int(commit, 16) >= 0
    into = compare_trees.extract_package(commit, tmp_path)
    assert (into / "mok" / "__init__.py").is_file() and (into / "mok" / "api.py").is_file()
    assert not (into / "tests").exists()
    for call, message in ((lambda: compare_trees.commit_of("no-such-commit-here"), "--base: expected a commit"),
                          (lambda: compare_trees.cases_of("dsv4", "forward"), "no config 'dsv4'"),
                          (lambda: compare_trees.cases_of("dsv3-shared", "forward"), "shared expert"),
                          (lambda: compare_trees.cases_of("dsv3-zipf", "step"), "zipf routing"),
                          (lambda: compare_trees.cases_of("dsv3", "backward"), "--passes: expected some of forward, step, got 'backward'")):
        with pytest.raises(SystemExit, match=message):
            call()
    assert compare_trees.cases_of("qwen3-30b-32k", "forward,step") == [("qwen3-30b-32k", "forward", (32768, 2048, 768, 128, 8)),
                                                                   ("qwen3-30b-32k", "step", (32768, 2048, 768, 128, 8))]


def test_compare_trees_takes_a_folder_holding_a_package_as_the_base(tmp_path):
    """--base DIR (a machine without git): a folder with a mok package is the base as it is; a
    folder without one, or a name that is no folder, is not (then taken for a commit)."""
    compare_trees = load_compare_trees()
    (tmp_path / "tree" / "mok").mkdir(parents=True)
    assert compare_trees.base_folder(str(tmp_path / "tree")) is None  # (no __init__.py: not a package)
    (tmp_path / "tree" / "mok" / "__init__.py").write_text("")
    assert compare_trees.base_folder(str(tmp_path / "tree")) == (tmp_path / "tree").resolve()
    assert compare_trees.base_folder(str(tmp_path)) is None
    assert compare_trees.base_folder("4b6f960") is None


def test_compare_trees_summary_gives_each_case_its_rounds_ratio_and_bits():
    """perf/compare_trees.py's table: each round's ms per tree, head / base of their means, and
    whether all records of a case (both trees, every round) share their bits."""
    compare_trees = load_compare_trees()
    records = [{"tree": tree, "round": r, "config": "dsv3", "pass": "forward", "ms": ms, "bits": "a"}
               for tree, r, ms in (("base", 1, 4.0), ("head", 1, 3.0), ("base", 2, 6.0), ("head", 2, 3.0))]
    records += [{"tree": tree, "round": 1, "config": "dsv3", "pass": "step", "ms": 10.0, "bits": bits}
                for tree, bits in (("base", "a"), ("head", "b"))]
    header, forward, step = compare_trees.summary(records)
    assert header.split()[:2] == ["config", "pass"]
    assert "4.000 6.000" in forward and "3.000 3.000" in forward and "0.600x" in forward and forward.endswith("True")
    assert "1.000x" in step and step.endswith("False")
