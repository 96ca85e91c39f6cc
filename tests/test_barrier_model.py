"""The Blackwell GEMMs' pipelines against a model of their mbarriers (tests/barrier_model.py): every
wait completes, no stage is overwritten before its MMAs read it, nothing lands after exit, for each
kernel's own stage count and K-tile counts from 0 to 4 x stages (no SM100 GPU here runs them)."""

import itertools

import pytest

from barrier_model import Hang, Hazard, run_cta

tcgen05_tile = pytest.importorskip("mok.kernels.sm100.tcgen05_tile")
from mok.kernels.sm100.grouped_gemm import GroupedGemmMxfp8Sm100, GroupedGemmSm100  # noqa: E402
from mok.kernels.sm100.weight_grad_gemm import WeightGradGemmMxfp8Sm100, WeightGradGemmSm100  # noqa: E402

ORDERS = [("eager", 0), ("lazy", 0)] + [("random", seed) for seed in range(3)]  # when in-flight loads and commits land


def sm100_kernels():
    """One instance of each Blackwell GEMM configuration the layer uses (host side, no compile)."""
    return [
        GroupedGemmSm100(2048, 7168, "swiglu_save"),
        GroupedGemmSm100(7168, 2048, "plain", tile_n=256),
        GroupedGemmSm100(7168, 2048, "plain"),
        GroupedGemmSm100(768, 2048, "swiglu_bwd", b_major="n", topk=8),
        GroupedGemmMxfp8Sm100(2048, 7168, "swiglu_save"),
        GroupedGemmMxfp8Sm100(7168, 2048, "plain", tile_n=256),
        WeightGradGemmSm100(7168, 2048),
        WeightGradGemmSm100(2048, 7168, "f32", True, split_out=True),
        WeightGradGemmMxfp8Sm100(7168, 2048),
    ]


def test_every_kernels_pipeline_drains_for_k_tile_counts_up_to_four_rounds_of_its_stages():
    """Each kernel's stage count as built; K-tile counts from 0 (an expert without rows, in the weight
    gradient) to 4 x stages, each a CTA's one tile, several orders of landing."""
    stage_counts = {kernel.ab_stage for kernel in sm100_kernels()}
    assert stage_counts >= {4, 6, 7}  # SwiGLU / 256-wide bf16, MXFP8 128-wide, bf16 128-wide (shared memory / stage bytes)
    for stages in stage_counts:
        for k_tiles, (landing, seed) in itertools.product(range(4 * stages + 1), ORDERS):
            run_cta([k_tiles], stages, tcgen05_tile.load_lookahead(stages), landing=landing, seed=seed)


@pytest.mark.parametrize("stages", range(2, tcgen05_tile.MAX_STAGES + 1))
def test_any_stage_count_the_kernels_accept_drains(stages):
    for k_tiles, (landing, seed) in itertools.product(range(4 * stages + 1), ORDERS):
        run_cta([k_tiles], stages, tcgen05_tile.load_lookahead(stages), landing=landing, seed=seed)


@pytest.mark.parametrize("acc_stages", [1, 2])
def test_tiles_in_sequence_with_mixed_and_empty_experts_drain(acc_stages):
    """Several tiles on one CTA with the pipeline states carried (a persistent order): K-tile counts
    of mixed expert sizes, empty ones among them, one or two accumulators."""
    for stages, (landing, seed) in itertools.product((2, 4, 7), ORDERS):
        tiles = [3, 0, 1, 2 * stages + 1, 0, 0, stages, 5]
        run_cta(tiles, stages, tcgen05_tile.load_lookahead(stages), acc_stages=acc_stages, landing=landing, seed=seed)


@pytest.mark.parametrize("stages", [4, 6, 7])
def test_draining_with_the_state_the_pipeline_was_created_with_hangs_unless_every_stage_filled_an_even_number_of_times(stages):
    """The exit hang the kernels had (the producer's tail on setup's state, not the advanced one, after
    the epilogue, so with every release landed): the model must find it exactly where the waits'
    parity is wrong."""
    lookahead = tcgen05_tile.load_lookahead(stages)
    for k_tiles in range(4 * stages + 1):
        if k_tiles % (2 * stages):
            with pytest.raises(Hang, match="tail"):
                run_cta([k_tiles], stages, lookahead, tail_state="setup", landing="eager")
        else:
            run_cta([k_tiles], stages, lookahead, tail_state="setup", landing="eager")


def test_loading_as_many_k_tiles_ahead_as_there_are_stages_deadlocks_the_warp_on_itself():
    """Warp 0 both loads and consumes: a load waiting for a stage only its own next MMAs free never ends."""
    for landing in ("eager", "lazy"):
        with pytest.raises(Hang, match="warp 0: stage 0 for a load"):
            run_cta([5], 4, lookahead=4, landing=landing)
        run_cta([4], 4, lookahead=4, landing=landing)  # every K tile loaded by the fill: no wait on itself


def test_a_load_into_a_stage_still_being_read_is_a_hazard():
    from barrier_model import Cta

    cta = Cta(stages=2, acc_stages=1)
    cta.load(0, tile=0, k=0)
    with pytest.raises(Hazard, match="into stage 0"):
        cta.load(0, tile=0, k=2)
