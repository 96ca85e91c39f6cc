"""The Blackwell GEMMs' pipelines against a model of their mbarriers (tests/barrier_model.py): every
wait completes, no stage or accumulator is overwritten before it is read, nothing lands after exit,
for each kernel's own stage and accumulator-stage counts, K-tile counts from 0 to 4 x stages, and
CTAs walking several tiles (no SM100 GPU here runs them); and the one-launch forward's waits
across CTAs."""

import itertools

import pytest

from barrier_model import Hang, Hazard, run_cta, run_one_launch, run_pair, run_sharing_pair

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


def expert_mlp_tiles(kernel, fc1: int, fc2: int) -> tuple[list[int], list[bool]]:
    """A one-launch CTA's walk: ``fc1`` fc1 tiles (rows gathered), then ``fc2`` fc2 tiles (A by TMA,
    the gather thread's arrival only); (K-tile counts, whether rows are copied)."""
    return [kernel.fc1.k_tiles] * fc1 + [kernel.fc2.k_tiles] * fc2, [True] * fc1 + [False] * fc2


@pytest.mark.parametrize("shape", [(7168, 2048, 8, 32), (2048, 768, 8, 128), (2880, 2880, 4, 32)], ids=["dsv3", "qwen3-30b", "gpt-oss"])
def test_the_one_launch_expert_mlp_pipeline_drains_across_its_two_phases(shape):
    """mok/kernels/sm100/expert_mlp.py: one set of stages and accumulator stages for fc1's tiles
    (gate/up over H, rows gathered) and then fc2's (down over I, A by TMA, the gather warps'
    arrival without rows keeping the full barriers' count): every wait completes, no stage is
    read before both of its arrivals nor refilled while read, for the kernel's own stage and
    accumulator-stage counts and the shapes' K-tile counts, CTAs with fc1 tiles only, fc2 tiles
    only, both, or none."""
    from mok.kernels.sm100.expert_mlp import ExpertMlpSm100

    hidden, inter, topk, experts = shape
    kernel = ExpertMlpSm100(hidden, inter, topk, num_experts=experts, save_h=True)
    stages, acc_stages = kernel.ab_stage, kernel.acc_stages
    assert (stages, acc_stages, kernel.cta_threads, kernel.tmem_columns()) == (4, 2, 320, 512)
    for (fc1, fc2), (landing, seed) in itertools.product([(0, 0), (3, 0), (0, 3), (1, 1), (2, 5), (5, 2)], ORDERS):
        tiles, copied = expert_mlp_tiles(kernel, fc1, fc2)
        run_cta(tiles, stages, acc_stages=acc_stages, gather=True, copied=copied, landing=landing, seed=seed)


def test_an_arrival_for_a_stage_not_yet_free_is_caught():
    """Why the gather thread waits for an fc2 stage to be free before it arrives: without the wait its
    arrival may complete the stage's earlier fill (the MMAs then read a stage whose TMA bytes of
    this fill have not landed) or count twice in one phase."""
    caught = set()
    for landing, seed in ORDERS + [("random", seed) for seed in range(3, 20)]:
        with pytest.raises((Hang, Hazard)) as err:
            run_cta([3, 5, 5, 5], 4, acc_stages=2, gather=True, copied=[True, False, False, False], wait_free=False,
                    landing=landing, seed=seed)
        caught.add(err.type)
    assert caught


@pytest.mark.parametrize("publish", ["lazy", "eager"])
def test_the_one_launch_ready_protocol_completes_for_any_grid_and_tile_counts(publish):
    """Across CTAs (common/expert_mlp.py; SM100's static walk): fc2 tiles wait for their row tile's
    fc1 tiles, which other CTAs (or the same one) publish once their stores are done. With the
    kernels' publish (the previous fc1 tile when the next tile's accumulator is full, the last one
    when fc1 ends) and with an eager one, every launch completes and every row tile is counted
    whole: 1-8 CTAs, 1-5 row tiles, column tiles of both phases, one or three tiles of stages, one
    or two accumulator stages, random orders."""
    grids = itertools.product((1, 2, 3, 8), (1, 2, 5), ((1, 1), (2, 3), (6, 2)), (1, 3), (1, 2), range(3))
    for ctas, rows, (fc1_cols, fc2_cols), stage_tiles, acc_stages, seed in grids:
        run_one_launch(ctas, rows, fc1_cols, fc2_cols, stage_tiles=stage_tiles, acc_stages=acc_stages, publish=publish, seed=seed)


