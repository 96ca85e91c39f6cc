"""The Blackwell GEMMs' pipelines against a model of their mbarriers (tests/barrier_model.py): every
wait completes, no stage or accumulator is overwritten before it is read, nothing lands after exit,
for each kernel's own stage and accumulator-stage counts, K-tile counts from 0 to 4 x stages, and
CTAs walking several tiles (no SM100 GPU here runs them)."""

import itertools

import pytest

from barrier_model import Hang, Hazard, run_cta, run_pair

tcgen05_tile = pytest.importorskip("mok.kernels.sm100.tcgen05_tile")
from mok.kernels.sm100.grouped_gemm import GroupedGemmMxfp8Sm100, GroupedGemmSm100  # noqa: E402
from mok.kernels.sm100.weight_grad_gemm import WeightGradGemmMxfp8Sm100, WeightGradGemmSm100  # noqa: E402

ORDERS = [("eager", 0), ("lazy", 0)] + [("random", seed) for seed in range(3)]  # when in-flight loads and commits land


def sm100_kernels():
    """One instance of each Blackwell GEMM configuration the layer uses (host side, no compile)."""
    return [
        GroupedGemmSm100(2048, 7168, "swiglu_save", persistent=True),
        GroupedGemmSm100(7168, 2048, "plain", tile_n=256, persistent=True),
        GroupedGemmSm100(7168, 2048, "plain", persistent=True),
        GroupedGemmSm100(768, 2048, "swiglu_bwd", b_major="n", topk=8, persistent=True),
        GroupedGemmMxfp8Sm100(2048, 7168, "swiglu_save", persistent=True),
        GroupedGemmMxfp8Sm100(7168, 2048, "plain", tile_n=256, persistent=True),
        GroupedGemmMxfp8Sm100(7168, 2048, "plain", persistent=True),
        WeightGradGemmSm100(7168, 2048, persistent=True),
        WeightGradGemmSm100(2048, 7168, "f32", True, split_out=True, persistent=True),
        WeightGradGemmMxfp8Sm100(7168, 2048, persistent=True),
    ]


def pipelines(mma_ctas: int = 1):
    """(stages, accumulator stages) of the kernels in sm100_kernels() on ``mma_ctas`` CTAs."""
    return {(kernel.ab_stage, kernel.acc_stages) for kernel in sm100_kernels() if kernel.mma_ctas == mma_ctas}


def test_the_kernels_take_two_accumulator_stages_where_tensor_memory_holds_them():
    """512 columns: SwiGLU's two 128-wide accumulators and a plain 256-wide one fit twice in bf16;
    MXFP8's scales beside them leave room for one such stage, and two of 128-wide plain ones."""
    stages = {(type(kernel).__name__, kernel.epilogue_kind if hasattr(kernel, "epilogue_kind") else "wgrad", kernel.tile_shape_mnk[1]):
              kernel.acc_stages for kernel in sm100_kernels()}
    assert stages[("GroupedGemmSm100", "swiglu_save", 128)] == 2 and stages[("GroupedGemmSm100", "plain", 256)] == 2
    assert stages[("GroupedGemmMxfp8Sm100", "swiglu_save", 128)] == 1 and stages[("GroupedGemmMxfp8Sm100", "plain", 256)] == 1
    assert stages[("GroupedGemmMxfp8Sm100", "plain", 128)] == 2 and stages[("WeightGradGemmMxfp8Sm100", "wgrad", 128)] == 2
    for kernel in sm100_kernels():
        assert kernel.tmem_columns() <= tcgen05_tile.TMEM_COLUMNS


def test_every_kernels_pipeline_drains_for_k_tile_counts_up_to_four_rounds_of_its_stages():
    """Each kernel's stage counts as built; K-tile counts from 0 (an expert without rows, in the weight
    gradient) to 4 x stages, as a CTA's one tile and as each of three, several orders of landing."""
    assert {stages for stages, _ in pipelines()} == {4, 6}  # SwiGLU / 256-wide bf16 and MXFP8; 128-wide bf16, MXFP8 128-wide
    for stages, acc_stages in pipelines():
        for k_tiles, (landing, seed) in itertools.product(range(4 * stages + 1), ORDERS):
            run_cta([k_tiles], stages, acc_stages=acc_stages, landing=landing, seed=seed)
            run_cta([k_tiles] * 3, stages, acc_stages=acc_stages, landing=landing, seed=seed)


