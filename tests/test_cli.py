"""The command line (mok/cli.py) and `mok bench`'s parts that run without a GPU (mok/bench.py):
options and their help, the precompile default per target, the presets, the records, table, JSON
and plot of synthetic timings, and the benchmark's loop on the CPU with a stand-in timer."""

import argparse
import json

import pytest
import torch

import mok
from mok import bench
from mok.bench import FORWARD, PASSES, PATHS, PRESETS, TRAIN, Shape
from mok.cli import _config_from, _resolve_config, build_parser, main
from mok.config import DEFAULT_CONFIG
from mok.plan import plan_for
from mok.runtime.arch import SUPPORTED_ARCHS


def _parsers(parser: argparse.ArgumentParser, name: str = "mok"):
    """Every (name, parser) under ``parser``, subcommands included."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _help_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_version_prints_moks_version(capsys):
    assert _help_of(["--version"], capsys).strip() == f"mok {mok.__version__}"


def test_every_option_and_command_has_a_help_string():
    seen = 0
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name}: {action.option_strings or action.dest} has no help"
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help and choice.help.strip(), f"{name} {choice.dest}: no help"
            seen += 1
    assert seen > 30


def test_each_command_has_its_own_help_text(capsys):
    texts = {
        " ".join(argv): _help_of([*argv, "--help"], capsys)
        for argv in ([], ["bench"], ["precompile"], ["cache"], ["cache", "list"], ["cache", "clear"])
    }
    assert len(set(texts.values())) == len(texts)
    assert "List the compiled kernels on disk" in texts["cache list"] and "--kernel" not in texts["cache list"]
    assert "--kernel" in texts["cache clear"]
    for preset in PRESETS:  # (bench's help lists the presets)
        assert preset in texts["bench"]


def test_cache_list_and_clear_still_work(tmp_path, capsys):
    assert main(["cache", "list", "--cache-dir", str(tmp_path)]) == 0
    assert f"0 entries in {tmp_path}" in capsys.readouterr().out
    assert main(["cache", "clear", "--kernel", "combine", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 0 entries" in capsys.readouterr().out


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_a_bare_precompile_builds_a_configuration_the_target_runs(arch):
    """DeepSeek-V3 at its own EP = 8 on every target (the SM100 GEMMs scatter rows too, the MXFP8
    ones included)."""
    args = build_parser().parse_args(["precompile", "--arch", arch])
    config, fallback = _resolve_config(args, arch)
    plan_for(config, arch)  # (raises where the layer does not run there)
    assert config == DEFAULT_CONFIG and fallback is None
    names = {v.name for v in plan_for(config, arch).variants()}
    assert {"ep_dispatch", "ep_publish", "router_grad"} <= names
    if arch in ("sm_100a", "sm_103a"):
        args = build_parser().parse_args(["precompile", "--arch", arch, "--precision", "mxfp8"])
        config, fallback = _resolve_config(args, arch)
        assert (config.ep_size, config.num_experts, fallback) == (DEFAULT_CONFIG.ep_size, DEFAULT_CONFIG.num_experts, None)
        scattering = {v.config.get("operand") for v in plan_for(config, arch).variants() if v.config.get("scatter")}
        assert scattering == {"e4m3"}  # (the down projection and dx push MXFP8 products into the owners' slots)


def test_precompile_defaults_keep_given_options():
    parser = build_parser()
    args = parser.parse_args(["precompile", "--arch", "sm_100a", "--experts", "64"])  # (EP runs there: DeepSeek-V3's 8 kept)
    assert (_config_from(args, "sm_100a").num_experts, _config_from(args, "sm_100a").ep_size) == (64, 8)
    args = parser.parse_args(["precompile", "--arch", "sm_100a", "--experts", "64", "--precision", "mxfp8"])
    assert (_config_from(args, "sm_100a").num_experts, _config_from(args, "sm_100a").ep_size) == (64, 8)  # (MXFP8's scattering GEMMs)
    args = parser.parse_args(["precompile", "--arch", "sm_90a", "--precision", "mxfp8_emulated"])
    config = _config_from(args, "sm_90a")
    assert (config.ep_size, config.num_experts, config.precision) == (8, 256, "mxfp8_emulated")
    plan_for(config, "sm_90a")
    args = parser.parse_args(["precompile", "--arch", "sm_100a", "--precision", "fp8_block"])  # (fp32 scales: not on SM100 at any EP)
    with pytest.raises(NotImplementedError, match="fp8_scales='power_of_two'"):
        plan_for(_config_from(args, "sm_100a"), "sm_100a")
    args = parser.parse_args(["precompile", "--arch", "sm_100a", "--ep-size", "1"])  # (given: kept, all 256 experts)
    assert (_config_from(args, "sm_100a").ep_size, _config_from(args, "sm_100a").num_experts) == (1, 256)
    args = parser.parse_args(["precompile", "--arch", "sm_100a", "--model", "qwen3-30b-a3b"])
    config = _config_from(args, "sm_100a")
    assert (config.hidden, config.intermediate, config.num_experts, config.topk, config.ep_size) == (2048, 768, 128, 8, 1)


def test_an_explicit_option_the_target_does_not_run_is_refused_with_what_to_pass(tmp_path, capsys):
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["precompile", "--arch", "sm_90a", "--precision", "mxfp8", *cache]) == 1
    assert "On the command line: --precision mxfp8_emulated" in capsys.readouterr().err
    assert main(["precompile", "--arch", "sm_100a", "--precision", "fp8_block", *cache]) == 1  # (nothing to pass instead)
    err = capsys.readouterr().err
    assert "does not run on sm_100a: precision='fp8_block'" in err and "On the command line" not in err
    assert not (tmp_path / "cache").exists()  # (refused before anything compiled)


def test_precompile_builds_gpt_oss_activation_and_biases(tmp_path, capsys):
    """--activation and --expert-bias reach the configuration; on sm_90a precompile builds their
    kernels (the bias-gradient ones among them); on sm_100a too (whole tiles there)."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    shape = ["--hidden", "256", "--intermediate", "136", "--experts", "8", "--topk", "2", "--shared-intermediate", "0", "--ep-size", "1"]
    argv = ["precompile", "--arch", "sm_90a", *shape, "--activation", "clamped_swiglu", "--expert-bias", *cache]
    config = _config_from(build_parser().parse_args(argv), "sm_90a")
    assert (config.activation, config.expert_bias) == ("clamped_swiglu", True)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "activation='clamped_swiglu', expert_bias" in err
    assert "column_sums(" in err and "row_dots(" in err and "bias=True" in err
    whole = ["--hidden", "256", "--intermediate", "128", "--experts", "8", "--topk", "2", "--shared-intermediate", "0", "--ep-size", "1"]
    assert main(["precompile", "--arch", "sm_100a", *whole, "--expert-bias", *cache]) == 0
    err = capsys.readouterr().err
    assert "column_sums(" in err and "row_dots(" in err and "bias=True" in err and "for sm_100a" in err