@pytest.mark.parametrize("publish", ["next_tile", "at_exit"])
def test_a_publish_that_waits_for_a_later_tile_of_the_cta_hangs(publish):
    """Why the store warp publishes the CTA's last fc1 tile when fc1 ends: published only when a later
    tile's accumulator is full (or after every tile), a CTA whose next tile is an fc2 tile of the
    same row tile waits for itself."""
    for seed in range(5):
        with pytest.raises(Hang, match="CTA 0 load warp: row tile 0 of fc2 tile 2"):
            run_one_launch(1, 1, 2, 2, publish=publish, seed=seed)


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


def sharing_pipelines():
    """(stages, accumulator stages) of the grouped GEMMs on row-tile pairs (``cluster_m`` = 2): SM100's
    and Hopper's (whose accumulators are its MMA warps' registers: one stage in the model)."""
    from mok.kernels.sm90.grouped_gemm import GroupedGemmSm90

    shapes = [dict(n=2048, k=7168, epilogue="swiglu_save", gather_a=True), dict(n=7168, k=2048, tile_n=256), dict(n=7168, k=2048),
              dict(n=7168, k=4096, k_split=True, b_major="n")]
    sm100 = {(g.ab_stage, g.acc_stages) for g in (GroupedGemmSm100(persistent=True, cluster_m=2, **shape) for shape in shapes)}
    fp8 = [dict(n=2048, k=7168, epilogue="swiglu_save", operand="e4m3_block"), dict(n=7168, k=2048, operand="e4m3_block")]
    hopper = {(GroupedGemmSm90(persistent=True, cluster_m=2, **shape).ab_stage, 1) for shape in shapes + fp8}
    return sm100 | hopper


def test_row_tile_pairs_sharing_b_drain_for_every_mix_of_shared_and_own_loads():
    """Row-tile pairs (cluster_m=2, tests/barrier_model.py's run_sharing_pair): each CTA's A, B halves
    multicast into both CTAs where one expert has both row tiles, each CTA's own B where not, every
    stage freed by both CTAs' releases: every wait completes, no half of B lands in a stage the
    other CTA still reads, nothing lands on a CTA after it exited, for the kernels' stage counts,
    K-tile counts 0 .. 4 x stages, pairs all shared, none shared and mixed."""
    pipelines = sharing_pipelines()
    assert {stages for stages, _ in pipelines} >= {4, 6}
    for stages, acc_stages in pipelines | {(2, 1), (3, 2)}:
        for k_tiles, (landing, seed) in itertools.product(range(4 * stages + 1), ORDERS):
            for shared in ([True], [False], [True, False, True, True, False]):
                run_sharing_pair([(k_tiles, s) for s in shared], stages, acc_stages=acc_stages, landing=landing, seed=seed)


@pytest.mark.parametrize("broken", [dict(empty_arrivals=1), dict(release_to_peer=False)])
def test_row_tile_pairs_that_free_a_stage_on_one_ctas_release_are_caught(broken):
    """A stage freed by its own CTA's release alone lets the other CTA's half of B land in it while
    its MMAs still read it (or runs the phases apart: a hang); releases that do not reach the other
    CTA leave its loads waiting for ever."""
    caught = set()
    for landing, seed in ORDERS + [("random", seed) for seed in range(3, 40)]:
        try:
            run_sharing_pair([(9, True), (5, True), (7, False)], 4, acc_stages=2, landing=landing, seed=seed, **broken)
        except (Hang, Hazard) as err:
            caught.add(type(err))
    assert caught == ({Hang} if "release_to_peer" in broken else {Hang, Hazard})