@pytest.mark.parametrize("stages", range(2, tcgen05_tile.MAX_STAGES + 1))
@pytest.mark.parametrize("acc_stages", [1, 2])
def test_any_stage_count_the_kernels_accept_drains(stages, acc_stages):
    for k_tiles, (landing, seed) in itertools.product(range(4 * stages + 1), ORDERS):
        run_cta([k_tiles, k_tiles + 1], stages, acc_stages=acc_stages, landing=landing, seed=seed)


@pytest.mark.parametrize("acc_stages", [1, 2])
def test_tiles_in_sequence_with_mixed_and_empty_experts_drain(acc_stages):
    """A persistent CTA's tiles with the pipeline states carried across them: K-tile counts of mixed
    expert sizes, empty ones among them (the weight gradient's experts without rows), one or two
    accumulator stages."""
    for stages, (landing, seed) in itertools.product((2, 4, 7), ORDERS):
        tiles = [3, 0, 1, 2 * stages + 1, 0, 0, stages, 5]
        run_cta(tiles, stages, acc_stages=acc_stages, landing=landing, seed=seed)


@pytest.mark.parametrize("stages", [4, 6, 7])
def test_draining_with_the_state_the_pipeline_was_created_with_is_caught(stages):
    """The exit bug the kernels once had (the producer's tail on setup's state, not the advanced
    one): its waits pass only while a stage's releases are even in number, so where a stage was
    filled an odd number of times they either pass before its last release lands or wait for ever.
    Some order of landing shows one or the other exactly for those K-tile counts."""
    for k_tiles in range(1, 4 * stages + 1):
        caught = set()
        for landing, seed in ORDERS + [("random", seed) for seed in range(3, 20)]:
            try:
                run_cta([k_tiles], stages, tail_state="setup", landing=landing, seed=seed)
            except (Hang, Hazard) as err:
                assert "tail" in str(err)
                caught.add(type(err).__name__)
        assert bool(caught) == bool(k_tiles % (2 * stages)), (k_tiles, caught)


def test_an_accumulator_taken_before_the_epilogue_released_it_is_a_hazard():
    """The model catches an MMA warp that skips the accumulator's empty barrier: one accumulator
    stage and a wait that always passes let tile 1's MMAs into tile 0's unread accumulator."""
    import barrier_model

    class EverPassing(barrier_model.Barrier):
        def passes(self, parity: int) -> bool:
            return True

    cta = barrier_model.Cta(stages=2, acc_stages=1)
    cta.acc_empty = [EverPassing("acc_empty[0]")]
    mma = barrier_model.mma_warp([cta], [0, 0])
    next(mma)  # tile 0's accumulator
    next(mma)  # tile 0 committed (no K tiles); waits for tile 1's
    cta.acc_owner[0] = "done"  # tile 0's commit landed, the epilogue has not read it
    with pytest.raises(Hazard, match="accumulator 0 for tile 1"):
        next(mma)


def test_gathering_pipelines_drain_with_the_rows_as_a_second_arrival():
    """gather_a: the gather warps fill each stage's A rows beside the load warp's TMA bytes (the full
    barrier counts both), on a state of their own: every wait completes, no stage is read before
    both parts landed nor refilled while read, for the gathering kernel's stage count, one or
    several tiles, empty ones among them."""
    kernel = GroupedGemmSm100(2048, 7168, "swiglu_save", persistent=True, gather_a=True)
    stages, acc_stages = kernel.ab_stage, kernel.acc_stages
    assert (stages, acc_stages, kernel.cta_threads) == (4, 2, 320)
    for tiles, (landing, seed) in itertools.product(([5], [3, 0, 2 * stages + 1, 1], [stages] * 3), ORDERS):
        run_cta(tiles, stages, acc_stages=acc_stages, gather=True, landing=landing, seed=seed)