def test_precompile_builds_the_emulated_mxfp8_layer_at_widths_that_are_multiples_of_16(tmp_path, capsys):
    """--precision mxfp8_emulated at H = 272, I = 144 (multiples of 16 ending in half a block of
    32) builds for sm_90a: the conversions of static widths among its kernels (dh's halves apart,
    the weights chunked per expert); a multiple of 8 that is not of 16 is refused (rc 1)."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    shape = ["--experts", "8", "--topk", "2", "--shared-intermediate", "0", "--ep-size", "1"]
    argv = ["precompile", "--arch", "sm_90a", "--hidden", "272", "--intermediate", "144", *shape, "--precision", "mxfp8_emulated", *cache]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "quantize_mxfp8(bounded=True, mma_order=True, segments=2, width=144)" in err
    assert "quantize_mxfp8(matrix_rows=144, mma_order=True, width=272)" in err and "dequantize_mxfp8(bounded=True, width=272)" in err
    assert main([*argv[:4], "280", *argv[5:]]) == 1


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_precompile_builds_the_mxfp8_layer_for_sm100_at_widths_that_are_multiples_of_16(tmp_path, capsys, arch):
    """--precision mxfp8 at H = 272, I = 144 (partial K, column and row tiles of the block-scaled
    kernels; half a block of 32 at a row's end) builds for SM100: the block-scaled GEMMs and the
    conversions of static widths (dh's halves apart along its rows and down its columns, the weights
    chunked per expert); a multiple of 8 that is not of 16 is refused (rc 1)."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    shape = ["--experts", "8", "--topk", "2", "--shared-intermediate", "0", "--ep-size", "1"]
    argv = ["precompile", "--arch", arch, "--hidden", "272", "--intermediate", "144", *shape, "--precision", "mxfp8", *cache]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "quantize_mxfp8(bounded=True, mma_order=True, segments=2, width=144)" in err
    assert "quantize_mxfp8(bounded=True, columns=True, mma_order=True, segments=2, width=144)" in err
    assert "quantize_mxfp8(matrix_rows=144, mma_order=True, width=272)" in err and "dequantize_mxfp8" not in err
    assert "epilogue=plain, k=288, k_split=True, n=272, operand=e4m3" in err and "m=288, n=272, operand=e4m3" in err
    assert main([*argv[:4], "280", *argv[5:]]) == 1


def test_precompile_builds_fp8_weight_gradients_and_dispatch_for_sm100(tmp_path, capsys):
    """--wgrad-format fp8_block and --dispatch-format fp8_block with power-of-two scales build for
    sm_100a (the column quantizer and the dispatch in the MMA's E8M0 order, the MXFP8 weight
    gradients); with fp32 scales they are refused before anything compiles."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    shape = ["--hidden", "256", "--intermediate", "128", "--experts", "8", "--topk", "2", "--shared-intermediate", "0", "--ep-size", "2"]
    fp8 = ["--precision", "fp8_block", "--wgrad-format", "fp8_block", "--dispatch-format", "fp8_block"]
    assert main(["precompile", "--arch", "sm_100a", *shape, *fp8, "--fp8-scales", "power_of_two", *cache]) == 0
    err = capsys.readouterr().err
    assert "ep_dispatch_fp8_block(" in err and "scale_order=mma" in err and "dequantize_mxfp8(bounded=True)" in err
    assert "columns=True, mma_scales=True" in err and "operand=e4m3, out_dtype" in err and "for sm_100a" in err
    assert main(["precompile", "--arch", "sm_100a", *shape, *fp8, "--cache-dir", str(tmp_path / "refused")]) == 1
    assert "fp8_scales='power_of_two'" in capsys.readouterr().err and not (tmp_path / "refused").exists()


def test_bench_without_a_gpu_says_so_and_points_to_precompile(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "No CUDA GPU is visible" in err and "python -m mok precompile --arch sm_90a --model deepseek-v3" in err
    assert main(["bench", "--model", "mixtral-8x7b,olmoe-1b-7b", "--kernel", "combine"]) == 2
    assert "--model mixtral-8x7b,olmoe-1b-7b" in capsys.readouterr().err


def test_bench_options_pick_presets_or_a_shape_of_ones_own(capsys):
    parser = build_parser()

    def shapes(*argv):
        from mok.cli import _bench_shapes

        return _bench_shapes(parser.parse_args(["bench", *argv]))

    assert shapes() == [PRESETS["deepseek-v3"]]
    assert [s.model for s in shapes("--model", "all")] == list(PRESETS)
    assert shapes("--model", "Mixtral-8x7B, qwen3-30b-a3b") == [PRESETS["mixtral-8x7b"], PRESETS["qwen3-30b-a3b"]]
    assert shapes("--model", "qwen3-30b-a3b", "--tokens", "1024", "--experts", "64")[0] == Shape("qwen3-30b-a3b", 1024, 2048, 768, 64, 8)
    assert shapes("--tokens", "2048") == [Shape("deepseek-v3", 2048, 7168, 2048, 32, 8, 2048)]
    assert shapes("--model", "deepseek-v3", "--shared-intermediate", "0")[0].shared_intermediate is None
    own = shapes("--hidden", "1024", "--intermediate", "512", "--experts", "16", "--topk", "4")
    assert own == [Shape("custom", 4096, 1024, 512, 16, 4)]
    args = parser.parse_args(["bench", "--passes", "fwd", "--paths", "torch,mok"])
    assert args.passes == [FORWARD] and args.paths == ["mok", "torch"]
    assert parser.parse_args(["bench"]).passes == list(PASSES) and parser.parse_args(["bench"]).paths == list(PATHS)
    both = shapes("--model", "qwen3-235b-a22b", "--precision", "fp8_block,bf16")  # (each shape once per precision, bf16 first)
    assert [(s.model, s.precision) for s in both] == [("qwen3-235b-a22b", "bf16"), ("qwen3-235b-a22b", "fp8_block")]
    assert both[1].config().precision == "fp8_block" and "MoK's expert GEMMs fp8_block" in both[1].describe()
    fp8_wgrads = shapes("--model", "qwen3-235b-a22b", "--precision", "bf16,fp8_block", "--wgrad-format", "fp8_block")
    assert [s.config().weight_grad_format for s in fp8_wgrads] == ["bf16", "fp8_block"]  # (bf16's row keeps its own)
    assert "weight gradients fp8_block" in fp8_wgrads[1].describe() and fp8_wgrads[0].wgrad_format is None
    assert main(["bench", "--model", "qwen3-235b-a22b", "--wgrad-format", "fp8_block"]) == 2  # (no precision of the run takes it)
    assert "wgrad_format='fp8_block': only with precision 'fp8_block', got bf16" in capsys.readouterr().err
    assert main(["bench", "--model", "gpt-oss-20b", "--intermediate", "1032", "--precision", "fp8_block"]) == 2  # (16-byte E4M3 rows)
    assert "precision='fp8_block': expected widths that are multiples of 16 (16-byte E4M3 rows)" in capsys.readouterr().err
    assert main(["bench", "--hidden", "1024"]) == 2  # (a shape of one's own needs all four)
    assert "missing --intermediate, --experts, --topk" in capsys.readouterr().err
    assert main(["bench", "--model", "deepseek-v3", "--intermediate", "1004"]) == 2  # (not a multiple of 8)
    assert "intermediate: expected a multiple of 8" in capsys.readouterr().err
    for argv in (["--model", "gpt-oss-1t"], ["--passes", "sideways"], ["--paths", "numpy"], ["--seconds", "x"], ["--precision", "fp4"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["bench", *argv])
        assert exit_.value.code == 2
    assert "known: deepseek-v3" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_a_layer_moks_kernels_take(name):
    """Every preset has a plan on Hopper; on the SM100 archs where its widths are whole tiles (there
    others are refused, naming the requirement)."""
    shape = PRESETS[name]
    assert shape.model == name and name in bench.PRESET_NOTES
    shape.check()
    for arch in SUPPORTED_ARCHS:  # (any widths of 8 on every arch in bf16)
        plan_for(shape.config(), arch)


def test_flops_and_the_dense_gemm_of_the_same_flops():
    s = PRESETS["deepseek-v3"]
    forward = 6 * 4096 * 8 * 7168 * 2048 + 6 * 4096 * 7168 * 2048
    assert s.flops(FORWARD) == forward and s.flops(TRAIN) == 3 * forward
    assert bench.dense_shape(s) == (4096 * 8, 7168, 3 * 2048 + 3 * 2048 // 8)
    for name, shape in PRESETS.items():  # (rounding aside, the dense GEMM has the layer's FLOPs)
        assert abs(bench.dense_flops(shape, TRAIN) / shape.flops(TRAIN) - 1) < 1e-3, name


def _synthetic_records():
    shape = PRESETS["deepseek-v3"]
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0", "mok": mok.__version__, "date": "2026-12-05T10:00:00", "seconds": 2.0}
    gpu = {p: {"clock_mhz": 1400.0, "power_w": 692.0, "temp_c": 60.0} for p in PATHS}
    records = bench.pass_records(shape, FORWARD, {"mok": 4.935, "torch": 7.652, "dense": 4.3}, gpu, meta, {"output": 5.0e-3})
    diffs = {"dx": 6.2e-3, "d_topk_w": 4.0e-3, "d_w_gate": 5e-3}
    records += bench.pass_records(shape, TRAIN, {"mok": 15.037, "torch": 20.685, "dense": 13.0}, gpu, meta, diffs)
    small = Shape("qwen3-30b-a3b", 8192, 2048, 768, 128, 8)
    records += bench.pass_records(small, FORWARD, {"mok": 1.245, "torch": 2.953}, None, meta, {"output": 0.05})
    return records


def test_records_hold_the_figures_and_the_run():
    records = _synthetic_records()
    assert [(r["pass"], r["path"]) for r in records[:6]] == [(p, q) for p in PASSES for q in PATHS]
    mok_fwd, torch_fwd, dense_fwd = records[:3]
    assert mok_fwd["tflops"] == pytest.approx(PRESETS["deepseek-v3"].flops(FORWARD) / 4.935e-3 / 1e12)
    assert mok_fwd["speedup"] == pytest.approx(7.652 / 4.935) and torch_fwd["speedup"] == pytest.approx(1.0)
    assert dense_fwd["of_dense"] == pytest.approx(1.0)
    assert mok_fwd["of_dense"] == pytest.approx(mok_fwd["tflops"] / dense_fwd["tflops"])
    for key in ("model", "tokens", "hidden", "intermediate", "experts", "topk", "shared_intermediate", "pass", "path", "ms",
                "tflops", "speedup", "of_dense", "gpu", "torch", "date", "clock_mhz", "power_w"):
        assert key in mok_fwd
    assert mok_fwd["rel_diff"] == {"output": 5.0e-3} and "rel_diff" not in torch_fwd
    no_dense = records[-2]
    assert no_dense["of_dense"] is None and no_dense["clock_mhz"] is None


def test_the_table_of_synthetic_figures():
    text = bench.format_table(_synthetic_records())
    lines = text.splitlines()
    assert lines[0] == f"# NVIDIA H200, torch 2.11.0, mok {mok.__version__}, 2026-12-05T10:00:00"
    assert "# deepseek-v3: 4096 tokens, H 7168, I 2048, 32 experts on the GPU, top-8, shared expert I_s 2048" in text
    assert "one EP = 8 rank's share" in text
    row = next(line for line in lines if line.startswith("forward ") and " mok " in line).split()
    assert row == ["forward", "mok", "4.935", f"{PRESETS['deepseek-v3'].flops(FORWARD) / 4.935e9:.0f}", "1.55x",
                   f"{4.3 / 4.935 * 100:.0f}%", "1400", "692"]
    assert any(line.split()[:2] == ["forward+backward", "torch"] and "1.00x" in line for line in lines)
    assert "ok, all within" in text and "forward+backward: dx 6.2e-03, d_topk_w 4.0e-03" in text
    qwen = text[text.index("# qwen3-30b-a3b"):]
    assert "no shared expert" in qwen and "SUSPECT" in qwen and "forward output" in qwen  # (0.05: above the tolerance)
    assert next(line for line in qwen.splitlines() if line.startswith("forward ") and " mok " in line).split()[-3:] == ["-", "-", "-"]


def test_json_records_round_trip_and_reprint_without_a_gpu(tmp_path, capsys):
    records = _synthetic_records()
    path = tmp_path / "bench.json"
    bench.write_records(records, path)
    assert json.loads(path.read_text()) == records == bench.load_records(path)
    assert main(["bench", "--from-json", str(path)]) == 0
    assert capsys.readouterr().out.strip() == bench.format_table(records)
    (tmp_path / "bad.json").write_text('{"not": "records"}')
    assert main(["bench", "--from-json", str(tmp_path / "bad.json")]) == 1


def test_plot_of_synthetic_figures(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    records = _synthetic_records()
    for metric in ("tflops", "ms"):
        out = tmp_path / f"bench-{metric}.png"
        bench.plot_records(records, out, metric)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    bench.write_records(records, tmp_path / "bench.json")
    assert main(["bench", "--from-json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib raises ImportError)
    with pytest.raises(RuntimeError, match=r"pip install 'mok\[bench\]'"):
        bench.plot_records(_synthetic_records(), "never.png")


def test_layer_inputs_lay_a_shared_expert_of_the_routed_width_after_the_routed_experts():
    from mok.pipeline.stages import shared_expert_as_last

    x, idx, w, experts, shared = bench.layer_inputs(Shape("s", 64, 256, 128, 8, 2, 128), "cpu")
    assert shared_expert_as_last(*experts, shared) is not None  # (MoK runs it in the routed launches, as mok.MoELayer's layout)
    assert x.dtype == torch.bfloat16 and idx.dtype == torch.int32 and idx.shape == (64, 2) and w.sum(1).allclose(torch.ones(64))
    assert all(len(set(row.tolist())) == 2 for row in idx)  # (top-k of distinct experts)
    _, _, _, experts, shared = bench.layer_inputs(Shape("s", 64, 256, 128, 8, 2, 256), "cpu")
    assert shared[0].shape == (256, 256) and shared_expert_as_last(*experts, shared) is None
    assert bench.layer_inputs(Shape("s", 64, 256, 128, 8, 2), "cpu")[4] is None


def test_the_benchmark_loop_on_the_cpu_with_a_stand_in_timer(tmp_path):
    """run_layer_benchmarks end to end but for MoK's kernels and the clock: the PyTorch path stands in
    for MoK's (so their results agree exactly), a counter for the timer."""
    import io

    calls = []

    def timer(fn, seconds):
        fn()
        calls.append(seconds)
        return float(len(calls)), {}

    shapes = [Shape("a", 32, 256, 128, 4, 2, 128), Shape("b", 32, 256, 128, 4, 2)]
    out, err, path = io.StringIO(), io.StringIO(), tmp_path / "run.json"
    records, failures = bench.run_layer_benchmarks(
        shapes, seconds=0.5, json_path=path, out=out, err=err, device="cpu", timer=timer,
        mok_impl=lambda shape, inputs, dout: bench.torch_callables(inputs, dout),
    )
    assert failures == [] and calls == [0.5] * 12 and len(records) == 12
    assert bench.load_records(path) == records
    assert all(d == 0 for r in records if r["path"] == "mok" for d in r["rel_diff"].values())
    assert set(records[3]["rel_diff"]) == {"dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_shared_gate", "d_shared_up", "d_shared_down"}
    assert out.getvalue().count("# mok vs torch") == 2 and "# a: 32 tokens" in out.getvalue()
    log = err.getvalue()
    assert "compiling MoK's kernels for a forward (first use; `python -m mok precompile` does it ahead of time)..." in log
    assert "MoK's kernels for b forward+backward: ready after" in log and "b forward: timing dense" in log


def test_moks_path_gets_its_arguments_in_the_right_order():
    """On the CPU mok.forward checks the tensors against the configuration (every shape, the shared
    expert's too) and only then refuses the CPU: the benchmark's call passes the checks."""
    import io

    shapes = [Shape("in-routed", 32, 256, 128, 4, 2, 128), Shape("own", 32, 256, 128, 4, 2, 256), Shape("none", 32, 256, 128, 4, 2)]
    records, failures = bench.run_layer_benchmarks(
        shapes, passes=[FORWARD], paths=["mok"], device="cpu", timer=lambda fn, s: (1.0, {}), out=io.StringIO(), err=io.StringIO(),
    )
    assert records == [] and len(failures) == 3
    assert all("x: expected a CUDA tensor" in f for f in failures), failures


@pytest.mark.gpu
def test_the_benchmark_on_a_gpu_times_moks_layer_and_agrees_with_pytorch(tmp_path):
    """A small `mok bench` run on the GPU with MoK's kernels and the real timer: every pass and
    path timed, MoK's output and gradients within bf16 tolerance of the PyTorch path's."""
    import io

    out, err = io.StringIO(), io.StringIO()
    shapes = [Shape("small", 512, 512, 256, 8, 2, 256), Shape("small-own-shared", 512, 512, 256, 8, 2, 384)]
    records, failures = bench.run_layer_benchmarks(shapes, seconds=0.05, json_path=tmp_path / "run.json", out=out, err=err)
    assert failures == [] and len(records) == 12, err.getvalue()
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in records)
    for r in records:
        if r["path"] == "mok":
            assert max(r["rel_diff"].values()) < bench.AGREEMENT_TOLERANCE, r["rel_diff"]
    assert "SUSPECT" not in out.getvalue() and "torch " + torch.__version__ in out.getvalue()
