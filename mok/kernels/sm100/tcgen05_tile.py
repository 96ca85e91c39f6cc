"""What MoK's Blackwell GEMM kernels share: tcgen05 MMAs into tensor memory, fed by a TMA multistage
shared-memory pipeline, in warp-specialised CTAs that walk their output tiles (compile-verified
only: no SM100 GPU has run them).

A CTA of six warps takes output tiles (128 x tile_n) ``blockIdx.x``, + ``gridDim.x``, ... in a
static order (persistent: at most one CTA per SM; otherwise one CTA per tile, the same code):
warp 5 issues the TMA loads of each tile's K tiles into the stages as they free up, running ahead
into the next tile; warp 4 issues the MMAs (128 x tile_n x 16, cta_group::1) of each stage onto an
accumulator stage in tensor memory (one or two accumulators per stage, the second in the next
tile_n columns), frees each shared-memory stage on completion (tcgen05.commit onto its empty
barrier) and signals the accumulator stage full once its last MMA has completed; warps 0-3 (the
epilogue) read it back with tcgen05.ld 32x32b (thread t holds row t of the tile, ``EPI_COLS``
columns at a time), release it and apply the subclass's epilogue. With two accumulator stages
(where they fit tensor memory's 512 columns) the next tile's MMAs run under this tile's epilogue.
Before exit warp 5 waits until every stage's last release has landed (the producer's tail) and
the epilogue warps free the tensor memory once all four have read their last tile. K is reduced
in one fixed order, by one CTA per output tile: the result depends only on the tile's inputs,
never on which CTA took it. With ``gather_a`` four more warps (6-9) copy A's rows from the token
matrix into each stage by cp.async (mok/kernels/common/row_gather.py), arriving on its full
barrier beside the load warp's TMA bytes, and the MMA warp fences the generic-proxy writes
before its MMAs read them.

With ``mma_ctas`` = 2 (:meth:`Tcgen05TileKernel.use_pair`; the weight gradients' choice where M
allows) a cluster of two CTAs computes 256 x tile_n tiles with tcgen05.mma.cta_group::2: each
CTA's load warp brings its own 128 rows of A and half of B's tile_n rows (cta_group::2 TMA loads,
completing on the leader's full barrier, whose expect-tx counts both CTAs' bytes); the leader
(even rank) alone issues the MMAs, which read both CTAs' stages and accumulate each CTA's rows in
its own tensor memory; its commits free both CTAs' stages and fill both CTAs' accumulator stages;
both CTAs' epilogues release the leader's accumulator stage (remote arrivals), so the leader
waits for every accumulator stage's last release before it exits, and the two CTAs free their
tensor memory together. Half of B's bytes per CTA: deeper pipelines, and B read from L2 once per
256 rows.

With ``cluster_m`` = 2 (the grouped GEMMs' row-tile pairs; one-CTA MMAs) a cluster of two CTAs walks
pairs of row tiles of one column tile, CTA r taking row tile 2p + r; the subclass decides per pair
whether B is shared (one expert has both row tiles: each CTA's load warp brings half of each B
tile into both CTAs' stages by TMA multicast) or not (each its own B). Either CTA's loads may
write both CTAs' stages, so each MMA warp's commit frees the stage in both CTAs (multicast
commit; an empty barrier takes both CTAs' commits) and the two pipelines move in step; the
accumulators stay each CTA's own. tests/barrier_model.py's run_sharing_pair models it.

With ``mxfp8`` the operands are MXFP8 (E4M3 elements, an E8M0 scale per 32 along K): each stage
also brings the tile's scales (TMA, in the MMA's scale order, see mok.mxfp8.mma_scale_layout), warp 4
copies them into tensor memory (tcgen05.cp) ahead of the stage's block-scaled MMAs
(kind::mxf8f6f4, 128 x tile_n x 32), and a stage holds 128 K values (128 bytes a row, as bf16's 64).

A subclass sets ``tile_shape_mnk``, ``num_b``, ``ab_stage`` and ``persistent``, and writes
``tile_at`` (a linear tile index -> whether it is computed, its K-tile count and its coordinates),
``tma_views`` and ``load_stage`` (the TMA loads of one K tile), and its ``epilogue``; its kernel
calls :meth:`Tcgen05TileKernel.run_tiles`.
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_layout
from cutlass.cute.nvgpu import tcgen05
from cutlass.tensor_utils import LayoutEnum

from ..common.row_gather import GATHER_THREADS
from ..common.row_vectors import VECTOR

TILE_M = 128  # rows of a tile: one tcgen05 MMA's M on one CTA (and the schedule's row tile)
TILE_K = 64  # bf16: four 16-deep MMAs per shared-memory stage (one 128-byte swizzle atom)
TILE_K_MXFP8 = 128  # MXFP8: four 32-deep block-scaled MMAs per stage (128 bytes a row, the same atom)
E4M3_ROW_STEP = 16  # MXFP8: widths are multiples of this (16-byte E4M3 rows, TMA's row strides; mok.mxfp8.ROW_STEP)
SCALE_BLOCK = 32  # MXFP8: elements along K that share one E8M0 scale
SCALE_ATOM = 32  # MXFP8: tensor memory reserved for scales, per stage: (rows / 32) x (MMAs per stage) columns
EPILOGUE_THREADS = 128  # warps 0-3: the epilogue (warp w reads tensor-memory lanes 32w..32w+31: rows of the tile)
MMA_WARP = 4  # issues the tcgen05 MMAs (and MXFP8's scale copies into tensor memory)
LOAD_WARP = 5  # issues the TMA loads
THREADS = 192  # the six warps of a CTA (gather_a: and GATHER_THREADS more, warps 6-9, that copy A's rows)
FIRST_GATHER_WARP = 6
ONE_CTA_PER_SM = 1  # launch bound: shared and tensor memory hold one CTA per SM, so the registers need not leave room for
# more (told nothing, ptxas sizes a 192-thread CTA for three per SM: 96 registers, and the SwiGLU epilogue spills)
EPI_COLS = 32  # accumulator columns a thread reads per tcgen05.ld (32x32b, 32 repetitions)
TMEM_COLUMNS = 512  # tensor memory of an SM: 128 lanes x 512 fp32 columns
SMEM_BYTES = 227 * 1024
MAX_STAGES = 8
PAIR = 2  # CTAs of a pair MMA (``mma_ctas`` = 2): a cluster of two along M, one 256-row tcgen05.mma.cta_group::2
# (also ``cluster_m`` = 2: two CTAs along M on one-CTA MMAs, sharing B's loads by multicast)
TMEM_ALLOC_BARRIER = 1  # named barrier: every warp retrieves the tensor-memory address
EPILOGUE_BARRIER = 2  # named barrier: the epilogue warps' last reads, before the tensor memory is freed
STORE_BARRIER = 3  # named barrier (TMA-stored epilogues): a subtile staged in shared memory; its buffer free again
STORE_BUFFERS = 2  # TMA-stored epilogues: shared-memory buffers of one 128 x 32 subtile each (one stored while the next is staged)
STORE_WARP = 0  # the epilogue warp that issues the subtiles' TMA stores
MAJOR = {"k": cute.nvgpu.OperandMajorMode.K, "mn": cute.nvgpu.OperandMajorMode.MN}


def pick_stages(stage_bytes: int, stages: int | None, reserved: int = 0) -> int:
    """Pipeline depth: as deep as shared memory allows beside ``reserved`` bytes (a TMA-stored
    epilogue's buffers) (at most 8), or ``stages`` if it fits."""
    most = min((SMEM_BYTES - 1024 - reserved) // stage_bytes, MAX_STAGES)
    if stages is not None and not 2 <= stages <= most:
        raise ValueError(f"stages: expected 2..{most} for this tile, got {stages}")
    return most if stages is None else stages


def pick_mxfp8_stages(rows: int, stages: int | None, reserved: int = 0) -> int:
    """:func:`pick_stages` for MXFP8 stages of ``rows`` operand rows (A's and the B's): 128 E4M3
    bytes and 4 scale bytes a row, and the alignment of the three scale buffers."""
    return pick_stages(rows * TILE_K_MXFP8 + rows * (TILE_K_MXFP8 // SCALE_BLOCK) + 3 * 128, stages, reserved)


class Tcgen05TileKernel:
    """Base of the SM100 GEMM kernels (see the module docstring)."""

    num_b = 1  # accumulators (B operands per stage): 2 for SwiGLU's gate and up
    mxfp8 = False  # operands: bf16, or MXFP8 with block-scaled MMAs (see the module docstring)
    persistent = False  # at most max_ctas CTAs walk the tiles (else one CTA per tile)
    gather_a = False  # A's rows gathered from the token matrix by cp.async (the grouped GEMM's gate/up)
    mma_ctas = 1  # CTAs per MMA: 1, or PAIR (see :meth:`pair_reason`)
    cluster_m = 1  # CTAs of a cluster along M with one-CTA MMAs: 1, or PAIR (the subclass shares B's loads; module docstring)
    store_dtype = None  # a TMA-stored epilogue's output element type (:meth:`store_subtile`), or None: stores from registers

    @property
    def cta_group(self):
        """The tcgen05 CTA group of the MMAs, the TMA loads and the tensor-memory allocation."""
        return tcgen05.CtaGroup.TWO if self.mma_ctas == PAIR else tcgen05.CtaGroup.ONE

    @property
    def mma_tiler_mnk(self) -> tuple:
        """The tile one MMA sequence computes: the CTA's tile, ``mma_ctas`` of them stacked along M."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        return (tile_m * self.mma_ctas, tile_n, tile_k)

    def pair_reason(self) -> str | None:
        """Why this kernel cannot run its MMAs on a CTA pair, or None. A pair's two CTAs compute
        128 rows each of one 256 x tile_n product (each holds its rows of A and half of B's
        tile_n rows, the leader issues the MMAs for both): the per-CTA shared memory of B halves
        and B's bytes from L2 per output element halve too. It needs bf16 operands (MXFP8's
        scales are not laid out for pairs here), A loaded by TMA (not gathered) and a tile_n of
        128 or 256 (a 64- or 128-column half of B per CTA)."""
        if self.mxfp8:
            return "MXFP8 operands (their scales' copies into tensor memory are per CTA here)"
        if self.gather_a:
            return "A's rows gathered by the CTA's own warps"
        if self.tile_shape_mnk[1] not in (128, 256):
            return f"tile_n {self.tile_shape_mnk[1]} (a pair splits B's tile: 128 or 256)"
        return None

    def use_pair(self, wanted: bool) -> None:
        """Run the MMAs on CTA pairs when ``wanted`` (raising where :meth:`pair_reason` forbids)."""
        if wanted:
            reason = self.pair_reason()
            if reason is not None:
                raise ValueError(f"mma_ctas=2: not with {reason}")
        self.mma_ctas = PAIR if wanted else 1

    @property
    def cta_threads(self) -> int:
        """Threads of a CTA: the six warps, and the gather warps with ``gather_a``."""
        return THREADS + (GATHER_THREADS if self.gather_a else 0)

    @property
    def cluster_ctas(self) -> int:
        """CTAs of a cluster: a pair MMA's (``mma_ctas``) or a B-sharing pair's (``cluster_m``), else 1."""
        return self.mma_ctas * self.cluster_m

    def grid(self, all_tiles, max_ctas):
        """Host side: the CTAs to launch for ``all_tiles`` tiles of the walk (MMA tiles; row-tile
        pairs' with ``cluster_m``): a cluster for each of min(all_tiles, max_ctas / cluster) when
        persistent, else of all_tiles; at least one cluster."""
        if self.persistent:
            return cutlass.max(cutlass.min(all_tiles, max_ctas // self.cluster_ctas), 1) * self.cluster_ctas
        return cutlass.max(all_tiles, 1) * self.cluster_ctas

    def launch_kernel(self, kernel, all_tiles, max_ctas, stream) -> None:
        """Host side: launch ``kernel`` (the subclass's, its arguments bound) over :meth:`grid`'s CTAs,
        in clusters of :attr:`cluster_ctas`, one CTA per SM."""
        cluster = {"cluster": [self.cluster_ctas, 1, 1]} if self.cluster_ctas > 1 else {}
        kernel.launch(
            grid=[self.grid(all_tiles, max_ctas), 1, 1], block=[self.cta_threads, 1, 1], stream=stream,
            min_blocks_per_mp=ONE_CTA_PER_SM, **cluster
        )

    def store_bytes(self) -> int:
        """Shared memory of a TMA-stored epilogue's staging buffers (0 without one; 1 KiB-aligned)."""
        if self.store_dtype is None:
            return 0
        return STORE_BUFFERS * self.tile_shape_mnk[0] * EPI_COLS * self.store_dtype.width // 8 + 1024

    def store_layout(self):
        """Host side (a TMA-stored epilogue): the staging buffers of ``store_dtype`` in shared memory,
        (128, 32, STORE_BUFFERS), row-major subtiles swizzled as CuTe picks for them."""
        return sm100_utils.make_smem_layout_epi(self.store_dtype, LayoutEnum.ROW_MAJOR, (self.tile_shape_mnk[0], EPI_COLS), STORE_BUFFERS)

    def store_atom(self, m_out: cute.Tensor, reduce_add: bool = False):
        """Host side: the TMA store (or, ``reduce_add``, the fp32 reduce-add into what is there) of one
        staged 128 x 32 subtile into ``m_out``; returns (atom, coordinate tensor shaped as m_out)."""
        op = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        if reduce_add:
            op = cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
        one = cute.slice_(self.store_layout(), (None, None, 0))
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, m_out, one, (self.tile_shape_mnk[0], EPI_COLS))

    def cta_layout_vmnk(self, tiled_mma, whole_cluster: bool = False) -> cute.Layout:
        """The CTAs of one MMA as (V: CTAs of one MMA, M, N, L): (mma_ctas, 1, 1, 1); with
        ``whole_cluster`` those of the cluster: (mma_ctas, cluster_m, 1, 1)."""
        along_m = self.cluster_m if whole_cluster else 1
        return cute.tiled_divide(cute.make_layout((self.mma_ctas * along_m, 1, 1)), (tiled_mma.thr_id,))

    @property
    def operand_dtype(self) -> type:
        """The element type of A and B in memory."""
        return cutlass.Float8E4M3FN if self.mxfp8 else cutlass.BFloat16

    def make_mma(self, a_major: str, b_major: str):
        """Host side: the tiled MMA for operands of these major modes ("k" or "mn"), and the staged
        shared-memory layouts of A and B."""
        if self.mxfp8:
            tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
                cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, MAJOR[a_major], MAJOR[b_major], cutlass.Float8E8M0FNU,
                SCALE_BLOCK, self.cta_group, self.mma_tiler_mnk[:2],
            )
        else:
            tiled_mma = sm100_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, MAJOR[a_major], MAJOR[b_major], cutlass.Float32, self.cta_group,
                self.mma_tiler_mnk[:2],
            )
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler_mnk, self.operand_dtype, self.ab_stage)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler_mnk, self.operand_dtype, self.ab_stage)
        return tiled_mma, a_smem, b_smem

    def make_scale_layouts(self, tiled_mma):
        """Host side (MXFP8): the staged shared-memory layouts of A's and of each B's scales."""
        sfa = blockscaled_layout.make_smem_layout_sfa(tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, self.ab_stage)
        sfb = blockscaled_layout.make_smem_layout_sfb(tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, self.ab_stage)
        return sfa, sfb

    def scale_tensor(self, ptr: cute.Pointer, mn, k: int, batches) -> cute.Tensor:
        """Scales of an (MN, K, L) MXFP8 operand, in the MMA's scale order (mok.mxfp8.mma_scale_layout):
        for each L, 128-row by 128-column chunks of 512 bytes, K's chunks innermost."""
        return cute.make_tensor(ptr, blockscaled_layout.tile_atom_to_shape_SF((mn, k, batches), SCALE_BLOCK))

    def prepare(self, a_major: str, b_major: str, m_a: cute.Tensor, m_bs: tuple, m_sfa=None, m_sfbs: tuple = ()):
        """Host side, what every kernel's launch needs: the tiled MMA, the staged shared-memory layouts
        (A's, B's; MXFP8: then their scales', from ``m_sfa`` / ``m_sfbs``), the TMA loads of A and
        each B (MXFP8: then of their scales), and the CTA's shared storage
        (``shared_storage_type``). Returns (tiled_mma, layouts, loads)."""
        tiled_mma, a_smem, b_smem = self.make_mma(a_major, b_major)
        layouts = (a_smem, b_smem)
        loads = self.load_atoms(tiled_mma, a_smem, b_smem, m_a, *m_bs)
        if self.mxfp8:
            layouts += self.make_scale_layouts(tiled_mma)
            loads += self.scale_load_atoms(tiled_mma, layouts[2], layouts[3], m_sfa, *m_sfbs)
        self.shared_storage_type = self.shared_storage(*layouts)
        return tiled_mma, layouts, loads

    def load_atoms(self, tiled_mma, a_smem, b_smem, m_a: cute.Tensor, *m_bs: cute.Tensor):
        """Host side: TMA load atoms and coordinate tensors of A and each B (all (MN, K, L)), and the
        bytes one stage receives by TMA (``stage_tx_bytes``: A (unless gathered) and ``num_b`` B tiles;
        a pair's leader expects both CTAs' bytes)."""
        atoms, cta_bytes = self.stage_loads(tiled_mma, a_smem, b_smem, self.operand_dtype, m_a, m_bs)
        self.stage_tx_bytes = cta_bytes * self.mma_ctas
        if self.gather_a:
            self.stage_tx_bytes -= cute.size_in_bytes(self.operand_dtype, cute.slice_(a_smem, (None, None, None, 0)))
        if self.cluster_m > 1:  # then each B's load into both CTAs of the cluster, each CTA bringing its 1/cluster_m
            b_stage = cute.slice_(b_smem, (None, None, None, 0))
            g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp(self.cta_group)
            vmnk = self.cta_layout_vmnk(tiled_mma, whole_cluster=True).shape
            atoms += tuple(cute.nvgpu.make_tiled_tma_atom_B(g2s, m_b, b_stage, self.mma_tiler_mnk, tiled_mma, vmnk) for m_b in m_bs)
        return atoms

    def scale_load_atoms(self, tiled_mma, sfa_smem, sfb_smem, m_sfa: cute.Tensor, *m_sfbs: cute.Tensor):
        """Host side (MXFP8, after :meth:`load_atoms`): the same for A's scales and each B's; adds their
        bytes to ``stage_tx_bytes``."""
        atoms, scale_bytes = self.stage_loads(tiled_mma, sfa_smem, sfb_smem, cutlass.Float8E8M0FNU, m_sfa, m_sfbs, cutlass.Int16)
        self.stage_tx_bytes += scale_bytes
        return atoms

    def stage_loads(self, tiled_mma, a_smem, b_smem, dtype, m_a: cute.Tensor, m_bs: tuple, internal_type=None):
        """TMA atoms (A's, then each B's) into one stage of these staged layouts, and the bytes of A's
        and ``num_b`` B's loads. ``internal_type``: the unit the TMA moves (the scales go as 16-bit
        pairs, as NVIDIA's block-scaled kernels load them: fewer, wider boxes)."""
        a_stage = cute.slice_(a_smem, (None, None, None, 0))
        b_stage = cute.slice_(b_smem, (None, None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(self.cta_group)  # (a pair's: completes on the leader's barrier)
        unit = {} if internal_type is None else {"internal_type": internal_type}
        vmnk = self.cta_layout_vmnk(tiled_mma).shape
        atoms = (cute.nvgpu.make_tiled_tma_atom_A(g2s, m_a, a_stage, self.mma_tiler_mnk, tiled_mma, vmnk, **unit),)
        atoms += tuple(cute.nvgpu.make_tiled_tma_atom_B(g2s, m_b, b_stage, self.mma_tiler_mnk, tiled_mma, vmnk, **unit) for m_b in m_bs)
        return atoms, cute.size_in_bytes(dtype, a_stage) + self.num_b * cute.size_in_bytes(dtype, b_stage)

    def shared_storage(self, a_smem, b_smem, sfa_smem=None, sfb_smem=None):
        """Host side: the CTA's shared memory: the pipeline's barriers, the TMEM address, the stages
        (MXFP8: and the stages' scales). (The struct's annotations are evaluated here, with ``self``
        in scope: this module does not postpone annotations.)"""
        b2_elems = cute.cosize(b_smem) if self.num_b == 2 else 8  # no second B buffer otherwise
        dtype, e8m0 = self.operand_dtype, cutlass.Float8E8M0FNU

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.acc_stages * 2]
            tmem_base: cutlass.Int32
            tmem_dealloc_mbar: cutlass.Int64  # (a pair: the two CTAs free their tensor memory together)
            if self.store_dtype is not None:  # a TMA-stored epilogue's staging buffers
                s_store: cute.struct.Align[cute.struct.MemRange[self.store_dtype, cute.cosize(self.store_layout())], 1024]
            s_a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem)], 1024]
            s_b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_smem)], 1024]
            s_b2: cute.struct.Align[cute.struct.MemRange[dtype, b2_elems], 1024]
            if self.mxfp8:  # the stages' scales
                s_sfa: cute.struct.Align[cute.struct.MemRange[e8m0, cute.cosize(sfa_smem)], 128]
                s_sfb: cute.struct.Align[cute.struct.MemRange[e8m0, cute.cosize(sfb_smem)], 128]
                s_sfb2: cute.struct.Align[cute.struct.MemRange[e8m0, cute.cosize(sfb_smem) if self.num_b == 2 else 16], 128]

        return SharedStorage

    def accumulator_columns(self) -> int:
        """Tensor-memory columns of one accumulator stage (one fp32 column per output column, for
        each of the ``num_b`` accumulators)."""
        return self.num_b * self.tile_shape_mnk[1]

    def scale_columns(self) -> tuple[int, int]:
        """MXFP8: tensor-memory columns reserved for A's scales and for each B's (one stage, 4 MMAs
        deep), as CUTLASS's block-scaled kernels reserve them (the copies fill fewer: 4 columns a
        128 rows)."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        mmas = tile_k // SCALE_BLOCK
        return tile_m // SCALE_ATOM * mmas, tile_n // SCALE_ATOM * mmas

    def all_scale_columns(self) -> int:
        """Tensor-memory columns of the scales (A's and each B's; none without MXFP8)."""
        if not self.mxfp8:
            return 0
        sfa_cols, sfb_cols = self.scale_columns()
        return sfa_cols + self.num_b * sfb_cols

    @property
    def acc_stages(self) -> int:
        """Accumulator stages in tensor memory: two where they fit its 512 columns beside the scales
        (the MMAs of the next tile then run under this tile's epilogue), else one."""
        return 2 if 2 * self.accumulator_columns() + self.all_scale_columns() <= TMEM_COLUMNS else 1

    def tmem_columns(self) -> int:
        """Tensor-memory columns to allocate: the accumulator stages' (and MXFP8's scales'), a power of
        two, at least 32."""
        used = self.acc_stages * self.accumulator_columns() + self.all_scale_columns()
        return max(32, 1 << (used - 1).bit_length())

    def operand_view(self, tiled_mma, load, s_x, operand: str, mn_tile, l_index, scales: bool = False, multicast_rank=None):
        """One operand's TMA partition for this CTA's tile: (atom, global by K tile, shared by stage).
        ``load`` = (atom, coordinate tensor (MN, K, L)) from :meth:`load_atoms`, ``operand`` "a" or
        "b", ``mn_tile`` its MMA tile along M (``mma_ctas`` x 128 rows) or N, ``l_index`` its L
        coordinate (an expert, or 0); ``scales``: the operand's MXFP8 scales (from
        :meth:`scale_load_atoms`; their layouts repeat each scale over its 32 elements, which the
        copy leaves out). In a pair each CTA loads its own 128 rows of A and its half of B's tile;
        ``multicast_rank`` (a multicast B load of :meth:`load_atoms`, ``cluster_m``): this CTA's
        rank along M, whose part of the tile it loads into every CTA of the cluster."""
        atom, coords = load
        thr_mma = tiled_mma.get_slice(self.rank_in_pair())
        # global tiles (bM|bN, bK, RestM|RestN, RestK, RestL) as the MMA partitions them, then the TMA's view of them
        if operand == "a":
            g_x = thr_mma.partition_A(cute.local_tile(coords, cute.slice_(self.mma_tiler_mnk, (None, 0, None)), (None, None, None)))
        else:
            g_x = thr_mma.partition_B(cute.local_tile(coords, cute.slice_(self.mma_tiler_mnk, (0, None, None)), (None, None, None)))
        rank, ctas = (0, 1) if multicast_rank is None else (multicast_rank, self.cluster_m)
        s_part, g_part = cute.nvgpu.cpasync.tma_partition(
            atom, rank, cute.make_layout(ctas), cute.group_modes(s_x, 0, 3), cute.group_modes(g_x, 0, 3)
        )
        if scales:
            s_part, g_part = cute.filter_zeros(s_part), cute.filter_zeros(g_part)
        return atom, g_part[(None, mn_tile, None, l_index)], s_part

    @cute.jit
    def setup(self, warp_idx, tiled_mma, layouts, loads):
        """Every thread: the TMA descriptors prefetched (the load warp), shared memory, the two
        pipelines, and the accumulator stages allocated in tensor memory (as (MMA, MMA_M, MMA_N,
        accumulator), accumulator ``num_b·stage + b``). Returns (stages, pipelines, tmem, t_acc,
        the staging buffers of a TMA-stored epilogue or None);
        stages = (A, B, B2) in shared memory, with MXFP8 also their scales', with ``gather_a`` also
        A's first element (the gather's cp.async address it); pipelines = the participants of the
        stages' and the accumulators' pipelines, then the stages' pipeline itself (the gather
        warps wait and arrive on it by state). ``layouts`` and ``loads``: from :meth:`prepare`."""
        a_smem, b_smem = layouts[0], layouts[1]
        if warp_idx == LOAD_WARP:
            for atom, _ in loads:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage_type)
        s_a = storage.s_a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.s_b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        s_b2 = s_b
        if cutlass.const_expr(self.num_b == 2):
            s_b2 = storage.s_b2.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        stages = (s_a, s_b, s_b2)
        if cutlass.const_expr(self.mxfp8):
            sfa_smem, sfb_smem = layouts[2], layouts[3]
            s_sfb = storage.s_sfb.get_tensor(sfb_smem)
            s_sfb2 = s_sfb
            if cutlass.const_expr(self.num_b == 2):
                s_sfb2 = storage.s_sfb2.get_tensor(sfb_smem)
            stages = (s_a, s_b, s_b2, storage.s_sfa.get_tensor(sfa_smem), s_sfb, s_sfb2)
        if cutlass.const_expr(self.gather_a):
            stages = (s_a, s_b, s_b2, storage.s_a.data_ptr())
        pair = self.mma_ctas == PAIR
        tmem = cutlass.memory.TmemAllocator(  # (before the pipelines: their cluster sync publishes its pair barrier too)
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_ALLOC_BARRIER, num_threads=self.cta_threads),
            is_two_cta=pair,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr if pair else None,
        )
        cluster = self.cta_layout_vmnk(tiled_mma)
        # A stage is full once its TMA bytes (a pair's leader: both CTAs') and each gathering thread's rows landed; the
        # leader's MMA completion frees it in both CTAs of a pair; with cluster_m, both CTAs' MMA completions free it in both.
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + (GATHER_THREADS if self.gather_a else 0)),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_m),
            tx_count=self.stage_tx_bytes,
            barrier_storage=storage.ab_mbar.data_ptr(),
            cta_layout_vmnk=self.cta_layout_vmnk(tiled_mma, whole_cluster=True),
        )
        ab_producer, ab_consumer = ab_pipeline.make_participants()
        # An accumulator stage is full in both CTAs of a pair when the leader's MMAs complete; it is free once the epilogue
        # threads of both have read it (their arrivals land on the leader's barrier).
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPILOGUE_THREADS * self.mma_ctas),
            barrier_storage=storage.acc_mbar.data_ptr(),
            cta_layout_vmnk=cluster,
        ).make_participants()
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler_mnk[:2])
        acc_layout = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_b * self.acc_stages)).layout
        tmem.allocate(self.tmem_columns())  # (by warp 0, an epilogue warp; in a pair by both CTAs' warp 0 together)
        tmem.wait_for_alloc()
        t_acc = cute.make_tensor(tmem.retrieve_ptr(cutlass.Float32), acc_layout)
        s_store = None
        if cutlass.const_expr(self.store_dtype is not None):
            store = self.store_layout()
            s_store = storage.s_store.get_tensor(store.outer, swizzle=store.inner)
        return stages, (ab_producer, ab_consumer, acc_producer, acc_consumer, ab_pipeline), tmem, t_acc, s_store

    @cute.jit
    def run_tiles(self, tiled_mma, layouts, loads, tiles, epi_args, gather_args=None):
        """The kernel body, every thread: :meth:`setup`, then its warp's role over the CTA's tiles
        (``tiles`` = (all_tiles, the subclass's arguments of ``tile_at``); ``epi_args``: its
        ``epilogue``'s (a TMA-stored one's get the staging buffers after them); ``gather_args``: its
        ``gather_warps``' with ``gather_a``)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        stages, pipes, tmem, t_acc, s_store = self.setup(warp_idx, tiled_mma, layouts, loads)
        if cutlass.const_expr(self.store_dtype is not None):
            epi_args = (*epi_args, s_store)
        if warp_idx == LOAD_WARP:
            self.load_warp(tiled_mma, loads, stages, pipes, tiles)
        if warp_idx == MMA_WARP:
            if self.rank_in_pair() == 0:  # (a pair's leader issues the MMAs of both CTAs)
                self.mma_warp(tiled_mma, stages, pipes, t_acc, tiles, layouts)
        if cutlass.const_expr(self.gather_a):
            if warp_idx >= FIRST_GATHER_WARP:
                self.gather_warps(tidx - FIRST_GATHER_WARP * 32, stages, pipes, tiles, gather_args)
        if warp_idx < MMA_WARP:  # (last: the tensor memory is freed at its end)
            self.epilogue_warps(tidx, tmem, t_acc, pipes, tiles, epi_args)

    def first_tile_and_step(self):
        """The CTA's tiles in the static order every warp walks: its cluster's index (``blockIdx.x``
        without a cluster), + the clusters of the grid, ... (below all tiles; a tile's work does
        not depend on which CTA takes it)."""
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.cluster_ctas > 1):
            return first // self.cluster_ctas, step // self.cluster_ctas
        return first, step

    def rank_along_m(self):
        """``cluster_m``: this CTA's rank in its cluster (0 or 1: the row tile it takes of a pair)."""
        rank, _, _ = cute.arch.block_idx()
        return rank % self.cluster_m

    def rank_in_pair(self):
        """This CTA's rank in its MMA's CTAs: 0 (the leader, which issues the MMAs), or 1."""
        if cutlass.const_expr(self.mma_ctas == PAIR):
            rank, _, _ = cute.arch.block_idx()
            return rank % PAIR
        return 0

    @cute.jit
    def load_warp(self, tiled_mma, loads, stages, pipes, tiles):
        """The load warp: for each computed tile of the CTA, its K tiles (``load_stage``) into the
        stages as the MMAs free them; then the producer's tail (every stage's last release landed:
        nothing arrives on shared memory after the CTA exits), on the state these loops advanced."""
        ab_producer = pipes[0]
        linear, step = self.first_tile_and_step()
        while linear < tiles[0]:
            active, k_tiles, tile = self.tile_at(linear, tiles)
            if active:
                views = self.tma_views(tiled_mma, loads, stages, tile)
                ab_producer.reset()  # (the handles count this tile's K tiles from 0)
                for _ in cutlass.range(k_tiles, unroll=1):
                    self.load_stage(ab_producer.acquire_and_advance(), views)
            linear += step
        ab_producer.tail()

    @cute.jit
    def mma_warp(self, tiled_mma, stages, pipes, t_acc, tiles, layouts):
        """The MMA warp: for each computed tile, once an accumulator stage is free, acc (acc2) = A·Bᵀ
        (A·B2ᵀ) over its K tiles in order, each stage freed when its MMAs complete; the accumulator
        stage's barrier fires once every MMA of the tile has completed (no K tiles: at once, the
        accumulators unwritten; the epilogue must not read them). MXFP8: each stage's scales copied
        into tensor memory before its block-scaled MMAs (tcgen05.cp and tcgen05.mma from one
        thread run in order)."""
        ab_consumer, acc_producer = pipes[1], pipes[2]
        s_a, s_b, s_b2 = stages[0], stages[1], stages[2]
        r_a = tiled_mma.make_fragment_A(s_a)  # (MMA, MMA_M, MMA_K, stage): shared-memory descriptors
        r_b = tiled_mma.make_fragment_B(s_b)
        r_b2 = tiled_mma.make_fragment_B(s_b2)
        scales = None
        if cutlass.const_expr(self.mxfp8):
            scales = self.scale_copies(tiled_mma, stages, t_acc, layouts[2], layouts[3])
        linear, step = self.first_tile_and_step()
        while linear < tiles[0]:
            active, k_tiles, _ = self.tile_at(linear, tiles)
            if active:
                acc_empty = acc_producer.acquire_and_advance()
                acc = t_acc[(None, None, None, acc_empty.index * self.num_b)]
                acc2 = t_acc[(None, None, None, acc_empty.index * self.num_b + self.num_b - 1)]
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for _ in cutlass.range(k_tiles, unroll=1):
                    full = ab_consumer.wait_and_advance()
                    if cutlass.const_expr(self.gather_a):  # the gathered rows were written through the generic proxy
                        cute.arch.fence_proxy("async.shared", space="cta")
                    tiled_mma = self.mma_stage(tiled_mma, acc, acc2, (r_a, r_b, r_b2), full.index, self.num_b, scales)
                    full.release()  # the stage is free once these MMAs complete
                acc_empty.commit()  # the accumulator stage is final once every MMA has completed
            linear += step
        if cutlass.const_expr(self.mma_ctas == PAIR):  # the peer's epilogue arrives on this CTA's barriers: before exit, every
            for _ in cutlass.range_constexpr(self.acc_stages):  # accumulator stage's last release (not the last stage's
                acc_producer.acquire_and_advance()  # alone: one thread's remote arrivals need not land in order)

    @cute.jit
    def mma_stage(self, tiled_mma, acc, acc2, fragments, stage, num_b: cutlass.Constexpr[int], scales):
        """The MMA warp, one full stage ``stage``: its MMAs (``fragments`` = the shared-memory descriptors
        of A, B, B2 by stage) onto ``acc`` (and with ``num_b`` 2 onto ``acc2`` with B2), accumulating
        from the second on (the caller clears ACCUMULATE for a tile's first stage). MXFP8: the
        stage's scales copied into tensor memory first (tcgen05.cp and tcgen05.mma from one thread
        run in order). Returns ``tiled_mma`` as its ACCUMULATE field now stands: the caller rebinds
        it (the DSL's loops carry an object's fields only through the names they assign)."""
        r_a, r_b, r_b2 = fragments
        if cutlass.const_expr(self.mxfp8):
            self.copy_scales(scales, stage)
        for kb in cutlass.range(cute.size(r_a, mode=[2]), unroll_full=True):
            blk = (None, None, kb, stage)
            if cutlass.const_expr(self.mxfp8):
                (_, _, _, t_sfa), (_, _, _, t_sfb), (_, _, _, t_sfb2) = scales
                sf = (None, None, kb)
                cute.gemm(tiled_mma, acc, [r_a[blk], t_sfa[sf]], [r_b[blk], t_sfb[sf]], acc)
                if cutlass.const_expr(num_b == 2):
                    cute.gemm(tiled_mma, acc2, [r_a[blk], t_sfa[sf]], [r_b2[blk], t_sfb2[sf]], acc2)
            else:
                cute.gemm(tiled_mma, acc, r_a[blk], r_b[blk], acc)
                if cutlass.const_expr(num_b == 2):
                    cute.gemm(tiled_mma, acc2, r_a[blk], r_b2[blk], acc2)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
        return tiled_mma

    @cute.jit
    def epilogue_warps(self, tidx, tmem, t_acc, pipes, tiles, epi_args):
        """Warps 0-3: for each computed tile, wait for its accumulator stage, run the subclass's
        ``epilogue`` on it (which reads it with tcgen05.ld and waits for the loads), release it;
        then, once all four warps are done (and a TMA-stored epilogue's last stores have read their
        buffers), free the tensor memory."""
        acc_consumer = pipes[3]
        tmem.relinquish_alloc_permit()  # (other CTAs on the SM may allocate)
        linear, step = self.first_tile_and_step()
        while linear < tiles[0]:
            active, k_tiles, tile = self.tile_at(linear, tiles)
            if active:
                acc_full = acc_consumer.wait_and_advance()
                if cutlass.const_expr(self.cluster_m > 1):
                    if self.stores_tile(tile):  # (else the other row tile of the pair alone has rows)
                        self.epilogue(tidx, t_acc, acc_full.index, tile, k_tiles, epi_args)
                else:
                    self.epilogue(tidx, t_acc, acc_full.index, tile, k_tiles, epi_args)
                acc_full.release()
            linear += step
        self.free_tensor_memory(tmem, t_acc)

    @cute.jit
    def free_tensor_memory(self, tmem, t_acc):
        """Warps 0-3 after their last tile: once every TMA store has read its staging buffer (shared
        memory is not released under one still reading it) and all four warps are done, free the
        tensor memory."""
        if cutlass.const_expr(self.store_dtype is not None):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                self.store_pipeline().producer_tail()
        pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER, num_threads=EPILOGUE_THREADS).arrive_and_wait()
        tmem.free(t_acc.iterator)

    def store_pipeline(self):
        """A TMA-stored epilogue's bulk-store groups (STORE_WARP commits and waits on them)."""
        return pipeline.PipelineTmaStore.create(
            num_stages=STORE_BUFFERS, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPILOGUE_THREADS)
        )

    @cute.jit
    def store_subtile(self, tidx, t2r, values: cute.Tensor, s_store: cute.Tensor, store, sub, buf):
        """A TMA-stored epilogue, every epilogue thread: ``values`` (fp32, this thread's EPI_COLS of its
        row, as tcgen05.ld gave them) into staging buffer ``buf`` as ``store_dtype``; then STORE_WARP
        stores the 128 x 32 subtile by TMA (``store`` = (atom, the tile's coordinate view divided
        into subtiles (128, 32, 1, subtiles)), subtile ``sub``) and waits until at most one store is
        still reading its buffer: the other buffer is free, so successive calls alternate ``buf``
        (0, 1, 0, ...). Rows and columns past the output's bounds are clipped by the TMA."""
        atom, g_epi = store
        r2s = cute.make_tiled_copy_D(sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.store_dtype, cutlass.Float32, t2r), t2r)
        thr = r2s.get_slice(tidx)
        src = r2s.retile(values)
        out = cute.make_rmem_tensor(src.shape, self.store_dtype)
        out.store(src.load().to(self.store_dtype))
        cute.copy(r2s, out, thr.partition_D(s_store)[(None, None, None, buf)])
        cute.arch.fence_view_async_shared()  # (the generic-proxy writes, before the TMA reads them)
        staged = pipeline.NamedBarrier(barrier_id=STORE_BARRIER, num_threads=EPILOGUE_THREADS)
        staged.arrive_and_wait()
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
            s_part, g_part = cute.nvgpu.cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s_store, 0, 2), cute.group_modes(g_epi, 0, 2)
            )
            cute.copy(atom, s_part[(None, buf)], g_part[(None, 0, sub)])
            stores = self.store_pipeline()
            stores.producer_commit()
            stores.producer_acquire()
        staged.arrive_and_wait()

    def scale_copies(self, tiled_mma, stages, t_acc, sfa_smem, sfb_smem):
        """MXFP8, the MMA warp: for A's scales, B's and B2's: (tcgen05.cp copy, shared-memory source
        by stage, tensor-memory destination, the MMAs' view of that tensor memory (MMA, MMA_MN,
        MMA_K)). The scales lie in tensor memory after every accumulator stage: A's, then B's, then
        B2's."""
        sfa_cols, sfb_cols = self.scale_columns()
        base = t_acc.iterator + self.acc_stages * self.accumulator_columns()
        e8m0 = cutlass.Float8E8M0FNU
        sfa_layout = blockscaled_layout.make_tmem_layout_sfa(
            tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, cute.slice_(sfa_smem, (None, None, None, 0))
        )
        sfb_layout = blockscaled_layout.make_tmem_layout_sfb(
            tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, cute.slice_(sfb_smem, (None, None, None, 0))
        )
        t_sfa = cute.make_tensor(cute.recast_ptr(base, dtype=e8m0), sfa_layout)
        t_sfb = cute.make_tensor(cute.recast_ptr(base + sfa_cols, dtype=e8m0), sfb_layout)
        t_sfb2 = cute.make_tensor(cute.recast_ptr(base + sfa_cols + (self.num_b - 1) * sfb_cols, dtype=e8m0), sfb_layout)
        return (
            self.scale_copy(stages[3], t_sfa) + (t_sfa,),
            self.scale_copy(stages[4], t_sfb) + (t_sfb,),
            self.scale_copy(stages[5], t_sfb2) + (t_sfb2,),
        )

    def scale_copy(self, s_sf: cute.Tensor, t_sf: cute.Tensor) -> tuple:
        """One operand's scales, shared memory (by stage) -> tensor memory: tcgen05.cp 32x128b.warpx4
        (each 16-byte line to four lane quarters). Returns (copy, source by stage, destination)."""
        s_compact, t_compact = cute.filter_zeros(s_sf), cute.filter_zeros(t_sf)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), cutlass.Float8E8M0FNU)
        copy = tcgen05.make_s2t_copy(atom, t_compact)
        thr = copy.get_slice(0)
        return copy, tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(s_compact)), thr.partition_D(t_compact)

    @cute.jit
    def copy_scales(self, scales, stage):
        """MXFP8, the MMA warp: stage ``stage``'s scales of A and B (and B2) into tensor memory."""
        for operand in cutlass.range_constexpr(1 + self.num_b):
            copy, src, dst, _ = scales[operand]
            cute.copy(copy, src[(None, None, None, None, stage)], dst)

    def accumulator_reader(self, tidx, t_acc, stage):
        """The epilogue's tcgen05.ld copy, this thread's slice of it, and the sources
        (T2R, T2R_M, T2R_N, 1, subtiles) of the first and the last accumulator of accumulator stage
        ``stage``."""
        epi_tile = (self.tile_shape_mnk[0], EPI_COLS)
        load_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32)
        first = stage * self.num_b
        acc_epi = cute.flat_divide(t_acc[((None, None), 0, 0, first)], epi_tile)  # (128, 32, 1, subtiles)
        acc2_epi = cute.flat_divide(t_acc[((None, None), 0, 0, first + self.num_b - 1)], epi_tile)
        t2r = tcgen05.make_tmem_copy(load_atom, acc_epi[(None, None, 0, 0)])
        thr = t2r.get_slice(tidx)
        return t2r, thr, thr.partition_S(acc_epi), thr.partition_S(acc2_epi)

    @cute.jit
    def copy_row_part(self, src: cute.Tensor, dst: cute.Tensor, cols_left, partial: cutlass.Constexpr):
        """A thread's ``EPI_COLS`` consecutive values of its row, ``src`` -> ``dst`` (registers to
        global memory or back), 16 bytes at a time; with ``partial`` (a width the tile does not
        divide) only the first ``cols_left`` where fewer are left in the row (a multiple of 8)."""
        if cutlass.const_expr(not partial):
            cute.autovec_copy(src, dst)
        else:
            if cols_left >= EPI_COLS:
                cute.autovec_copy(src, dst)
            else:
                flat = cute.make_layout(EPI_COLS)
                src_v = cute.zipped_divide(cute.make_tensor(src.iterator, flat), (VECTOR,))
                dst_v = cute.zipped_divide(cute.make_tensor(dst.iterator, flat), (VECTOR,))
                for c in cutlass.range_constexpr(EPI_COLS // VECTOR):
                    if c * VECTOR < cols_left:
                        cute.autovec_copy(src_v[None, c], dst_v[None, c])

    def thread_view(self, thr, tile: cute.Tensor) -> cute.Tensor:
        """This thread's part of a (128, tile_n) tile, by subtile: (T2R, T2R_M, T2R_N, 1, subtiles)."""
        return thr.partition_D(cute.flat_divide(tile, (self.tile_shape_mnk[0], EPI_COLS)))