def test_a_full_barrier_that_does_not_wait_for_the_gathered_rows_is_a_hazard():
    """The model catches a kernel whose full barrier counts only the load warp's arrival: in every
    order of landing either the MMAs read a stage whose rows have not landed, or the extra
    arrivals run the barrier's phases ahead of the waits and the pipeline stalls."""
    caught = set()
    for landing, seed in ORDERS + [("random", seed) for seed in range(3, 20)]:
        with pytest.raises((Hang, Hazard)) as err:
            run_cta([6, 3], 4, acc_stages=2, gather=True, full_arrivals=1, landing=landing, seed=seed)
        caught.add(err.type)
        if err.type is Hazard:
            assert "MMA of tile" in str(err.value)
    assert caught


def test_a_load_into_a_stage_still_being_read_is_a_hazard():
    from barrier_model import Cta

    cta = Cta(stages=2, acc_stages=1)
    cta.load(0, tile=0, k=0)
    with pytest.raises(Hazard, match="into stage 0"):
        cta.load(0, tile=0, k=2)


def test_cta_pair_pipelines_drain_with_both_ctas_bytes_and_releases_on_the_leader():
    """The weight gradient's CTA pairs (cta_group::2; tests/barrier_model.py's run_pair): both CTAs'
    loads complete the leader's full barrier, the leader's commits free both CTAs' stages and fill
    both accumulators, both epilogues release the leader's accumulator stage, the leader drains
    every accumulator stage before exit: every wait completes, no stage or accumulator is reused
    early, nothing lands on either CTA after it exited, for the kernels' stage counts, K-tile
    counts 0 .. 4 x stages, one tile or several (empty experts among them)."""
    pairs = pipelines(mma_ctas=2)
    assert pairs == {(8, 2)}  # (128 rows of A + 64 of B) x 64 x 2 bytes a stage: as deep as the kernels go
    for stages, acc_stages in pairs | {(2, 1), (3, 2)}:
        for k_tiles, (landing, seed) in itertools.product(range(4 * stages + 1), ORDERS):
            run_pair([k_tiles], stages, acc_stages=acc_stages, landing=landing, seed=seed)
            run_pair([k_tiles, 0, k_tiles + 1, 2], stages, acc_stages=acc_stages, landing=landing, seed=seed)


def test_a_pair_whose_leader_does_not_drain_its_accumulators_is_caught():
    """Without the leader's accumulator tail the peer's last releases (remote arrivals) can land on
    the leader after it exited; with the tail on the last stage alone (CuTe DSL's
    PipelineUmmaAsync.producer_tail) an earlier stage's release can, unless one thread's remote
    arrivals land in order, which the model does not assume: the kernels wait on every stage."""
    for acc_tail in (None, "last stage"):
        caught = []
        for tiles, (landing, seed) in itertools.product(([0, 0, 0], [3, 2]), ORDERS + [("random", seed) for seed in range(3, 150)]):
            try:
                run_pair(tiles, 4, acc_stages=2, landing=landing, seed=seed, acc_tail=acc_tail)
            except Hazard as err:
                caught.append(str(err))
        assert caught and all("acc_empty" in err and "after it exited" in err for err in caught), (acc_tail, caught)


def test_a_pair_whose_leader_waits_for_its_own_bytes_only_is_caught():
    """An expect-tx that counts one CTA's bytes lets the leader's MMAs read the peer's stage before
    its load landed (or runs the barrier's phases ahead of the waits): a hazard or a hang."""
    caught = set()
    for landing, seed in ORDERS + [("random", seed) for seed in range(3, 20)]:
        with pytest.raises((Hang, Hazard)) as err:
            run_pair([6, 3], 4, acc_stages=2, landing=landing, seed=seed, full_parts=1)
        caught.add(err.type)
    assert caught
