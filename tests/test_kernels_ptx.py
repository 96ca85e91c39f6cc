"""Compile-only checks of every kernel variant for sm_90a and sm_100a: the PTX uses the intended instructions."""

import functools
import re
import shutil
import subprocess
import tempfile

import pytest

from mok.kernels import compiled_ptx, compiled_sass, cuobjdump, variants
from mok.kernels.variants import (
    combine_variant, ep_variant, expert_mlp_variant, gather_variant, grouped_gemm_variant, quantize_fp8_block_variant, quantize_mxfp8_variant,
    schedule_variant, weight_grad_variant,
)


needs_cuobjdump = pytest.mark.skipif(cuobjdump() is None, reason="needs cuobjdump (the CUDA toolkit's, or the nvidia-cuda-cuobjdump wheel's)")


def mxfp8_grouped_gemm(n, k, epilogue="plain", tile_n=None, **options):
    """The MXFP8 grouped GEMM (SM100's block-scaled kernel: one tile per CTA)."""
    return grouped_gemm_variant(n, k, epilogue=epilogue, tile_n=tile_n, operand="e4m3", **options)


def mxfp8_weight_grad(m, n, *args, **options):
    """The MXFP8 weight-gradient GEMM (SM100's block-scaled kernel: one tile per CTA)."""
    return weight_grad_variant(m, n, *args, operand="e4m3", **options)


def count(pattern, text):
    return len(re.findall(pattern, text))


TRY_WAIT = r"mbarrier\.try_wait\.parity\.shared\.b64 \S+, \[[^\]]+\], ([^,]+),"


@functools.lru_cache(maxsize=8)
def assert_warp_specialised_tcgen05_kernel(ptx: str) -> None:
    """SM100's warp-specialised CTA (mok/kernels/sm100/tcgen05_tile.py): six warps (ten gathering); a tile loop
    stepping by the grid (the persistent walk; one pass where the grid covers every tile); after
    the load warp's last TMA load its tail, one wait per stage, each on a parity held in a register
    (the state its loops advanced: a fresh state's constant parity left the CTA waiting for ever,
    or passing early, whenever a stage had been filled an odd number of times), then the MMA warp's
    waits for an accumulator stage and a full stage; the barriers of each stage and of one or two
    accumulator stages; nothing waits after tcgen05.dealloc. The launch bound of one CTA per SM lets
    ptxas give the epilogue its registers (else it plans for three CTAs: 96 registers, spills)."""
    assert re.search(r"\.reqntid (192|320), 1, 1", ptx) and ".minnctapersm 1" in ptx and count(r"%nctaid\.x", ptx) >= 1
    before, after = ptx.split("tcgen05.dealloc")
    assert count(r"mbarrier\.try_wait", after) == 0
    last_load = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.\dd\.shared::", before)][-1]  # (TMA loads: into shared memory)
    parities = re.findall(TRY_WAIT, before[last_load:before.index("tcgen05.mma", last_load)])
    stages = len(parities) - 2  # the tail's, then the MMA warp's accumulator and first stage waits
    acc_stages = (count(r"mbarrier\.init\.shared\.b64", ptx) - 2 * stages) // 2
    assert stages >= 2 and acc_stages in (1, 2), (stages, acc_stages)
    assert all(parity.startswith("%r") for parity in parities), parities


PEER_BIT_CLEARED = -16777224  # and-mask of a shared::cluster mbarrier address: 0xFEFFFFF8, the pair's leader CTA (rank bit 24 clear)


def assert_cta_pair_kernel(ptx: str, cta_bytes: int) -> None:
    """SM100's CTA pair (Tcgen05TileKernel.mma_ctas = 2): the MMAs and every TMA load of the
    cta_group::2 kind and no 1-CTA one; each load completes on the leader's barrier (the peer bit
    of its address cleared), whose expect-tx (issued under a rank test) counts both CTAs' bytes;
    the MMA warp's commits reach both CTAs (multicast); tensor memory allocated and freed by the
    pair; the epilogues' releases and the dealloc handshake arrive on the peer's barriers
    (mapa + mbarrier.arrive.shared::cluster); cluster syncs after the barriers' init."""
    assert count(r"tcgen05\.mma\.cta_group::1", ptx) == 0 and count(r"tcgen05\.mma\.cta_group::2", ptx) > 0
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.(\S+) \[[^\]]+\], \[[^\]]+\], \[(%r\d+)\]", ptx)
    assert loads and all(kind.endswith(".cta_group::2") and kind.startswith("shared::cluster") for kind, _ in loads), loads
    masked = set(re.findall(rf"and\.b32\s+(%r\d+), %r\d+, {PEER_BIT_CLEARED};", ptx))
    assert {barrier for _, barrier in loads} <= masked, (loads, masked)
    expect = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s+mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[%r\d+\], (%r\d+);", ptx)
    assert [int(value) for reg, value, used in expect if reg == used] == [2 * cta_bytes]
    assert count(r"tcgen05\.commit\.cta_group::2\.mbarrier::arrive::one\.shared::cluster\.multicast::cluster", ptx) == 2
    assert count(r"tcgen05\.alloc\.cta_group::2", ptx) == 1 and count(r"tcgen05\.dealloc\.cta_group::2", ptx) == 1
    assert count(r"mapa\.shared::cluster", ptx) >= 2 and count(r"mbarrier\.arrive\.shared::cluster", ptx) >= 2
    assert count(r"barrier\.cluster\.wait", ptx) >= 1


def assert_tma_stored_outputs(ptx: str, outputs: int) -> None:
    """SM100's TMA-stored grouped-GEMM epilogue (Tcgen05TileKernel.store_subtile): each of a subtile's
    ``outputs`` (C; with h's two halves or dh_up and a_scaled, three) staged by four 16-byte shared
    stores a thread (32 bf16 columns of its row), fenced for the async proxy and stored by one TMA
    store, at most one store still reading its buffer after each (bulk wait_group.read 1),
    all drained before exit (0); nothing stored to global memory from registers but the row sums."""
    assert count(r"st\.shared\.v4\.b32", ptx) == 4 * outputs and count(r"fence\.proxy\.async\.shared::cta", ptx) == outputs
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx) == outputs
    assert re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", ptx) == ["1"] * outputs + ["0"]
    assert count(r"st\.global\.v4", ptx) == 0


def assert_scales_lie_past_the_accumulator_stages(ptx: str, kernel) -> None:
    """MXFP8 on SM100: every tcgen05.cp writes tensor-memory columns past all of ``kernel``'s
    accumulator stages (two stages of 128-wide accumulators end at column 256: scales copied below
    that would overwrite the next tile's sums) and inside the allocation the PTX makes."""
    allocated = int(re.search(r"mov\.b32\s+%r\d+, (\d+);\s+tcgen05\.alloc", ptx).group(1))
    assert allocated == kernel.tmem_columns()
    offsets = {reg: int(off) for reg, off in re.findall(r"add\.s32\s+(%r\d+), %r\d+, (\d+);", ptx)}
    columns = [offsets[reg] & 0xFFFF for reg in re.findall(r"tcgen05\.cp\.\S+\s+\[(%r\d+)\]", ptx)]
    assert columns and min(columns) >= kernel.acc_stages * kernel.accumulator_columns(), (columns, kernel.acc_stages)
    assert max(columns) < allocated


def ptxas_log(ptx: str, arch: str = "sm_90a") -> str | None:
    """ptxas -v's report on ``ptx``, or None where no ptxas is installed (kept for the last few
    kernels: a test that checks spills and registers assembles once). (The PTX version is
    lowered to 9.0, which CUDA 13's ptxas reads; nothing it checks depends on it.)"""
    if shutil.which("ptxas") is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(re.sub(r"^\.version \S+", ".version 9.0", ptx, count=1, flags=re.M))
        f.flush()
        log = subprocess.run(["ptxas", f"-arch={arch}", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True, check=True)
    return log.stdout + log.stderr


def ptxas_spill_bytes(ptx: str, arch: str = "sm_90a") -> int | None:
    """Bytes ptxas spills (stores) assembling ``ptx``, or None where no ptxas is installed."""
    log = ptxas_log(ptx, arch)
    return None if log is None else sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def ptxas_registers(ptx: str, arch: str = "sm_90a") -> dict[str, int] | None:
    """Registers per thread ptxas gives each entry of ``ptx``, or None where no ptxas is installed."""
    log = ptxas_log(ptx, arch)
    return None if log is None else {name: int(n) for name, n in re.findall(r"entry function '(\w+)'.*?Used (\d+) registers", log, re.S)}


def assert_wgmmas_not_serialized(ptx: str) -> None:
    """ptxas serializes a kernel's WGMMAs (each waits for the one before; its C7514 report) where
    other instructions may read an in-flight WGMMA's accumulators: a block-scaled mainloop promoting
    one stage while the next one's WGMMAs run must not give it cause."""
    log = ptxas_log(ptx)
    assert log is None or "instructions are serialized" not in log, [line for line in log.splitlines() if "serialized" in line]


def assert_register_handover_fits(ptx: str) -> None:
    """setmaxnreg.inc takes registers from the CTA's pool and waits until the pool has them: a
    kernel whose producer warpgroup frees fewer than its MMA warpgroups ask for never gets past
    the increase (it hangs on the GPU, as 48 + 2 x 232 did). So for every entry that hands
    registers over, 128 x the producer's count + the other threads x the MMA count must fit in
    what the CTA was launched with (threads x ptxas's count; without ptxas, the most a thread
    can have at that CTA size)."""
    registers = ptxas_registers(ptx)
    for entry in re.split(r"\.entry\s+", ptx)[1:]:
        name = entry.split("(", 1)[0].strip()
        lower = [int(n) for n in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", entry)]
        higher = [int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", entry)]
        if not higher:
            continue
        threads = int(re.search(r"\.reqntid\s+(\d+)", entry).group(1))
        launched = registers[name] if registers is not None else 65536 // threads // 8 * 8
        asked = 128 * max(lower or [launched]) + (threads - 128) * max(higher)
        assert asked <= threads * launched, f"{name}: setmaxnreg asks for {asked} registers, the CTA has {threads} x {launched}"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("hidden,topk,has_shared", [(7168, 8, True), (7168, 8, False), (2048, 1, True), (200, 6, False)])
def test_combine_ptx(arch, hidden, topk, has_shared, gathered):
    ptx = compiled_ptx(combine_variant(hidden, topk, has_shared, gathered), arch)
    assert f".target {arch}" in ptx
    per_thread = 8  # bf16 columns per thread
    # one 16-byte load per slot (+ the shared row), one 16-byte store, nothing narrower
    assert count(r"ld\.global\.v4\.b32", ptx) == topk + has_shared
    assert count(r"st\.global\.v4\.b32", ptx) == 1
    assert count(r"st\.global\.(?!v4)", ptx) == 0
    # the fixed order: one single-rounding fma per slot and column, nothing else on the values
    assert count(r"\bfma\.rn\.f32\b", ptx) == per_thread * topk
    assert count(r"\b(add|mul)\.(rn\.)?f32(x2)?\b", ptx) == 0
    assert count(r"\.local", ptx) == 0  # no spills to local memory


def test_every_variant_of_the_default_config_compiles_for_every_arch():
    """Every kernel a layer's plan (mok.plan) launches compiles, on each arch that runs that layer
    (a layer a target refuses has no plan there: mok.plan.refusal says why): the default (EP)
    configuration, a one-GPU one with a shared expert, one with transformers' concatenated gate/up
    weights (the kernels that read them in place), and one in FP8 with block scales."""
    plan = pytest.importorskip("mok.plan")
    from mok.config import DEFAULT_CONFIG, MoKConfig

    configs = [
        DEFAULT_CONFIG, MoKConfig(hidden=2048, intermediate=768, num_experts=64, topk=8, shared_intermediate=1024),
        MoKConfig(hidden=2048, intermediate=768, num_experts=128, topk=8, gate_up_layout="concatenated"),  # transformers' weights
        MoKConfig(hidden=2048, intermediate=768, num_experts=64, topk=8, precision="fp8_block", saved_h_format="recompute"),
    ]
    compiled = 0
    for config in configs:
        for arch in ("sm_90a", "sm_100a", "sm_103a"):
            if plan.refusal(config, arch) is not None:
                continue
            for variant in plan.plan_for(config, arch).variants():
                ptx = compiled_ptx(variant, arch)
                assert f".target {arch}" in ptx
                if arch == "sm_90a":
                    assert_register_handover_fits(ptx)
                elif variant.name in ("grouped_gemm", "weight_grad", "expert_mlp"):  # SM100: every GEMM the warp-specialised tcgen05 kernel
                    assert count(r"tcgen05\.mma", ptx) > 0 and count(r"\bwgmma\b|\bmma\.sync", ptx) == 0, variant.describe()
                    assert_warp_specialised_tcgen05_kernel(ptx)
                    assert ptxas_spill_bytes(ptx, arch) in (None, 0), variant.describe()
                compiled += 1
    assert compiled > 0


PARTIAL_TILE_CONFIGS = [  # widths the 128-wide tiles do not divide (H, I, E, k, options)
    (2880, 2880, 32, 4, dict()),  # gpt-oss's
    (2880, 2880, 32, 4, dict(gate_up_layout="interleaved", activation="clamped_swiglu", expert_bias=True)),  # gpt-oss's weights in place
    (2056, 1032, 16, 4, dict(shared_intermediate=520, fuse_wgrad_accumulation=True)),
    (2056, 1032, 16, 4, dict(gate_up_layout="concatenated", saved_h_format="recompute")),
    (2056, 1032, 8, 4, dict(ep_size=2)),
]


def test_row_strided_weights_and_interleaved_gradients_change_only_the_tma_descriptors_on_hopper():
    """gpt-oss's gate and up read in place as the even and odd rows of one [E, 2I, H] tensor (b_row_stride
    2·H) and their gradient written into such rows (interleaved_out): on Hopper only B's and the
    gradient's TMA descriptors change (host side), the device code is the packed kernels' byte for
    byte; on SM100 the weight gradient's register stores take the row stride, nothing else changes."""
    def body(ptx):
        return ptx[ptx.index(".entry"):]

    h = i = 2880
    gate_up = dict(epilogue="swiglu_save", gather_a=True, activation="clamped_swiglu", bias=True, b_expert_stride=2 * i * h)
    dx = dict(b_major="n", k_split=True, b_expert_stride=2 * i * h)
    pairs = [(grouped_gemm_variant(i, h, **gate_up), grouped_gemm_variant(i, h, **gate_up, b_row_stride=2 * h)),
             (grouped_gemm_variant(h, 2 * i, **dx), grouped_gemm_variant(h, 2 * i, **dx, b_row_stride=2 * h)),
             (weight_grad_variant(2 * i, h, split_out=True), weight_grad_variant(2 * i, h, split_out=True, interleaved_out=True))]
    for packed, strided in pairs:
        assert body(compiled_ptx(strided, "sm_90a")) == body(compiled_ptx(packed, "sm_90a")), strided.describe()
    for packed, strided in pairs[:2]:
        assert body(compiled_ptx(strided, "sm_100a")) == body(compiled_ptx(packed, "sm_100a")), strided.describe()
    with pytest.raises(ValueError, match=r"b_row_stride: expected a multiple of 8 \(16 bytes\) of at least 2880"):
        compiled_ptx(grouped_gemm_variant(i, h, b_row_stride=2 * h + 4, b_expert_stride=2 * i * h), "sm_90a")
    with pytest.raises(ValueError, match=r"interleaved_out: only with split_out"):
        compiled_ptx(weight_grad_variant(2 * i, h, interleaved_out=True), "sm_90a")


@pytest.mark.parametrize("hidden,inter,experts,topk,options", PARTIAL_TILE_CONFIGS)
def test_sm100_partial_tile_variants_keep_tcgen05_tma_and_no_spills(hidden, inter, experts, topk, options):
    """The same layers on SM100 (one launch aside): every GEMM of the plan the warp-specialised
    tcgen05 kernel, fed by TMA (and the gather warps' cp.async), no spills."""
    from mok.config import MoKConfig
    from mok.plan import plan_for

    for variant in plan_for(MoKConfig(hidden, inter, experts, topk, **options), "sm_100a").variants():
        if variant.name not in ("grouped_gemm", "weight_grad"):
            continue
        ptx = compiled_ptx(variant, "sm_100a")
        assert count(r"tcgen05\.mma", ptx) > 0 and count(r"cp\.async\.bulk\.tensor", ptx) > 0, variant.describe()
        assert count(r"\bwgmma\b|\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0, variant.describe()
        assert_warp_specialised_tcgen05_kernel(ptx)
        assert ptxas_spill_bytes(ptx, "sm_100a") in (None, 0), variant.describe()


@pytest.mark.parametrize("hidden,inter,experts,topk,options", PARTIAL_TILE_CONFIGS)
def test_partial_tile_variants_keep_wgmma_tma_and_no_spills(hidden, inter, experts, topk, options):
    """Hopper takes widths that are multiples of 8, not of the tile: every kernel of such a layer's
    plan compiles, its GEMMs on WGMMA fed by TMA (no mma.sync fallback), nothing in local memory,
    ptxas spills nothing (the partial tiles' predicates in the epilogues included) but the 16 bytes
    the gathering producer spills at every width (its 64-bit row addresses: docs/notes/gather-in-gemm.md)
    and the 64 of gpt-oss's clamped SwiGLU in the ping-pong SwiGLU backward (pingpong-backward-gemms.md)."""
    from mok.config import MoKConfig
    from mok.plan import plan_for

    config = MoKConfig(hidden, inter, experts, topk, **options)
    variants = plan_for(config, "sm_90a").variants()
    if config.ep_size == 1:  # the one-launch kernel too (a plan of one_launch=True lists it)
        variants.append(expert_mlp_variant(hidden, inter, topk, experts, save_h=True))
    for variant in variants:
        ptx = compiled_ptx(variant, "sm_90a")
        assert count(r"\.local", ptx) == 0 and count(r"\bmma\.sync", ptx) == 0, variant.describe()
        assert_register_handover_fits(ptx)
        if variant.name in ("grouped_gemm", "weight_grad", "expert_mlp"):
            assert count(r"wgmma\.mma_async", ptx) > 0 and count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) > 0
            known = 16 if variant.config.get("gather_a") else 0
            if variant.config.get("activation") == "clamped_swiglu" and variant.config.get("pingpong"):
                known = 64  # (the ping-pong SwiGLU backward's clamps: docs/notes/pingpong-backward-gemms.md)
            assert ptxas_spill_bytes(ptx) in (None, 0, known), variant.describe()


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("variant,vectors", [
    (grouped_gemm_variant(2880, 2880, epilogue="swiglu_save"), 0), (grouped_gemm_variant(2056, 1032), 0),
    (grouped_gemm_variant(1032, 2056, epilogue="swiglu_bwd", b_major="n", topk=4), 0),
    (grouped_gemm_variant(2056, 2064, b_major="n", k_split=True), 0), (grouped_gemm_variant(2056, 1032, scatter=True, topk=4), 1),
    (weight_grad_variant(2064, 2056, split_out=True), 0), (weight_grad_variant(2064, 2056, "f32", True, split_out=True), 0),
])  # gpt-oss's widths, odd multiples of 8: every SM100 form, partial column (and K, row) tiles
def test_sm100_kernels_take_partial_tiles_storing_nothing_past_the_width(arch, variant, vectors):
    """Widths the tile does not divide: TMA zero-fills the loads past them (k_split: each half of K
    on its own, A's two halves their own TMA views, as for whole tiles); the TMA stores clip at the
    width (no extra stores), the scatter epilogue's register stores store a subtile whole where it
    lies inside the width, else 16 bytes at a time up to it (a second set of the same vector
    stores); nothing else changes: no spills."""
    ptx = compiled_ptx(variant, arch)
    same = ("epilogue", "b_major", "k_split", "topk", "tile_n")
    whole = compiled_ptx(
        grouped_gemm_variant(2048, 2048, **{o: variant.config[o] for o in same if o in variant.config},
                             **({"scatter": True} if variant.config.get("scatter") else {}))
        if variant.name == "grouped_gemm" else
        weight_grad_variant(2048, 2048, variant.config["out_dtype"], variant.config["accumulate"], split_out=True), arch)
    stores = r"st\.global\.v2\.b64" if variant.config.get("out_dtype") == "f32" else r"st\.global\.v4\.b32"
    per_subtile = 8 if variant.config.get("out_dtype") == "f32" else 4
    assert count(stores, ptx) == count(stores, whole) + per_subtile * vectors
    assert count(r"cp\.async\.bulk\.tensor", ptx) == count(r"cp\.async\.bulk\.tensor", whole)
    assert count(r"cp\.reduce\.async\.bulk\.tensor", ptx) == count(r"cp\.reduce\.async\.bulk\.tensor", whole)
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert ptxas_spill_bytes(ptx, arch) in (None, 0)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_sm100_layer_takes_gpt_oss_widths_in_bf16_and_mxfp8(arch):
    """bf16 at multiples of 8, MXFP8 at multiples of 16 (2880, and 2064 / 1040: partial K, column and
    row tiles everywhere); the plan's MXFP8 conversions those of each width: the rows, the weights
    (each expert chunked on its own), dh's halves for the dx GEMM and, down its columns, for the
    split-out weight gradient."""
    from mok.config import MoKConfig
    from mok.plan import plan_for

    plan_for(MoKConfig(2880, 2880, 32, 4, activation="clamped_swiglu", expert_bias=True), arch)
    for h, i in ((2880, 2880), (2064, 1040)):
        variants = plan_for(MoKConfig(h, i, 32, 4, precision="mxfp8"), arch).variants()
        quantizers = [v.config for v in variants if v.name == "quantize_mxfp8"]
        assert dict(bounded=True, mma_order=True, segments=2, width=i) in quantizers  # (dh for k_split)
        assert dict(bounded=True, mma_order=True, columns=True, segments=2, width=i) in quantizers  # (dh for the split-out dW)
        assert dict(mma_order=True, width=h, matrix_rows=i) in quantizers and dict(mma_order=True, width=i, matrix_rows=h) in quantizers
        assert not any(v.name == "dequantize_mxfp8" for v in variants)
        gemms = [v for v in variants if v.config.get("operand") == "e4m3"]
        assert len(gemms) == 7  # gate/up (and with h), down, SwiGLU backward, dx; the two weight gradients
    with pytest.raises(ValueError, match=r"precision='mxfp8': expected widths that are multiples of 16 \(16-byte E4M3 rows\)"):
        plan_for(MoKConfig(2056, 2880, 32, 4, precision="mxfp8"), arch)


MXFP8_PARTIAL_VARIANTS = [  # gpt-oss's width and 2064 / 1040 (16 mod 128, 16 mod 32): K, column and row tiles partial
    (mxfp8_grouped_gemm(2880, 2880, "swiglu_save", 128, topk=4), mxfp8_grouped_gemm(2048, 2048, "swiglu_save", 128, topk=4)),
    (mxfp8_grouped_gemm(1040, 2064, "swiglu", 128, topk=4), mxfp8_grouped_gemm(1024, 2048, "swiglu", 128, topk=4)),
    (mxfp8_grouped_gemm(2064, 1040, "plain", 128, topk=4), mxfp8_grouped_gemm(2048, 1024, "plain", 128, topk=4)),
    (mxfp8_grouped_gemm(2880, 2880, "plain", 256, topk=4), mxfp8_grouped_gemm(2048, 2048, "plain", 256, topk=4)),
    (mxfp8_grouped_gemm(1040, 2064, "swiglu_bwd", 128, topk=4), mxfp8_grouped_gemm(1024, 2048, "swiglu_bwd", 128, topk=4)),
    (mxfp8_grouped_gemm(2064, 2080, "plain", 128, k_split=True), mxfp8_grouped_gemm(2048, 2048, "plain", 128, k_split=True)),
    (mxfp8_grouped_gemm(2880, 5760, "plain", 128, k_split=True), mxfp8_grouped_gemm(2048, 2048, "plain", 128, k_split=True)),
    (mxfp8_grouped_gemm(2064, 1040, "plain", 128, scatter=True, topk=4, persistent=True),
     mxfp8_grouped_gemm(2048, 1024, "plain", 128, scatter=True, topk=4, persistent=True)),
    (mxfp8_weight_grad(2064, 1040), mxfp8_weight_grad(2048, 1024)),
    (mxfp8_weight_grad(2080, 2064, split_out=True), mxfp8_weight_grad(2048, 2048, split_out=True)),
    (mxfp8_weight_grad(5760, 2880, "f32", True, split_out=True), mxfp8_weight_grad(2048, 2048, "f32", True, split_out=True)),
]


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("variant,whole", MXFP8_PARTIAL_VARIANTS, ids=lambda v: v.describe() if hasattr(v, "describe") else None)
def test_sm100_mxfp8_kernels_take_widths_that_are_multiples_of_16(arch, variant, whole):
    """The block-scaled kernels at widths 128 does not divide (compile-verified only): the same
    block-scaled MMAs (kind::mxf8f6f4 with their scale operands), scale copies, TMA loads and stores
    and register stores as the twin at whole widths (the partial tiles are the bf16 kernel's: TMA
    zero-fills, the stores clip; the scatter's register stores their second, 16-byte set), no
    fallback MMA, nothing in local memory, no spills; the K tiles ceil(K / 128) each half, A's
    scales over each half's whole chunks (ops.quantize_mxfp8(segments=2)) and the weight
    gradient's A scales over each half's (quantize_mxfp8_columns(segments=2))."""
    ptx, twin = compiled_ptx(variant, arch), compiled_ptx(whole, arch)
    mma = r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.block32\S*\s+\[[^\]]+\], [^,]+, [^,]+, [^,]+, \[[^\]]+\], \[[^\]]+\]"
    assert count(mma, ptx) == count(mma, twin) > 0  # (D, A, B, the instruction descriptor, then A's and B's scales in tensor memory)
    for instruction in (r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", r"cp\.async\.bulk\.tensor", r"cp\.reduce\.async\.bulk\.tensor",
                        r"tcgen05\.ld\.sync", r"\bfma\.rn\.f32"):  # (the fma: the epilogues' math alone)
        assert count(instruction, ptx) == count(instruction, twin), instruction
    # the scatter's stores and the SwiGLU backward's loads of h from registers: whole subtiles, and 16 bytes at a time up to the width
    stores, loads = r"st\.global\.v4\.b32", r"ld\.global\.v4\.b32"
    assert count(stores, ptx) == count(stores, twin) * (2 if variant.config.get("scatter") else 1)
    assert count(loads, ptx) == count(loads, twin) * (2 if variant.config.get("epilogue") == "swiglu_bwd" else 1)
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16|\bwgmma\b|\bmma\.sync", ptx) == 0
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0)
    assert_warp_specialised_tcgen05_kernel(ptx)
    config = variant.config
    if variant.name == "grouped_gemm":
        from mok.kernels.sm100.grouped_gemm import GroupedGemmMxfp8Sm100

        halves = 2 if config["k_split"] else 1
        kernel = GroupedGemmMxfp8Sm100(config["n"], config["k"], config["epilogue"], k_split=config["k_split"], tile_n=config["tile_n"])
        assert kernel.k_tiles == halves * -(-config["k"] // halves // 128) and kernel.scale_k == kernel.k_tiles * 128
    else:
        from mok.kernels.sm100.weight_grad_gemm import WeightGradGemmMxfp8Sm100

        kernel = WeightGradGemmMxfp8Sm100(config["m"], config["n"], split_out=config.get("split_out", False))
        assert kernel.row_tiles == -(-config["m"] // kernel.halves // 128)


@pytest.mark.parametrize("activation", ["clamped_swiglu", "geglu"])
def test_activation_kernels_compute_it_in_the_swiglu_epilogues(activation):
    """Every kernel that computes the activation (gate/up with and without h, SwiGLU backward
    cooperative and ping-pong, the one-launch forward) is planned with it, a variant of its own
    (its cache key names it), compiles for sm_90a (WGMMA, nothing in local memory) and sm_100a, with
    the activation's instructions: GeGLU's tanh.approx, the clamp's min/max; SwiGLU's kernels have neither."""
    from mok.config import MoKConfig
    from mok.plan import Plan

    config = MoKConfig(2048, 1024, 16, 4, shared_intermediate=512, activation=activation, saved_h_format="recompute")
    variants = [v for v in Plan(config, "sm_90a").variants() if v.config.get("activation")]
    epilogues = {v.config.get("epilogue") for v in variants if v.name == "grouped_gemm"}
    assert epilogues == {"swiglu", "swiglu_save", "swiglu_bwd"} and all(v.config["activation"] == activation for v in variants)
    one_launch = Plan(MoKConfig(2048, 1024, 16, 4, activation=activation, one_launch=True), "sm_90a").variants()
    variants += [v for v in one_launch if v.name == "expert_mlp"]
    assert variants[-1].config["activation"] == activation
    marker = r"tanh\.approx\.f32" if activation == "geglu" else r"\b(min|max)\.f32"
    for variant in variants:
        ptx = compiled_ptx(variant, "sm_90a")
        assert count(marker, ptx) > 0 and count(r"wgmma\.mma_async", ptx) > 0 and count(r"\.local", ptx) == 0, variant.describe()
    default = compiled_ptx(grouped_gemm_variant(1024, 2048, epilogue="swiglu_bwd", b_major="n", topk=4), "sm_90a")
    assert count(r"tanh\.approx", default) == 0 and count(r"\bmax\.f32", default) == 0
    for epilogue in ("swiglu_save", "swiglu_bwd"):
        sm100 = grouped_gemm_variant(1024, 2048, epilogue=epilogue, b_major="n", topk=4, persistent=False, activation=activation)
        assert count(marker, compiled_ptx(sm100, "sm_100a")) > 0


@pytest.mark.parametrize("options", [dict(saved_h_format="recompute"), dict(ep_size=2), dict(gate_up_layout="concatenated")])
def test_bias_kernels_add_the_bias_after_the_mainloop_and_reduce_without_atomics(options):
    """gpt-oss's expert biases on Hopper (a plan with expert_bias, gpt-oss's widths): every kernel
    compiles on WGMMA fed by TMA, nothing in local memory, no spill beyond the gathering producer's
    16 bytes; a GEMM with ``bias`` loads its bias as 32-bit pairs, one per column pair of its
    thread's accumulator and product (tile_n / 8 per accumulator), where its bias-free twin loads
    none; the column sums and row dots read 16-byte vectors and reduce with plain adds (no atomics,
    no float reductions in memory), the row dots with a five-step butterfly."""
    from mok.config import MoKConfig
    from mok.plan import Plan

    plan = Plan(MoKConfig(2880, 2880, 32, 4, expert_bias=True, **options), "sm_90a")
    biased = [v for v in plan.variants() if v.config.get("bias")]
    assert {v.config["epilogue"] for v in biased} == {"swiglu", "swiglu_save", "plain", "swiglu_bwd"}
    pair_loads = r"ld\.global\.(b32|v2\.b16)"
    for variant in biased:
        ptx = compiled_ptx(variant, "sm_90a")
        assert count(r"wgmma\.mma_async", ptx) > 0 and count(r"cp\.async\.bulk\.tensor", ptx) > 0 and count(r"\.local", ptx) == 0
        assert ptxas_spill_bytes(ptx) in (None, 0, 16 if variant.config.get("gather_a") else 0), (variant.describe(), ptxas_spill_bytes(ptx))
        twin = KernelVariantLike(variant, bias=False)
        added = count(pair_loads, ptx) - count(pair_loads, compiled_ptx(twin, "sm_90a"))
        products = 2 if variant.config["epilogue"] in ("swiglu", "swiglu_save") else 1
        want = 0 if variant.config["epilogue"] == "swiglu_bwd" else products * variant.config["tile_n"] // 8
        assert added == want, (variant.describe(), added, want)
    reducers = [v for v in plan.variants() if v.name in ("column_sums", "row_dots")]
    assert sorted(v.name for v in reducers) == ["column_sums", "column_sums", "row_dots"]
    for variant in reducers:
        ptx = compiled_ptx(variant, "sm_90a")
        assert count(r"ld\.global\.v4", ptx) > 0 and count(r"\b(atom|red)\.", ptx) == 0 and count(r"\.local", ptx) == 0
        assert count(r"shfl\.sync\.bfly", ptx) == (5 if variant.name == "row_dots" else 0)


@pytest.mark.parametrize("n,k,options", [(7168, 2048, {}), (2048, 7168, dict(epilogue="swiglu_save")), (7168, 4096, dict(k_split=True)),
                                         (7168, 2048, dict(scatter=True, topk=8)), (2048, 7168, dict(epilogue="swiglu_bwd", topk=8)),
                                         (2048, 7168, dict(epilogue="swiglu_save", gather_a=True))])
def test_fp8_block_gemm_uses_e4m3_wgmmas_and_promotes_every_k_block(n, k, options):
    """FP8 with 128-block scales on Hopper (operand "e4m3_block"): E4M3 x E4M3 WGMMAs (32 deep, four
    per 128-deep stage; SwiGLU's two products as one: gate's and up's 64-row B tiles stacked in one
    stage, four m64n128k32 a stage, A read once), no mma.sync fallback; A, B and the stage's
    row scales by TMA (gathering: x's rows and their scales by cp.async, then the proxy fence before
    the WGMMAs read them); each stage's WGMMAs waited for in full (wait_group 0) before their product is
    promoted with fused multiply-adds (one per accumulator value), the stage's first WGMMA of each
    product overwriting its block accumulator (scale-d 0: no zeroing per stage); nothing spilled or
    in local memory; the registers handed over only by the SwiGLU backward (one product 128 wide,
    24 / 240: its block accumulators beside the epilogue), within the launch count; and the kernel
    is refused on SM100 (which has MXFP8). One set of block accumulators (block_buffers=1; two,
    the plain epilogue's default: the next test)."""
    variant = grouped_gemm_variant(n, k, operand="e4m3_block", block_buffers=1, **options)
    ptx = compiled_ptx(variant, "sm_90a")
    products = 2 if options.get("epilogue") in ("swiglu", "swiglu_save") else 1
    tile_n = variant.config["tile_n"]
    assert count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{products * tile_n}k32\.f32\.e4m3\.e4m3", ptx) == 4
    zeros = set(re.findall(r"mov\.b32\s+(%r\d+), 0;", ptx))
    scale_d = re.findall(r"setp\.ne\.b32\s+p, (%r\d+), 0;\s*wgmma\.mma_async", ptx)
    assert len(scale_d) == 4 and sum(reg in zeros for reg in scale_d) == 1
    assert count(r"wgmma\.mma_async", ptx) == 4 and count(r"\bmma\.sync", ptx) == 0
    assert count(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx) >= 1 and count(r"\.local", ptx) == 0
    assert count(r"\bfma\.rn\.f32", ptx) >= products * tile_n // 2  # (per thread: 64 x tile_n / 128 accumulator values a product)
    if options.get("gather_a"):  # rows by cp.async (16-byte chunks), each row's scale a 4-byte one; B by TMA; the proxy fence
        assert count(r"cp\.async\.cg\.shared\.global", ptx) >= 8 and count(r"cp\.async\.ca\.shared\.global", ptx) >= 1
        twin = compiled_ptx(grouped_gemm_variant(n, k, operand="e4m3_block", block_buffers=1, **{**options, "gather_a": False}), "sm_90a")
        assert count(r"fence\.proxy\.async", ptx) > count(r"fence\.proxy\.async", twin)
    else:
        assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) >= 3
    assert ptxas_spill_bytes(ptx) in (None, 0)
    handover = re.findall(r"setmaxnreg\.(?:dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx)
    assert handover == (["24", "240"] if options.get("epilogue") == "swiglu_bwd" else []) and tile_n == (64 if products == 2 else 128)
    assert_register_handover_fits(ptx)  # (a 64-wide SwiGLU tile launches with fewer registers than 168: no hand-over there)
    with pytest.raises(NotImplementedError, match="Hopper's kernel only \\(SM100 runs power-of-two block scales as MXFP8 operands"):
        compiled_ptx(grouped_gemm_variant(n, k, operand="e4m3_block", **options), "sm_100a")


@pytest.mark.parametrize("n,epilogue,power_of_two", [(2048, "swiglu_save", False), (1536, "swiglu", True), (2880, "swiglu_save", False)])
def test_fp8_swiglu_quantizes_its_activation_in_the_epilogue(n, epilogue, power_of_two):
    """out_format="e4m3_block": the FP8 SwiGLU GEMM writes its activation as E4M3 from the epilogue.
    Per tile and thread: 32 values parked in, and read back from, shared memory as four 16-byte
    vectors; the quad's row maxima by two butterfly shuffles a row; the scale and the factor by
    IEEE division (power-of-two scales: the factor 1 / scale, one division); 32 pairs converted with
    the saturating E4M3 cvt and staged as 16-bit stores; a rounded to bf16 by the packed cvt, as in
    the bf16 kernel (the scalar one, quarter-rate, only for the two row maxima); one TMA store of
    the block tile where the bf16 kernel stored two subtiles of a (h's four stay), and no other
    global store of a; the same WGMMAs, not serialized, nothing spilled. Refused off FP8 operands,
    on row-tile pairs, with another tile or the plain epilogue."""
    bf16_out = compiled_ptx(grouped_gemm_variant(n, 7168, epilogue=epilogue, operand="e4m3_block"), "sm_90a")
    ptx = compiled_ptx(grouped_gemm_variant(n, 7168, epilogue=epilogue, operand="e4m3_block", out_format="e4m3_block",
                                            power_of_two=power_of_two), "sm_90a")
    store = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta"
    h_stores = 4 if epilogue == "swiglu_save" else 0
    assert count(store, bf16_out) == h_stores + 2 and count(store, ptx) == h_stores + 1
    assert count(r"st\.shared\.v4", ptx) == 4 and count(r"ld\.shared\.v4", ptx) == 4
    assert count(r"shfl\.sync\.bfly", ptx) == 4 and count(r"div\.rn\.f32", ptx) == (2 if power_of_two else 4)
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 32 and count(r"st\.shared\.[ub]16", ptx) == 32
    # a rounded to bf16 in pairs as the bf16 kernel rounds it (the packed cvt); alone only the two row maxima
    assert count(r"cvt\.rn\.bf16x2\.f32", ptx) == count(r"cvt\.rn\.bf16x2\.f32", bf16_out) and count(r"cvt\.rn\.bf16\.f32", ptx) == 2
    assert count(r"st\.global", ptx) == count(r"st\.global", bf16_out) + 2  # (the row scales: a store for each of two rows; a none)
    assert count(r"wgmma\.mma_async", ptx) == count(r"wgmma\.mma_async", bf16_out)
    assert_wgmmas_not_serialized(ptx)
    assert ptxas_spill_bytes(ptx) in (None, 0) and count(r"\.local", ptx) == 0
    for bad, match in ((dict(operand="bf16"), "E4M3 output is the FP8"), (dict(cluster_m=2), "cluster_m=1"), (dict(tile_n=128), "tile_n=64"),
                       (dict(epilogue="plain"), "epilogue 'swiglu' or 'swiglu_save'")):
        with pytest.raises(ValueError, match=match):
            compiled_ptx(grouped_gemm_variant(n, 7168, **{"epilogue": epilogue, "operand": "e4m3_block", "out_format": "e4m3_block", **bad}),
                         "sm_90a")


@pytest.mark.parametrize("options", [
    dict(n=7168, k=2048), dict(n=2048, k=7168, epilogue="swiglu_save", gather_a=True), dict(n=7168, k=4096, k_split=True, b_major="n"),
    dict(n=7168, k=2048, scatter=True, topk=8), dict(n=2888, k=1032, bias=True),
    dict(n=2048, k=7168, epilogue="swiglu_save", operand="e4m3_block"), dict(n=2880, k=2880, operand="e4m3_block"),
    dict(n=7168, k=4096, k_split=True, operand="e4m3_block"), dict(n=2048, k=7168, epilogue="swiglu_bwd", topk=8, operand="e4m3_block"),
])
def test_row_tile_pairs_load_b_once_for_both_ctas_by_tma_multicast(monkeypatch, options):
    """cluster_m=2: each B load (B2's too) has a multicast form that writes both CTAs of the
    cluster, beside the one-CTA loads it keeps for pairs of two experts; the CTA's rank read from
    the cluster, the barriers initialised cluster-wide before any load, each stage released to
    both CTAs' empty barriers (remote arrivals, in the loop and for the tile's last stage); the
    same WGMMAs, not serialized, no spills; on FP8 block-scaled operands too (the row scales' own
    TMA load stays one CTA's). Without it the kernel has none of these. Refused outside the
    persistent cooperative kernel."""
    monkeypatch.setattr(variants, "TAIL_SPLIT", False)  # (the one-CTA kernel's loads of whole tiles only, as the pair's)
    single = compiled_ptx(grouped_gemm_variant(**options), "sm_90a")
    pair = compiled_ptx(grouped_gemm_variant(cluster_m=2, **options), "sm_90a")
    a_loads = 2 if options.get("k_split") else 0 if options.get("gather_a") else 1  # (TMA instructions: k_split's two halves of A)
    a_loads += int(options.get("operand") == "e4m3_block")  # (A's row scales, a TMA box each stage)
    if options.get("operand") == "e4m3_block" and options.get("epilogue") == "swiglu_bwd":
        a_loads += 2 * 4  # (the saved h's eight boxes a tile, into the CTA's own shared memory)
    multicast = r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes\.multicast::cluster"
    one_cta = r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global"
    assert count(multicast, pair) == count(one_cta, single) - a_loads > 0 and count(multicast, single) == 0  # (N-major B: 4 boxes a tile)
    assert count(one_cta, pair) == count(one_cta, single) > 0
    assert count(r"%cluster_ctarank", pair) == 1 and count(r"barrier\.cluster\.(arrive|wait)", pair) == 2
    local = r"mbarrier\.arrive\.shared\.b64"  # (the stages' releases: 1-2 a kernel, more in the FP8 mainloops' unrolled turns)
    releases = count(local, single) - count(local, pair)  # (each release site now an arrival on both CTAs' barriers)
    assert releases >= 1
    assert count(r"mbarrier\.arrive\.shared::cluster\.b64", pair) == releases  # (one remote arrival a release site)
    assert 1 <= count(r"mapa\.shared::cluster", pair) <= releases  # (the partner's barrier addresses, shared between sites where ptxas can)
    assert count(r"shared::cluster|barrier\.cluster|%cluster_ctarank", single) == 0
    assert count(r"wgmma\.mma_async", pair) == count(r"wgmma\.mma_async", single)
    assert_wgmmas_not_serialized(pair)
    assert ptxas_spill_bytes(pair) in (None, 0)
    if "gather_a" in options:
        for other in (dict(persistent=False), dict(epilogue="swiglu_bwd", b_major="n", topk=8, pingpong=True)):
            with pytest.raises(ValueError, match="cluster_m=2: only in the persistent cooperative kernel"):
                compiled_ptx(grouped_gemm_variant(2048, 7168, cluster_m=2, **other), "sm_90a")


def nested_elections(ptx: str) -> int:
    """``elect.sync`` instructions in the one-thread branch of another (``cute.arch.elect_one``'s
    lowering: an election whose negated predicate jumps past the region), up to the end of that
    branch's first basic block (where a nested election lands first): there the inner one runs
    on one lane of a full mask, which PTX leaves undefined (a CuTe TMA copy elects its own thread:
    docs/notes/kernel-pitfalls.md)."""
    lines = ptx.splitlines()
    nested = 0
    for i, line in enumerate(lines):
        election = re.search(r"elect\.sync\s+%r\d+\|(%p\d+),\s*-1;", line)
        if not election:
            continue
        skip = re.search(rf"not\.pred\s+(%p\d+),\s*{re.escape(election.group(1))};", "\n".join(lines[i + 1:i + 3]))
        branch = skip and re.search(rf"@{re.escape(skip.group(1))}\s+bra(?:\.uni)?\s+(\$L__\w+);", "\n".join(lines[i + 1:i + 4]))
        if not branch:
            continue
        for later in lines[i + 1:]:  # (to the end of the basic block: a label, or a branch taken always)
            if re.match(r"\$L__\w+:", later) or re.match(r"\s*bra(\.uni)?\s", later):
                break
            nested += "elect.sync" in later
    return nested


def test_no_wgmma_kernel_of_the_layer_is_serialized_by_ptxas():
    """Every WGMMA kernel a Hopper layer launches (DeepSeek-V3's precompile default, bf16 at EP 8;
    one GPU in one launch; fp8_block with its FP8 weight gradients and main_grad) assembles without
    ptxas serializing its WGMMAs (docs/notes/kernel-pitfalls.md: nothing reports it but ptxas -v),
    and none runs an election inside another's one-thread branch (:func:`nested_elections`: the
    FP8 SwiGLU backward's first h load had one, and hung at the layer's shapes)."""
    from mok.config import DEFAULT_CONFIG, MoKConfig
    from mok.plan import Plan

    configs = (DEFAULT_CONFIG, MoKConfig(7168, 2048, 32, 8, one_launch=True),
               MoKConfig(7168, 2048, 32, 8, precision="fp8_block", wgrad_format="fp8_block", fuse_wgrad_accumulation=True))
    kernels = {v.describe(): v for c in configs for v in Plan(c, "sm_90a").variants() if v.name in ("grouped_gemm", "weight_grad", "expert_mlp")}
    assert len(kernels) > 20
    for variant in kernels.values():
        ptx = compiled_ptx(variant, "sm_90a")
        assert_wgmmas_not_serialized(ptx)
        assert nested_elections(ptx) == 0, variant.describe()


@pytest.mark.parametrize("m,n,options", [(7168, 2048, {}), (4096, 7168, dict(split_out=True)),
                                         (2048, 7168, dict(out_dtype="f32", accumulate=True, split_out=True))])
def test_fp8_block_weight_grad_uses_e4m3_wgmmas_and_scales_by_row_and_column(m, n, options, monkeypatch):
    """The weight gradient on FP8 with 1 x 128 blocks along the rows (operand "e4m3_block"): four
    32-deep E4M3 x E4M3 WGMMAs a 128-row stage (128 wide), issued in four places (the first stage,
    the loop's two, the last) into two block accumulators in turn, each stage's issued before the
    previous one's promotion, and not serialized by ptxas; no mma.sync; four TMA loads a stage (the
    two transposes' tiles and their scales) and the TMA store (reduce-add when accumulating); each
    promotion (five places: the loop's two, the last two stages', the last odd one's) reads the
    thread's two row scales and 16 pairs of column scales from shared memory and does one fused
    multiply-add per accumulator value; nothing spilled or in local memory; the register hand-over
    within the launch count; refused on SM100 (MXFP8 there) and outside the persistent cooperative
    kernel. (One stage of a tile under the previous tile's epilogue; two, the default, add a fifth
    place: test_fp8_weight_grad_issues_two_stages_before_the_previous_tiles_epilogue.)"""
    monkeypatch.setattr(variants, "WEIGHT_GRAD_STAGES_UNDER_EPILOGUE", 1)
    variant = weight_grad_variant(m, n, operand="e4m3_block", pingpong=False, deep_turn=0, **options)
    assert weight_grad_variant(m, n, operand="e4m3_block", **options).config["deep_turn"] == 8  # (the default: turns of 8)
    ptx = compiled_ptx(variant, "sm_90a")
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx) == 16 and count(r"wgmma\.mma_async", ptx) == 16
    assert_wgmmas_not_serialized(ptx)
    assert count(r"\bmma\.sync", ptx) == 0
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 4
    store = r"cp\.reduce\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.add" if options.get("accumulate") else r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"
    assert count(store, ptx) >= 1
    assert count(r"ld\.shared\.v2\.b32", ptx) == 5 * 16 and count(r"ld\.shared\.b32", ptx) == 5 * 2
    assert count(r"\bfma\.rn\.f32", ptx) == 5 * 64 and count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx) in (None, 0)
    assert_register_handover_fits(ptx)
    with pytest.raises(NotImplementedError, match="Hopper's kernel only"):
        compiled_ptx(weight_grad_variant(m, n, operand="e4m3_block", pingpong=False, **options), "sm_100a")
    with pytest.raises(ValueError, match="operand='e4m3_block': needs no pingpong"):
        compiled_ptx(weight_grad_variant(m, n, operand="e4m3_block", pingpong=True, **options), "sm_90a")


@pytest.mark.parametrize("options", [{}, dict(k_split=True), dict(scatter=True, topk=8)])
def test_fp8_block_gemm_with_two_block_buffers_overlaps_the_promotion(options):
    """block_buffers=2 (the plain epilogue): the stage's WGMMAs issued in four places (the first
    stage, the loop's two, the last) into the two sets of block accumulators in turn, each before the
    previous stage's promotion (four places, the same fused multiply-adds per value), and not
    serialized by ptxas (nor is one set's); the registers handed over (setmaxnreg) within the launch
    count, nothing spilled; the default for FP8's plain epilogue (bf16 has no block accumulators),
    with turns of 4 stages (deep turns: their own test below)."""
    n, k = (7168, 4096) if options.get("k_split") else (7168, 2048)
    one = compiled_ptx(grouped_gemm_variant(n, k, operand="e4m3_block", block_buffers=1, **options), "sm_90a")
    ptx = compiled_ptx(grouped_gemm_variant(n, k, operand="e4m3_block", block_buffers=2, deep_turn=0, **options), "sm_90a")
    default = grouped_gemm_variant(n, k, operand="e4m3_block", **options).config
    assert default["block_buffers"] == 2 and default["deep_turn"] == 4  # (the defaults here)
    assert "block_buffers" not in grouped_gemm_variant(n, k, **options).config
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx) == 4 * 4
    assert_wgmmas_not_serialized(ptx)
    assert_wgmmas_not_serialized(one)
    assert count(r"\bfma\.rn\.f32", ptx) == 4 * count(r"\bfma\.rn\.f32", one)
    assert count(r"setmaxnreg", ptx) == 2 and count(r"setmaxnreg", one) == 0
    assert ptxas_spill_bytes(ptx) in (None, 0) and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)


@pytest.mark.parametrize("deep_turn", [0, 4])
def test_fp8_swiglu_backward_on_two_block_sets_reads_h_from_shared_memory(deep_turn):
    """The SwiGLU backward (one product 128 wide) on two block sets, its default: the WGMMAs in
    the two-set places (four, more with deep turns), not serialized, nothing spilled, the 24 / 240
    hand-over within the launch count; the saved h TMA-loaded into shared memory (the tile's four
    128 x 32 subtiles of gate and of up: eight boxes more than the one-set kernel loads), waited for
    after the mainloop and read with ldmatrix (two x4 a thread per subtile and half), no global
    load after the mainloop; the one-set kernel (h loaded into registers before the mainloop)
    reads no ldmatrix."""
    ptx = compiled_ptx(grouped_gemm_variant(2048, 7168, operand="e4m3_block", epilogue="swiglu_bwd", topk=8, deep_turn=deep_turn), "sm_90a")
    one = compiled_ptx(grouped_gemm_variant(2048, 7168, operand="e4m3_block", epilogue="swiglu_bwd", topk=8, block_buffers=1), "sm_90a")
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx) == 4 * (4 + deep_turn)
    tma_loads = r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.tile\.mbarrier"
    assert count(tma_loads, ptx) == count(tma_loads, one) + 2 * 4
    last_wait = ptx.rindex("wgmma.wait_group")
    assert count(r"ldmatrix\.sync\.aligned\.m8n8\.x4", ptx[last_wait:]) == 2 * 2 * 4 and count(r"ldmatrix", one) == 0
    assert count(r"mbarrier\.try_wait", ptx[last_wait:]) >= 1 and count(r"ld\.global", ptx[last_wait:]) == 0
    assert re.findall(r"setmaxnreg\.(?:dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx) == ["24", "240"]
    assert_wgmmas_not_serialized(ptx)
    assert ptxas_spill_bytes(ptx) in (None, 0) and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)


@pytest.mark.parametrize("n,k,epilogue,deep_turn", [(7168, 2048, "plain", 8), (7168, 2048, "plain", 4), (2048, 7168, "swiglu_save", 0), (2048, 7168, "swiglu_save", 8)])
def test_fp8_block_gemm_deep_turns_keep_two_stages_in_flight(n, k, epilogue, deep_turn):
    """Two block sets with SwiGLU's stacked products (an n = 2·tile_n WGMMA a step into either set's
    pair) and deep turns (two stages' WGMMAs in flight: each stage's issued before the previous one
    is waited for with wait_group 1; every group retired at the turn's end): not serialized by ptxas,
    nothing spilled, the registers handed over within the launch count; the turn's stages unrolled
    beside the pairs' (three places more WGMMAs are issued from at turn 8: the first, the turn's
    eight, the pairs' two, the last)."""
    ptx = compiled_ptx(grouped_gemm_variant(n, k, operand="e4m3_block", epilogue=epilogue, block_buffers=2, deep_turn=deep_turn), "sm_90a")
    places = 4 + deep_turn  # (the first stage, the turn's, the pairs' two, the last)
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx) == 4 * places
    assert count(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx) == max(deep_turn - 1, 0)
    assert_wgmmas_not_serialized(ptx)
    assert ptxas_spill_bytes(ptx) in (None, 0) and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)


@pytest.mark.parametrize("form,block_buffers", [("plain", 2), ("plain", 1), ("swiglu", 2), ("swiglu_bwd", 2), ("weight_grad", 2)])
def test_fp8_ordered_issue_puts_a_barrier_around_every_stage_issue(monkeypatch, form, block_buffers):
    """variants.ISSUE_ORDER (a set of forms: the grouped GEMM's epilogues, "weight_grad"): the FP8
    kernel's two MMA warpgroups issue each stage's WGMMAs in order, through one named barrier over
    both (id 5, 256 threads) met twice at every place a stage's WGMMAs go out from (warpgroup 1
    before its issue, warpgroup 0 after), in the text order barrier, its four WGMMAs, barrier; a
    config entry of its own (its own cache entry), in the named forms only; with it, as without,
    the WGMMAs not serialized, nothing spilled, the hand-over within the launch count; no such
    barrier in the free order, nor in bf16's kernels (the option refused there)."""
    from mok.kernels import variants
    from mok.kernels.sm90.grouped_gemm import GroupedGemmSm90
    from mok.kernels.sm90.weight_grad_gemm import WeightGradGemmSm90

    def variant(form, operand="e4m3_block"):
        if form == "weight_grad":
            return weight_grad_variant(2048, 7168, operand=operand, split_out=True)
        n, k = (7168, 2048) if form == "plain" else (2048, 7168)
        fp8 = dict(operand=operand, block_buffers=block_buffers) if operand != "bf16" else {}
        return grouped_gemm_variant(n, k, epilogue=form, topk=8, **fp8)

    monkeypatch.setattr(variants, "ISSUE_ORDER", frozenset())
    free = variant(form)
    monkeypatch.setattr(variants, "ISSUE_ORDER", frozenset({form}))
    ordered = variant(form)
    assert ordered.config == {**free.config, "ordered_issue": True}
    assert "ordered_issue" not in variant(form, operand="bf16").config
    assert "ordered_issue" not in variant("swiglu" if form == "plain" else "plain").config
    ptx = compiled_ptx(ordered, "sm_90a")
    barrier = r"bar(?:rier)?\.sync(?:\.aligned)?\s+5,\s*256;"
    places = count(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx) // 4
    assert places >= 1 and count(barrier, ptx) == 2 * places
    assert count(barrier, compiled_ptx(free, "sm_90a")) == 0
    events = re.findall(r"(" + barrier + r"|wgmma\.mma_async)", ptx)
    assert all(events[i : i + 6] == [events[i]] + ["wgmma.mma_async"] * 4 + [events[i]] for i in range(0, len(events), 6)), events[:12]
    assert_wgmmas_not_serialized(ptx)
    assert ptxas_spill_bytes(ptx) in (None, 0) and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)
    with pytest.raises(ValueError, match="ordered_issue: an option of the FP8 mainloop"):
        GroupedGemmSm90(2048, 7168, "plain", ordered_issue=True)
    with pytest.raises(ValueError, match="ordered_issue: an option of the FP8 mainloop"):
        WeightGradGemmSm90(2048, 7168, ordered_issue=True)


def wgmma_and_store_events(ptx: str) -> list[str]:
    """``ptx``'s WGMMAs, their waits and its TMA stores (global <- shared), in text order."""
    return re.findall(r"(wgmma\.mma_async|wgmma\.wait_group|cp\.(?:reduce\.)?async\.bulk\.tensor\.\dd\.global\.shared)", ptx)


def stores_under_wgmmas(ptx: str) -> int:
    """TMA stores (global <- shared) in ``ptx`` that come after a WGMMA and before the next
    ``wgmma.wait_group``, in text order: epilogue stores issued while WGMMAs run."""
    under, in_flight = 0, False
    for event in wgmma_and_store_events(ptx):
        if event == "wgmma.mma_async":
            in_flight = True
        elif event == "wgmma.wait_group":
            in_flight = False
        else:
            under += in_flight
    return under


@pytest.mark.parametrize("options", [{}, dict(split_out=True), dict(out_dtype="f32", accumulate=True, split_out=True)])
def test_fp8_weight_grad_stores_a_tile_under_the_next_tiles_first_stage(options):
    """The FP8 weight gradient (WeightGradGemmSm90.overlaps_epilogue): a tile's epilogue stores
    are issued after the next tile's first stage's WGMMAs and before they are waited for, in the
    loop and nowhere else (the last tile's after the loop); the one form without it (fp32 out
    without deep turns, which then spilled) stores none under WGMMAs."""
    overlapped = compiled_ptx(weight_grad_variant(2048, 7168, operand="e4m3_block", **options), "sm_90a")
    assert stores_under_wgmmas(overlapped) == 4  # (the tile's four 32-column subtiles)
    assert ptxas_spill_bytes(overlapped) in (None, 0)
    if options.get("out_dtype") == "f32":
        one_at_a_time = compiled_ptx(weight_grad_variant(2048, 7168, operand="e4m3_block", deep_turn=0, **options), "sm_90a")
        assert stores_under_wgmmas(one_at_a_time) == 0 and ptxas_spill_bytes(one_at_a_time) in (None, 0)


def wgmmas_in_flight_at_first_store(ptx: str) -> int:
    """WGMMAs issued since the last ``wgmma.wait_group`` when ``ptx``'s first TMA store comes (text order)."""
    in_flight = 0
    for event in wgmma_and_store_events(ptx):
        if event == "wgmma.mma_async":
            in_flight += 1
        elif event == "wgmma.wait_group":
            in_flight = 0
        else:
            return in_flight
    return 0


@pytest.mark.parametrize("options", [{}, dict(out_dtype="f32", accumulate=True, split_out=True)])
def test_fp8_weight_grad_issues_two_stages_before_the_previous_tiles_epilogue(options, monkeypatch):
    """variants.WEIGHT_GRAD_STAGES_UNDER_EPILOGUE = 2 (the default): a tile's first two stages (four
    m64n128k32 WGMMAs each, one per block set) go out before the previous tile's epilogue stores,
    where one stage did with 1; each named in the variant's config (a cache entry of its own); not
    serialized (the second stage is issued, waited for and promoted within one branch: a join would
    copy its registers while in flight), nothing spilled, one wait_group 1 more (stage 0 retired
    while stage 1 runs)."""
    variant = weight_grad_variant(2048, 7168, operand="e4m3_block", **options)
    assert variant.config["stages_under_epilogue"] == 2
    two = compiled_ptx(variant, "sm_90a")
    monkeypatch.setattr(variants, "WEIGHT_GRAD_STAGES_UNDER_EPILOGUE", 1)
    one_variant = weight_grad_variant(2048, 7168, operand="e4m3_block", **options)
    assert "stages_under_epilogue" not in one_variant.config
    one = compiled_ptx(one_variant, "sm_90a")
    assert wgmmas_in_flight_at_first_store(one) == 4 and wgmmas_in_flight_at_first_store(two) == 8
    assert count(r"wgmma\.mma_async", two) == count(r"wgmma\.mma_async", one) + 4
    assert count(r"wgmma\.wait_group\.sync\.aligned\s+1;", two) == count(r"wgmma\.wait_group\.sync\.aligned\s+1;", one) + 1
    assert_wgmmas_not_serialized(two)
    assert ptxas_spill_bytes(two) in (None, 0) and count(r"\.local", two) == 0


def test_fp8_weight_grad_deep_turns_keep_two_stages_in_flight():
    """The FP8 weight gradient's two block accumulators with deep turns (its K, the expert's rows,
    known at run time): a turn's eight stages beside the pairs', wait_group 1 between them, not
    serialized, nothing spilled (a tile's first two stages issued apart: the default
    WEIGHT_GRAD_STAGES_UNDER_EPILOGUE)."""
    variant = weight_grad_variant(4096, 7168, operand="e4m3_block", pingpong=False, split_out=True, deep_turn=8)
    ptx = compiled_ptx(variant, "sm_90a")
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx) == 4 * (4 + 8 + 1)
    assert count(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx) == 8
    assert_wgmmas_not_serialized(ptx)
    assert ptxas_spill_bytes(ptx) in (None, 0) and count(r"\.local", ptx) == 0
    with pytest.raises(ValueError, match="deep_turn: expected 0, or an even count >= 2 with block_buffers=2, got 8 with block_buffers=1"):
        weight_grad_variant(4096, 7168, deep_turn=8)  # (bf16: no block accumulators)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("block_rows,power_of_two,gathered", [(1, False, False), (128, False, False), (1, True, False), (1, False, True)])
def test_fp8_block_quantizer_reads_8_byte_vectors_and_converts_with_the_saturating_cvt(arch, block_rows, power_of_two, gathered):
    """The 128-block quantizer (mok.fp8_block's rule): a lane's four values as one 8-byte load, the
    saturating round-to-nearest E4M3 pair conversion, 4-byte element stores, IEEE divisions for the
    scale and factor (div.rn), a butterfly max over the lanes; nothing in local memory. Gathering:
    each lane reads one of the warp's row indices up front (one more 4-byte load), and each row
    takes its source from a lane by shuffle. Rows: a warp's loads of ROWS_IN_FLIGHT rows all issued
    before its first store (a store between them would hold the next load back)."""
    from mok.kernels.common.fp8_block_quantize import ROWS_IN_FLIGHT
    from mok.kernels.variants import quantize_fp8_block_variant

    ptx = compiled_ptx(quantize_fp8_block_variant(2048, block_rows, power_of_two, bounded=gathered, gathered=gathered), arch)
    plain = compiled_ptx(quantize_fp8_block_variant(2048, block_rows, power_of_two, bounded=gathered), arch)
    assert count(r"ld\.global\.b32", ptx) == count(r"ld\.global\.b32", plain) + int(gathered)
    assert count(r"shfl\.sync\.idx", ptx) == count(r"shfl\.sync\.idx", plain) + ROWS_IN_FLIGHT * gathered  # (one a row of a group)
    if block_rows == 1:
        accesses = re.findall(r"\b(ld\.global\.v4\.b16|st\.global)", ptx)
        assert accesses[:ROWS_IN_FLIGHT] == ["ld.global.v4.b16"] * ROWS_IN_FLIGHT and accesses.count("ld.global.v4.b16") == ROWS_IN_FLIGHT
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) >= 2 and count(r"ld\.global\.v4\.b16", ptx) >= 1
    assert count(r"st\.global\.b32", ptx) >= 1 and count(r"div\.rn\.f32", ptx) >= 1 and count(r"shfl\.sync\.bfly", ptx) >= 5
    assert count(r"\.local", ptx) == 0 and count(r"\b(atom|red)\.", ptx) == 0


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_fp8_block_quantizer_in_the_mma_order_pads_partial_blocks_and_rows_with_scale_one(arch):
    """scale_order "mma" where 128 does not divide a width: a row's last 128-block of 2880 (64
    values, two 32-blocks) has its E8M0 byte twice (x 0x0101) and 127 in the word's other two
    bytes (+ 0x7F7F0000); 2064's (16 values) once and 127 three times; the weights' padding rows
    past N = 1040 the word 0x7F7F7F7F; the column quantizer's chunk rows past M (2880) or past each
    half of dh (two segments of 1040) likewise; whole blocks the byte four times (x 0x01010101) only.
    (Compiled only here for sm_100a; the bytes are checked on Hopper: tests/test_fp8_block_gpu.py.)"""
    from mok.kernels.variants import fp8_weights_quantizer, quantize_fp8_block_variant

    pads = {2: 2139029504, 3: 2139062016}  # (0x7F7F0000, 0x7F7F7F00: 127 in the word's bytes past its 32-blocks)

    def pad_words(width):
        ptx = compiled_ptx(quantize_fp8_block_variant(width, power_of_two=True, bounded=True, mma_scales=True), arch)
        assert count(r"\.local", ptx) == 0 and "16843009" in ptx
        return {n for n, word in pads.items() if re.search(rf"\b{word}\b", ptx)}

    assert pad_words(2048) == set() and pad_words(2880) == {2} and pad_words(2064) == {3}
    weights = compiled_ptx(fp8_weights_quantizer(1040, 2880, True, mma_scales=True), arch)
    assert "0f7F7F7F7F" in weights and re.search(r"\b2139029504\b", weights) and count(r"\.local", weights) == 0  # (the word as fp32)
    whole = compiled_ptx(fp8_weights_quantizer(1024, 2048, True, mma_scales=True), arch)
    assert "0f7F7F7F7F" not in whole and not re.search(r"\b21390(29504|62016)\b", whole)
    whole_columns = compiled_ptx(quantize_fp8_block_variant(2048, power_of_two=True, bounded=True, columns=True, mma_scales=True), arch)
    for width, segments, padding in ((2880, 1, 64), (2080, 2, 112)):  # (the column quantizer: a word a chunk row past M, or past a half of dh)
        columns = compiled_ptx(quantize_fp8_block_variant(width, power_of_two=True, bounded=True, columns=True, mma_scales=True,
                                                          segments=segments), arch)
        assert count(r"st\.global\.b32\s+\[%rd\d+(\+\d+)?\], 2139062143;", columns) == padding and count(r"\.local", columns) == 0
    assert count(r"st\.global\.b32\s+\[%rd\d+(\+\d+)?\], 2139062143;", whole_columns) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("width", [7168, 2880])
def test_fp8_block_quantizer_copying_gathered_rows_loads_each_value_once(arch, width):
    """copies_rows (the backward's dout rows: FP8 and bf16 from one pass): the gathered quantizer's
    loads unchanged (each value read once, for the max and for both stores), one more 8-byte bf16
    store a row of a group (padding rows' zeros included), no local memory."""
    from mok.kernels.common.fp8_block_quantize import ROWS_IN_FLIGHT
    from mok.kernels.variants import quantize_fp8_block_variant

    ptx = compiled_ptx(quantize_fp8_block_variant(width, bounded=True, gathered=True, copies_rows=True), arch)
    plain = compiled_ptx(quantize_fp8_block_variant(width, bounded=True, gathered=True), arch)
    assert count(r"ld\.global", ptx) == count(r"ld\.global", plain)
    assert count(r"st\.global\.v2\.b32", ptx) == count(r"st\.global\.v2\.b32", plain) + ROWS_IN_FLIGHT
    assert count(r"st\.global\.b32", ptx) == count(r"st\.global\.b32", plain)
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", plain)
    assert count(r"\.local", ptx) == 0
    with pytest.raises(ValueError, match="copies_rows: the gathered rows' bf16 copy, with gathered rows"):
        quantize_fp8_block_variant(width, copies_rows=True)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("width,gathered", [(2048, False), (2880, True)])
def test_fp8_block_column_quantizer_loads_rows_and_stores_transposed_16_byte_runs(arch, width, gathered):
    """The transposing quantizer (a weight gradient's K-major FP8 operands): the tile's rows copied
    into shared memory by sixteen 16-byte cp.async a thread (128 rows of 256 bytes; the source size
    a register: 0 zero-fills padding rows and columns past the width), waited for, nothing staged
    in registers; then each thread four adjacent columns of 32 rows, read twice by 8-byte loads
    (32 for the maxima, 32 for the values), the four warps' maxima through shared memory (one
    16-byte store, four 16-byte loads), 64 saturating pair conversions, the transposed E4M3 tile
    through shared memory (two 16-byte stores per column, eight 16-byte loads) and out as eight
    16-byte global stores a thread (whole 128-byte lines a warp), the four scales; nothing spilled
    or in local memory, at most 96 registers. (Gathering: each row's index read first.)"""
    from mok.kernels.variants import quantize_fp8_block_variant

    ptx = compiled_ptx(quantize_fp8_block_variant(width, bounded=gathered, gathered=gathered, columns=True), arch)
    assert count(r"cp\.async\.cg\.shared\.global \[%r\d+(\+\d+)?\], \[%rd\d+\], 16, %r\d+;", ptx) == 16
    assert count(r"cp\.async\.wait_group\s+0;", ptx) == 1 and count(r"ld\.global\.v4", ptx) == 0
    assert count(r"ld\.shared\.v4\.b16", ptx) == 2 * 32 and count(r"st\.shared\.v4\.b32", ptx) == 1 + 8 and count(r"ld\.shared\.v4\.b32", ptx) == 4 + 8
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 64 and count(r"st\.global\.v4\.b32", ptx) == 8
    assert count(r"st\.global\.b8", ptx) == 0 and count(r"st\.global\.(v2\.)?b32", ptx) >= 1  # (the scales)
    assert count(r"ld\.global\.b32", ptx) == (16 + 1 if gathered else 0)  # (the row indices; the used-row count)
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0)
    registers = ptxas_registers(ptx, arch)
    assert registers is None or max(registers.values()) <= 96, registers


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("gathered", [False, True])
def test_fp8_block_column_quantizer_in_the_mma_order_stores_rows_and_e8m0_words(arch, gathered):
    """The column quantizer with mma_scales (SM100's MXFP8 weight-gradient operands): the same
    cp.async staging, shared-memory reads and 64 saturating pair conversions as the transposing
    form, then the rows' own layout: a 4-byte store for each of a lane's 32 rows, and warp 0's four
    E8M0 words (the exponent field times 0x01010101); no 16-byte global stores, nothing spilled or
    in local memory, at most 96 registers."""
    from mok.kernels.variants import quantize_fp8_block_variant

    ptx = compiled_ptx(quantize_fp8_block_variant(2048, power_of_two=True, bounded=True, gathered=gathered, columns=True,
                                                  mma_scales=True), arch)
    assert count(r"cp\.async\.cg\.shared\.global \[%r\d+(\+\d+)?\], \[%rd\d+\], 16, %r\d+;", ptx) == 16
    assert count(r"ld\.shared\.v4\.b16", ptx) == 2 * 32 and count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 64
    assert count(r"st\.global\.b32", ptx) == 32 + 4 and count(r"st\.global\.v", ptx) == 0 and "16843009" in ptx
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0)
    registers = ptxas_registers(ptx, arch)
    assert registers is None or max(registers.values()) <= 96, registers


def KernelVariantLike(variant, **changes):
    """The grouped-GEMM variant of ``variant``'s configuration with ``changes`` (its twin)."""
    config = {k: v for k, v in variant.config.items() if k not in ("n", "k", "stages")} | changes
    return grouped_gemm_variant(variant.config["n"], variant.config["k"], stages=variant.config["stages"] or None, **config)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_row_gather_keeps_four_16_byte_loads_in_flight_before_it_stores(arch):
    """gather: each thread loads its four rows' 16-byte vectors (after their four int32 row
    indices) before the first store; nothing narrower, no spills."""
    from mok.kernels.common.gather import ROWS

    ptx = compiled_ptx(gather_variant(2048), arch)
    loads = [m.start() for m in re.finditer(r"ld\.global\.v4\.b32", ptx)]
    stores = [m.start() for m in re.finditer(r"st\.global\.v4\.b32", ptx)]
    assert len(loads) == len(stores) == ROWS == 4 and max(loads) < min(stores)
    assert count(r"ld\.global\.b32", ptx) == ROWS and count(r"st\.global\.(?!v4)", ptx) == 0
    assert count(r"\.local", ptx) == 0


@pytest.mark.parametrize("sources", [1, 2])
def test_bounded_row_gather_reads_the_row_count_once_and_keeps_its_loads_ahead(sources):
    """bounded: one more int32 load (rows_used[0]) and its clamp to the rows there are, against the
    unbounded gather's PTX; the same 16-byte loads and stores, loads still ahead of the stores."""
    plain = compiled_ptx(gather_variant(2048, sources=sources), "sm_90a")
    ptx = compiled_ptx(gather_variant(2048, sources=sources, bounded=True), "sm_90a")
    assert count(r"ld\.global\.b32", ptx) == count(r"ld\.global\.b32", plain) + 1
    assert count(r"\bmin\.s32", ptx) == count(r"\bmin\.s32", plain) + 1
    for vector in (r"ld\.global\.v4\.b32", r"st\.global\.v4\.b32"):
        assert count(vector, ptx) == count(vector, plain) == 4 * sources
    if sources == 1:
        loads = [m.start() for m in re.finditer(r"ld\.global\.v4\.b32", ptx)]
        assert max(loads) < min(m.start() for m in re.finditer(r"st\.global\.v4\.b32", ptx))
    assert count(r"\.local", ptx) == 0


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("n,k,swiglu", [(2048, 7168, True), (7168, 2048, False), (768, 2048, True)])
def test_grouped_gemm_ptx_uses_wgmma_and_tma(n, k, swiglu, persistent):
    variant = grouped_gemm_variant(n, k, epilogue="swiglu" if swiglu else "plain", persistent=persistent)
    ptx = compiled_ptx(variant, "sm_90a")
    tile_n = variant.config["tile_n"]
    assert ".target sm_90a" in ptx
    k_blocks = 4  # 64-deep shared-memory stage / 16-deep bf16 WGMMA
    assert count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.bf16\.bf16", ptx) == k_blocks * (2 if swiglu else 1)
    loads = 3 if swiglu else 2  # A, B (and B2) per stage; the one-tile kernel has a fill loop and a steady-state loop
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == loads * (1 if persistent else 2)
    assert count(r"setmaxnreg", ptx) == (2 if persistent else 0)  # producer gives registers to the MMA warpgroups
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx) >= 1  # TMA store epilogue
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert (count(r"ex2\.approx", ptx) > 0) == swiglu


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize(
    "n,k,epilogue,b_major,k_split",
    [(2048, 7168, "swiglu", "k", False), (768, 2048, "swiglu_save", "k", False), (2048, 7168, "swiglu_save", "k", False),
     (7168, 2048, "plain", "k", False),
     (2048, 1536, "plain", "n", True), (768, 2048, "swiglu_bwd", "n", False)],
)  # the forward's gate/up (with h) and down projections; the backward's dx and SwiGLU backward
def test_sm100_grouped_gemm_ptx_uses_tcgen05_tensor_memory_and_tma(arch, n, k, epilogue, b_major, k_split):
    """The Blackwell grouped GEMM (compile-verified only): tcgen05 MMAs into tensor memory fed by TMA,
    the accumulators read back with tcgen05.ld (and its wait) once per accumulator and subtile loop,
    the outputs stored by TMA from shared memory (16-byte loads of h for the SwiGLU backward); no
    Hopper or warp-level MMA, no spills."""
    variant = grouped_gemm_variant(n, k, epilogue=epilogue, b_major=b_major, k_split=k_split, topk=8)  # (persistent or not: the same code)
    ptx = compiled_ptx(variant, arch)
    assert f".target {arch}" in ptx
    accumulators = 2 if epilogue in ("swiglu", "swiglu_save") else 1
    k_blocks = 4  # 64-deep shared-memory stage / 16-deep bf16 MMA
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) == k_blocks * accumulators
    assert count(r"tcgen05\.commit\.cta_group::1", ptx) == 2  # a stage's MMAs done; the tile's last MMA done
    assert count(r"tcgen05\.alloc\.", ptx) == 1 and count(r"tcgen05\.dealloc\.", ptx) == 1
    assert count(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", ptx) == accumulators
    assert count(r"tcgen05\.wait::ld", ptx) == 1
    # TMA loads of A (k_split: its halves of K) and B (B2; k_split: B or B2), an N-major B tile in boxes of 64 columns
    # (a 128-byte swizzle atom)
    b_boxes = variant.config["tile_n"] // 64 if b_major == "n" else 1
    loads = (2 if k_split else 1) + b_boxes * (2 if accumulators == 2 or k_split else 1)
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == loads
    assert_tma_stored_outputs(ptx, 3 if epilogue in ("swiglu_save", "swiglu_bwd") else 1)
    assert count(r"st\.global\.(?!v4)", ptx) == (epilogue == "swiglu_bwd")  # the router gradient's piece of the row
    assert count(r"ld\.global\.v4\.b32", ptx) == (8 if epilogue == "swiglu_bwd" else 0)  # h_gate, h_up
    assert count(r"\bwgmma\b", ptx) == 0 and count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert (count(r"ex2\.approx", ptx) > 0) == (epilogue != "plain")
    spills = ptxas_spill_bytes(ptx, arch)
    assert spills in (None, 0)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("options", [
    dict(n=7168, k=2048, tile_n=256), dict(n=2048, k=7168, epilogue="swiglu_save", gather_a=True),
    dict(n=7168, k=4096, k_split=True, b_major="n"), dict(n=7168, k=2048, scatter=True, topk=8),
    dict(n=2048, k=7168, epilogue="swiglu_bwd", b_major="n", topk=8), dict(n=2888, k=1032, bias=True),
])
def test_sm100_row_tile_pairs_load_b_once_for_both_ctas_by_tma_multicast(arch, options):
    """cluster_m=2 on SM100 (one-CTA MMAs; compile-verified only): each B load (B2's too) has a
    multicast form writing both CTAs of the cluster, beside the one-CTA loads kept for pairs of two
    experts; a stage's release is the MMA warp's commit multicast to both CTAs' empty barriers,
    the accumulator's commit stays the CTA's own; the barriers initialised cluster-wide before any
    load; the same MMAs, the warp-specialised CTA's tail and waits, no spills. Without it: none of
    this (the PTX of cluster_m=1 is the kernels' as before)."""
    single = compiled_ptx(grouped_gemm_variant(**options), arch)
    pair = compiled_ptx(grouped_gemm_variant(cluster_m=2, **options), arch)
    a_loads = 2 if options.get("k_split") else 0 if options.get("gather_a") else 1
    multicast = r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes\.multicast::cluster"
    one_cta = r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global"
    assert count(multicast, pair) == count(one_cta, single) - a_loads > 0 and count(multicast, single) == 0
    assert count(one_cta, pair) == count(one_cta, single)
    released_to_both = r"tcgen05\.commit\.cta_group::1\.mbarrier::arrive::one\.shared::cluster\.multicast::cluster\.b64"
    own = r"tcgen05\.commit\.cta_group::1\.mbarrier::arrive::one\.shared::cluster\.b64"
    assert count(released_to_both, pair) == 1 and count(own, pair) == 1 and count(released_to_both, single) == 0 and count(own, single) == 2
    assert count(r"barrier\.cluster\.(arrive|wait)", pair) == 2 and count(r"barrier\.cluster", single) == 0
    assert count(r"tcgen05\.mma\.", pair) == count(r"tcgen05\.mma\.", single) and count(r"cta_group::2", pair) == 0
    assert_warp_specialised_tcgen05_kernel(pair)
    assert ptxas_spill_bytes(pair, arch) in (None, 0)
    with pytest.raises(ValueError, match="cluster_m: expected 1, or 2 with bf16 or e4m3_block operands"):
        grouped_gemm_variant(cluster_m=2, operand="e4m3", **{k: v for k, v in options.items() if k not in ("gather_a", "b_major", "bias")})


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize(
    "m,n,options,pair",
    [(7168, 2048, dict(), True), (4096, 7168, dict(split_out=True), True),
     (4096, 7168, dict(out_dtype="f32", accumulate=True, split_out=True), True),
     (2048, 7168, dict(out_dtype="f32", accumulate=True, a_stride=4096), True), (2048, 7168, dict(out_dtype="f32"), True),
     (128, 7168, dict(a_stride=128), False)],
)  # dW_down, [dW_gate; dW_up] in one launch (fresh bf16, or added into fp32 main_grads), one half of dh, fresh fp32; the
# router weight's gradient (128 padded experts: one row tile, no pair)
def test_sm100_weight_grad_ptx_uses_tcgen05_and_tma_on_mn_major_operands(arch, m, n, options, pair):
    """The Blackwell weight-gradient GEMM (compile-verified only): tcgen05 MMAs fed by TMA, on CTA
    pairs (256 x 128 tiles, cta_group::2: each CTA loads its 128 rows of A and 64 of B's 128)
    wherever M has two row tiles or more (each half's), else on one CTA; the accumulator read back
    once per subtile loop, staged in shared memory (16-byte stores, then the async proxy fence and
    the epilogue warps' barrier) and stored by one TMA store per subtile (adding into fp32: a TMA
    reduce-add, nothing read back), at most one store in flight once the next buffer is written
    (bulk wait_group.read 1), all drained before exit (0); no global stores from registers, no
    Hopper or warp-level MMA, no atomics, no spills."""
    ptx = compiled_ptx(weight_grad_variant(m, n, **options), arch)
    assert f".target {arch}" in ptx
    group = 2 if pair else 1
    assert count(rf"tcgen05\.mma\.cta_group::{group}\.kind::f16", ptx) == 4
    assert count(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", ptx) == 1 and count(r"tcgen05\.wait::ld", ptx) == 1
    if pair:  # A's 128 rows, MN-major: two 64-wide boxes; B's 64: one
        assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.\S+\.cta_group::2", ptx) == 3
        assert_cta_pair_kernel(ptx, cta_bytes=(128 + 64) * 64 * 2)
    else:  # A and B, MN-major: two 64-wide boxes each
        assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 4
        assert count(r"cta_group::2|mapa|barrier\.cluster", ptx) == 0
    f32, adds = options.get("out_dtype") == "f32", options.get("accumulate", False)
    dims = 4 if options.get("split_out") else 3  # (the gradient's halves, a mode of the store's view)
    assert count(r"st\.shared\.v2\.b64" if f32 else r"st\.shared\.v4\.b32", ptx) == (8 if f32 else 4)  # a row's 32 columns, 16 bytes a store
    staged = ptx.index("fence.proxy.async.shared::cta", ptx.index("st.shared."))
    store = rf"cp\.reduce\.async\.bulk\.tensor\.{dims}d\.global\.shared::cta\.add" if adds else rf"cp\.async\.bulk\.tensor\.{dims}d\.global\.shared::cta"
    assert count(store, ptx) == 1 and re.search(store, ptx).start() > staged  # one TMA store per subtile, after the fence
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global|cp\.reduce\.async", ptx) == 1
    assert re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", ptx) == ["1", "0"]
    assert count(r"st\.global|ld\.global\.v", ptx) == 0  # (nothing stored from registers, nothing read back)
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert count(r"\batom\.|\bred\.", ptx) == 0
    assert count(r"\bwgmma\b", ptx) == 0 and count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert ptxas_spill_bytes(ptx, arch) in (None, 0)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize(
    "n,k,epilogue,tile_n,k_split",
    [(2048, 7168, "swiglu_save", 128, False), (768, 2048, "swiglu", 128, False), (7168, 2048, "plain", 256, False),
     (2048, 768, "plain", 128, False), (768, 2048, "swiglu_bwd", 128, False), (2048, 1536, "plain", 256, True)],
)  # the forward's gate/up (with h) and down projections; the backward's SwiGLU backward and dx (transposed weights)
def test_sm100_mxfp8_grouped_gemm_ptx_uses_block_scaled_tcgen05_mmas(arch, n, k, epilogue, tile_n, k_split):
    """The MXFP8 grouped GEMM (compile-verified only): block-scaled tcgen05 MMAs (kind::mxf8f6f4,
    a scale per 32: block32), four a stage and accumulator, each stage's scales copied from shared
    into tensor memory (tcgen05.cp: one copy per 128 rows of A, B and B2), TMA loads of the operands
    and of their scales (k_split: B's or B2's), the bf16 kernel's epilogues; no bf16 MMA, no Hopper
    or warp-level MMA, no spills."""
    variant = mxfp8_grouped_gemm(n, k, epilogue, tile_n, k_split=k_split, topk=8)
    ptx = compiled_ptx(variant, arch)
    assert f".target {arch}" in ptx
    accumulators = 2 if epilogue in ("swiglu", "swiglu_save") else 1
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.block32", ptx) == 4 * accumulators
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) == 0
    assert count(r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", ptx) == 1 + accumulators * tile_n // 128
    assert count(r"tcgen05\.commit\.cta_group::1", ptx) == 2
    assert count(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", ptx) == accumulators
    # A (k_split: its halves of K), B (B2; k_split: B or B2) and their scales (A's over the whole of K)
    loads = 2 * (1 + (2 if accumulators == 2 or k_split else 1)) + (1 if k_split else 0)
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == loads
    assert_tma_stored_outputs(ptx, 3 if epilogue in ("swiglu_save", "swiglu_bwd") else 1)
    assert count(r"ld\.global\.v4\.b32", ptx) == (8 if epilogue == "swiglu_bwd" else 0)  # the saved h_gate, h_up
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert count(r"st\.global\.(?!v4)", ptx) == (epilogue == "swiglu_bwd")  # the router gradient's piece of the row
    from mok.kernels.sm100.grouped_gemm import GroupedGemmMxfp8Sm100

    kernel = GroupedGemmMxfp8Sm100(n, k, epilogue, k_split=k_split, tile_n=tile_n, topk=8, persistent=True)
    assert kernel.k_tiles * 128 == k  # (128-deep stages: K / 128 of them a tile, not K / 64)
    assert_scales_lie_past_the_accumulator_stages(ptx, kernel)
    assert count(r"\bwgmma\b", ptx) == 0 and count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert ptxas_spill_bytes(ptx, arch) in (None, 0)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("m,n,options", [(7168, 2048, dict()), (4096, 7168, dict(split_out=True)), (2048, 7168, dict(out_dtype="f32", accumulate=True))])
def test_sm100_mxfp8_weight_grad_ptx_uses_block_scaled_mmas_on_mn_major_operands(arch, m, n, options):
    """The MXFP8 weight-gradient GEMM (compile-verified only): four block-scaled tcgen05 MMAs a
    128-row K tile, the scales of A and B copied into tensor memory each stage, TMA loads of both
    operands and both scales, the bf16 kernel's epilogue; no bf16,
    Hopper or warp-level MMA, no atomics, no spills."""
    ptx = compiled_ptx(mxfp8_weight_grad(m, n, **options), arch)
    assert f".target {arch}" in ptx
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.block32", ptx) == 4
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) == 0
    assert count(r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", ptx) == 2
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 4
    assert count(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", ptx) == 1
    assert_warp_specialised_tcgen05_kernel(ptx)
    from mok.kernels.sm100.weight_grad_gemm import WeightGradGemmMxfp8Sm100

    assert_scales_lie_past_the_accumulator_stages(ptx, WeightGradGemmMxfp8Sm100(m, n, **options))
    assert count(r"\batom\.|\bred\.", ptx) == 0
    assert count(r"\bwgmma\b", ptx) == 0 and count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert ptxas_spill_bytes(ptx, arch) in (None, 0)


def test_mxfp8_grouped_gemm_is_refused_where_no_block_scaled_mma_exists():
    with pytest.raises(NotImplementedError, match=r"grouped GEMM on MXFP8 operands on sm_90a: needs block-scaled MMAs"):
        compiled_ptx(mxfp8_grouped_gemm(2048, 7168, "swiglu"), "sm_90a")
    with pytest.raises(NotImplementedError, match=r"weight-gradient GEMM on MXFP8 operands on sm_90a: needs block-scaled MMAs"):
        compiled_ptx(mxfp8_weight_grad(2048, 7168), "sm_90a")
    with pytest.raises(ValueError, match=r"tile_n: expected 128 or 256 \(128 with SwiGLU\)"):
        compiled_ptx(mxfp8_grouped_gemm(2048, 7168, "swiglu", tile_n=256), "sm_100a")
    with pytest.raises(ValueError, match=r"operand='e4m3': the block-scaled \(SM100\) kernels take K-major B"):
        compiled_ptx(mxfp8_grouped_gemm(2048, 7168, "swiglu_bwd", b_major="n", topk=8), "sm_100a")


@needs_cuobjdump
@pytest.mark.parametrize("operand", ["bf16", "e4m3_block"])
def test_sm90_gemms_sass_keeps_every_wgmma_and_loads_and_stores_by_tma(operand):
    """What ptxas made of the Hopper GEMMs the plan runs (the forward's gate/up and down, the SwiGLU
    backward, the weight gradient; bf16 and FP8 with block scales): every wgmma.mma_async of the
    PTX one HGMMA (bf16) or QGMMA (E4M3) in the SASS, none of the other kind, no warp-level MMA
    (HMMA, IMMA: no fallback), TMA loads (UTMALDG) and TMA-stored epilogues (UTMASTG)."""
    fp8 = operand == "e4m3_block"
    variants = [
        grouped_gemm_variant(2048, 7168, epilogue="swiglu_save", operand=operand),
        grouped_gemm_variant(7168, 2048, operand=operand),
        grouped_gemm_variant(7168, 2048, epilogue="swiglu_bwd", operand=operand, topk=8) if fp8 else
        grouped_gemm_variant(2048, 7168, epilogue="swiglu_bwd", b_major="n", topk=8),
        weight_grad_variant(4096, 7168, split_out=True, operand=operand),
    ]
    mma, other = ("QGMMA", "HGMMA") if fp8 else ("HGMMA", "QGMMA")
    for variant in variants:
        sass = compiled_sass(variant, "sm_90a")
        wgmmas = count(r"wgmma\.mma_async", compiled_ptx(variant, "sm_90a"))
        assert wgmmas > 0 and count(rf"\b{mma}\.", sass) == wgmmas, variant.describe()
        assert count(rf"\b{other}\.", sass) == 0 and count(r"\b[HI]MMA\.", sass) == 0
        assert count(r"\bUTMALDG\b", sass) >= 2 and count(r"\bUTMASTG\b", sass) >= 1


@needs_cuobjdump
def test_sm100_gemms_sass_has_tcgen05_mmas_tma_loads_and_tensor_memory_loads():
    """What ptxas made of the SM100 GEMMs (compiled for sm_100a on any machine): UTCHMMA (tcgen05
    MMAs, four a stage and accumulator; UTCQMMA, the block-scaled ones, for MXFP8 operands, with
    UTCCP copying each stage's scales into tensor memory), UTMALDG (TMA loads), LDTM
    (tensor-memory loads), no Hopper or warp-level MMA. (The same is printed by perf/sm100_sass.py.)"""
    cases = [  # (variant, MMA opcode, MMAs, tensor-memory loads, scale copies)
        (grouped_gemm_variant(2048, 7168, epilogue="swiglu_save"), "UTCHMMA", 8, 2, 0),
        (grouped_gemm_variant(7168, 2048), "UTCHMMA", 4, 1, 0),
        (grouped_gemm_variant(2048, 7168, epilogue="swiglu_bwd", b_major="n", topk=8), "UTCHMMA", 4, 1, 0),
        (weight_grad_variant(4096, 7168, split_out=True), "UTCHMMA", 4, 1, 0),
        (mxfp8_grouped_gemm(2048, 7168, "swiglu_save"), "UTCQMMA", 8, 2, 3),
        (mxfp8_grouped_gemm(7168, 2048), "UTCQMMA", 4, 1, 3),
        (mxfp8_weight_grad(4096, 7168, split_out=True), "UTCQMMA", 4, 1, 2),
    ]
    for variant, opcode, mmas, tmem_loads, scale_copies in cases:
        sass = compiled_sass(variant, "sm_100a")
        assert count(rf"\b{opcode}\b", sass) == mmas, variant.describe()
        assert count(r"\bUTC[HQ]MMA\b", sass) == mmas and count(r"\bUTCCP\b", sass) == scale_copies
        assert count(r"\bLDTM\b", sass) == tmem_loads and count(r"\bUTMALDG\b", sass) >= 2
        assert count(r"\bH[G]?MMA\b", sass) == 0


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("n,k,b_major,k_split", [(7168, 2048, "k", False), (7168, 4096, "n", True)])  # EP: y pushed, dx pushed
def test_sm100_scatter_gemm_stores_each_row_into_its_slot(arch, n, k, b_major, k_split):
    """``scatter`` on SM100 (expert parallelism's pushes): the plain epilogue's rows go to their
    (token, slot) rows of the ranks' combine slots, located once a tile per row (the rank and the
    token's row: a division by T_max) and written with 16-byte stores from registers, four per 32
    columns; the warp-specialised structure otherwise as the plain GEMM's; no spills."""
    ptx = compiled_ptx(grouped_gemm_variant(n, k, scatter=True, topk=8, b_major=b_major, k_split=k_split), arch)
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) == 4
    assert count(r"st\.global\.v4\.b32", ptx) == 4 and count(r"st\.global", ptx) == 4
    assert count(r"div\.s32", ptx) >= 1 and count(r"ld\.global\.(nc\.)?b32", ptx) >= 2  # row_token, row_slot
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert count(r"\bwgmma\b", ptx) == 0 and count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert ptxas_spill_bytes(ptx, arch) in (None, 0)
    with pytest.raises(ValueError, match=r"scatter: only with the plain epilogue"):
        compiled_ptx(grouped_gemm_variant(n, k, epilogue="swiglu", scatter=True, topk=8), arch)


@pytest.mark.parametrize("n,k,epilogue", [(2048, 7168, "swiglu_save"), (7168, 2048, "plain"), (2048, 7168, "swiglu_bwd")])
def test_sm100_grouped_gemm_adds_the_experts_biases_in_its_epilogue(n, k, epilogue):
    """``bias`` on SM100: per 32-column subtile each epilogue thread loads the subtile's 32 values
    of each bias row (4-byte loads: the bias tensors' alignment), the same for every row, beside
    the tensor-memory loads; the SwiGLU backward adds nothing (its partial sums keep a column for
    the down bias's piece); nothing else changes, no spills."""
    options = dict(epilogue=epilogue, topk=8, b_major="n" if epilogue == "swiglu_bwd" else "k")
    ptx = compiled_ptx(grouped_gemm_variant(n, k, bias=True, **options), "sm_100a")
    plain = compiled_ptx(grouped_gemm_variant(n, k, **options), "sm_100a")
    bias_loads = count(r"ld\.global(\.nc)?\.v2\.b16", ptx) - count(r"ld\.global(\.nc)?\.v2\.b16", plain)
    assert bias_loads == {"swiglu_save": 2, "plain": 1, "swiglu_bwd": 0}[epilogue] * 16  # 32 columns, two a load
    for pattern in (r"tcgen05\.mma", r"tcgen05\.ld", r"st\.global"):
        assert count(pattern, ptx) == count(pattern, plain)
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert ptxas_spill_bytes(ptx, "sm_100a") in (None, 0)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("n,k,epilogue", [(2048, 7168, "swiglu_save"), (2880, 2880, "swiglu")])
def test_sm100_gathering_grouped_gemm_copies_a_with_cp_async_and_b_with_tma(arch, n, k, epilogue):
    """gather_a on SM100: four more warps (320 threads) copy A's rows, per stage 8 16-byte cp.async
    a thread (128 rows x 128 bytes over 128 threads, zero-filled for padding rows and past K)
    arriving on the stage's full barrier (129 arrivals: the load warp's and theirs); B and B2 still
    by TMA; the MMA warp fences the generic-proxy writes before its MMAs; no spills."""
    ptx = compiled_ptx(grouped_gemm_variant(n, k, epilogue=epilogue, gather_a=True), arch)
    assert ".reqntid 320, 1, 1" in ptx
    assert count(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, %r\d+;", ptx) == 8  # zero-fill size operand
    assert count(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", ptx) == 1
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 2  # B and B2 only
    assert count(r"mov\.b32\s+%r\d+, 129;\s+mbarrier\.init", ptx) == 1
    fence = ptx.index("fence.proxy.async.shared::cta")
    assert ptx.rindex("mbarrier.try_wait", 0, fence) < fence < ptx.index("tcgen05.mma", fence)
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) == 8
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert ptxas_spill_bytes(ptx, arch) in (None, 0)
    with pytest.raises(ValueError, match=r"gather_a: not with k_split or scatter"):
        compiled_ptx(grouped_gemm_variant(n, k, gather_a=True, scatter=True, topk=8), arch)


def test_sm100_kernels_are_the_same_code_persistent_or_one_tile_per_cta():
    """``persistent`` only sets the grid (at most max_ctas CTAs, or one per tile): the device code,
    which walks the tiles from blockIdx.x by gridDim.x, is the same; and Hopper's ``pingpong``
    changes nothing on SM100, whose kernel overlaps the epilogue through its accumulator stages."""
    def body(ptx):
        return ptx[ptx.index(".entry"):]

    for variant in (lambda **o: grouped_gemm_variant(768, 2048, epilogue="swiglu_bwd", b_major="n", topk=8, **o),
                    lambda **o: weight_grad_variant(2048, 768, **o)):
        persistent = body(compiled_ptx(variant(persistent=True, pingpong=True), "sm_100a"))
        assert body(compiled_ptx(variant(persistent=False, pingpong=False), "sm_100a")) == persistent


@pytest.mark.parametrize("n,k,epilogue", [(2048, 7168, "swiglu_save"), (768, 2048, "swiglu")])
def test_gathering_grouped_gemm_loads_a_with_cp_async_and_b_with_tma(n, k, epilogue):
    """gather_a: per stage 8 16-byte cp.async per producer thread (128 rows x 128 bytes over 128
    threads), tracked by the stage's mbarrier; B and B2 still by TMA; the MMA warps fence the
    generic-proxy writes before WGMMA reads them."""
    ptx = compiled_ptx(grouped_gemm_variant(n, k, epilogue=epilogue, gather_a=True), "sm_90a")
    assert count(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, %r\d+;", ptx) == 8  # zero-fill size operand
    assert count(r"cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", ptx) == 1
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 2  # B and B2 only
    assert count(r"fence\.proxy\.async\.shared::cta", ptx) >= 2  # the consumer's, and the epilogue's
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx) == 8
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)  # (the gathering warpgroup works with the producer's registers)


@pytest.mark.parametrize(
    "options,loads",
    [
        (dict(k=2048), 2),  # the forward's down projection: A, B
        # the backward's dx: A's and B's (B2's) half of K by K tile (10 load sites once unrolled, as in the unscattered dx GEMM)
        (dict(k=4096, b_major="n", k_split=True), 10),
    ],
    ids=["down_projection", "dx_k_split"],
)
def test_scattering_gemm_stores_rows_from_the_producer_warps(monkeypatch, options, loads):
    """scatter: TMA loads, WGMMA; no TMA store: three producer warps (barrier 2 over 96 threads)
    copy the handed-over epilogue subtiles out with 16-byte shared loads and streaming global stores,
    each thread the same rows of every subtile (their destinations read once a tile). (Whole tiles
    only: the tail split's half tile adds its own loads and copies, checked with the split.)"""
    from mok.kernels import variants

    monkeypatch.setattr(variants, "TAIL_SPLIT", False)
    ptx = compiled_ptx(grouped_gemm_variant(7168, scatter=True, topk=8, **options), "sm_90a")
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == loads
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx) == 0  # no TMA store
    # a thread's 6 rows of each subtile (96 threads, 4 chunks a row), unrolled; streaming stores
    assert count(r"ld\.shared\.v4\.b32", ptx) == count(r"st\.global\.cs\.v4\.b32", ptx) == 6
    assert count(r"bar\.sync\s+2, 96;", ptx) == 2
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16", ptx) == 4
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_schedule_ptx_places_rows_without_global_atomics(arch):
    ptx = compiled_ptx(schedule_variant(256, 8, 128), arch)
    assert f".target {arch}" in ptx
    assert count(r"match\.any\.sync", ptx) == 1  # lanes of one expert find each other
    # placement decided by scans; the only atomics are the shared-memory integer counts
    shared_adds = count(r"\batom\.shared(::cta)?\.(cta\.)?add\.u32", ptx)
    assert shared_adds > 0 and count(r"\batom\.|\bred\.", ptx) == shared_adds
    assert count(r"\.local", ptx) == 0


@pytest.mark.parametrize(
    "variant,trans_b,stores",
    [
        (grouped_gemm_variant(2048, 7168, epilogue="swiglu_save"), 0, 3),  # a, h_gate, h_up
        (grouped_gemm_variant(2048, 7168, epilogue="swiglu_bwd", b_major="n", topk=8), 1, 3),  # dh_gate, dh_up, s·a
        (grouped_gemm_variant(7168, 4096, b_major="n", k_split=True), 1, 1),
    ],
    ids=["swiglu_save", "swiglu_bwd", "dx_k_split"],
)
def test_backward_gemm_variants_use_wgmma_with_the_right_b_major(variant, trans_b, stores):
    ptx = compiled_ptx(variant, "sm_90a")
    tile_n = variant.config["tile_n"]
    wgmma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.bf16\.bf16[^;]*;", ptx, re.S)
    assert len(wgmma) == 4 * (2 if variant.config["epilogue"] == "swiglu_save" else 1)
    # the last immediate of wgmma is trans-b: 1 reads B N-major (the weights transposed)
    assert all(w.replace(" ", "").rstrip(";").endswith(f",{trans_b}") for w in wgmma)
    subtiles = tile_n // 32  # the epilogue stores 128x32 subtiles, unrolled
    half_tile = subtiles // 2 if variant.config.get("tail_split") else 0  # (dx, K >= TAIL_SPLIT_MIN_K: a half tile's stores too)
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx) == stores * subtiles + half_tile  # a TMA store per output
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0


@pytest.mark.parametrize("kind,stores", [("weight_grad", 4), ("swiglu_bwd", 12)])
def test_pingpong_kernels_give_each_warpgroup_whole_tiles_and_take_turns(kind, stores):
    """Ping-pong: one copy of the consumer code for both warpgroups (barriers, store warp and
    buffers as values), two 64-row WGMMAs per k block (a whole 128-row tile), the tile's
    subtiles stored over the warpgroup's own 128-thread barrier; the turn goes back and forth
    over two named barriers of 256 threads."""
    if kind == "weight_grad":
        variant = weight_grad_variant(2048, 768, pingpong=True)
    else:
        variant = grouped_gemm_variant(768, 2048, epilogue="swiglu_bwd", b_major="n", topk=8, tile_n=128, pingpong=True)
    ptx = compiled_ptx(variant, "sm_90a")
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx) == 2 * 4  # 2 row blocks x 4 k blocks
    assert count(r"cp\.(reduce\.)?async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx) == stores
    assert count(r"\bbar\.sync\s+%r\d+, 128;", ptx) == 2 * stores  # before and after each store
    assert count(r"\bbar\.arrive\s+%r\d+, 256;", ptx) == 1 and count(r"\bbar\.sync\s+%r\d+, 256;", ptx) == 1
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert_register_handover_fits(ptx)


@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("out_dtype,accumulate", [("bf16", False), ("f32", False), ("f32", True)])
def test_weight_grad_ptx_reads_both_operands_mn_major(out_dtype, accumulate, pingpong):
    ptx = compiled_ptx(weight_grad_variant(7168, 2048, out_dtype, accumulate, pingpong=pingpong), "sm_90a")
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16[^;]*;", ptx, re.S)
    assert len(wgmma) == 4 * (2 if pingpong else 1)  # ping-pong: one warpgroup's two 64-row blocks per k block
    assert all(w.replace(" ", "").rstrip(";").endswith(",1,1") for w in wgmma)  # trans-a, trans-b
    assert count(r"cp\.reduce\.async\.bulk\.tensor", ptx) == (4 if accumulate else 0)  # main_grad: TMA reduce-add, 4 subtiles
    assert count(r"\batom\.|\bred\.global", ptx) == 0  # no atomics: one CTA owns each output tile
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0


def test_unit_weight_combine_reads_no_weights():
    weighted = compiled_ptx(combine_variant(7168, 8, True, gathered=True), "sm_90a")
    unit = compiled_ptx(combine_variant(7168, 8, True, gathered=True, unit_weights=True), "sm_90a")
    loads = r"ld\.global(\.nc)?\.(f32|b32)\b"  # scalar 4-byte loads: the weights (and the slot rows)
    assert count(loads, weighted) - count(loads, unit) == 8
    assert count(r"\.local", unit) == 0


def test_ep_flags_use_system_scope_release_acquire_and_bounded_waits():
    signal = compiled_ptx(ep_variant("signal", 4, phase=1), "sm_90a")
    wait = compiled_ptx(ep_variant("wait", 4, phase=1), "sm_90a")
    assert "fence.acq_rel.sys" in signal and count(r"atom\.global\.sys\.release\.exch\.b32", signal) == 1
    assert count(r"atom\.global\.sys\.acquire\.add\.u32", wait) >= 1
    assert "%globaltimer" in wait  # every wait is bounded in time
    for kind, kw in (("dispatch", dict(width=7168, topk=8)),):
        ptx = compiled_ptx(ep_variant(kind, 4, **kw), "sm_90a")
        assert count(r"\batom\.|\bred\.", ptx) == 0  # data moves with plain loads and stores
        assert count(r"ld\.global(\.nc)?\.v4", ptx) >= 1 and count(r"st\.global\.v4", ptx) >= 1  # 16-byte vectors
    # the publish launch: copies in 16-byte vectors, CTAs counted done with an integer add, the last one signals
    publish = compiled_ptx(ep_variant("publish", 4, width=7168, topk=8), "sm_90a")
    assert count(r"ld\.global(\.nc)?\.v4", publish) >= 1 and count(r"st\.global\.v4", publish) >= 1
    assert set(re.findall(r"\b(?:atom|red)\.[\w.:]+", publish)) == {
        "atom.global.acq_rel.add.u32", "atom.global.exch.b32", "atom.global.sys.release.exch.b32",
    }
    assert count(r"fence\.acq_rel\.sys", publish) == 2
    # the routing gather waits for every rank's publish first (bounded; a timeout claims the error record)
    routing = compiled_ptx(ep_variant("routing", 4, topk=8), "sm_90a")
    assert set(re.findall(r"\b(?:atom|red)\.[\w.:]+", routing)) == {"atom.global.sys.acquire.add.u32", "atom.global.sys.cas.b32"}
    assert "%globaltimer" in routing


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_ep_mxfp8_dispatch_reads_8_byte_element_vectors_and_scale_bytes_and_publishes_without_copying_rows(arch):
    """dispatch_mxfp8 (H = 7168: 7 units of 8 elements a thread): per unit an 8-byte load of
    elements and a scale byte, all before any store; E4M3 pairs converted by cvt (no float
    atomics, no atomics at all); 16-byte bf16 stores into each of up to 8 rows, and the padding's.
    publish_mxfp8: the quantizer's block (four 16-byte loads, 16 saturating E4M3 conversions, two
    16-byte stores and the scale byte) and the values and the signal as publish. Arch-neutral: the
    same on SM100 (compiled only; no SM100 GPU here)."""
    ptx = compiled_ptx(ep_variant("dispatch_mxfp8", 4, width=7168, topk=8), arch)
    assert f".target {arch}" in ptx and count(r"\batom\.|\bred\.", ptx) == 0
    loads = [m.start() for m in re.finditer(r"ld\.global(\.nc)?\.v2\.b32", ptx)]
    scales = [m.start() for m in re.finditer(r"ld\.global(\.nc)?\.[bu]8", ptx)]
    stores = [m.start() for m in re.finditer(r"st\.global\.v4", ptx)]
    assert len(loads) == 7 and len(scales) == 7 and len(stores) == 7 * 8 + 7
    assert max(loads + scales) < min(stores)
    assert count(r"cvt\.rn\.f16x2\.e4m3x2", ptx) == 7 * 4 and count(r"cvt\.rn\.bf16x2\.f32", ptx) == 7 * 4
    publish = compiled_ptx(ep_variant("publish_mxfp8", 4, width=7168, topk=8), arch)
    assert count(r"ld\.global\.v4\.b32", publish) == 4 and count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", publish) == 16
    assert count(r"st\.global\.v4\.b32", publish) == 2 and count(r"st\.global\.[bu]8", publish) == 1
    assert count(r"fence\.acq_rel\.sys", publish) == 2 and count(r"\.local", publish) == 0
    assert set(re.findall(r"\b(?:atom|red)\.[\w.:]+", publish)) == {
        "atom.global.acq_rel.add.u32", "atom.global.exch.b32", "atom.global.sys.release.exch.b32",
    }


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_ep_mxfp8_exchange_takes_rows_ending_in_half_a_block(arch):
    """H = 2064 (64.5 blocks of 32): publish_mxfp8 quantizes by blocks of halves (the static-width
    quantizer's step, common/mxfp8_quantize.py: a row's last block 16 values, its scale from them),
    and the one-launch forward's publish the same; dispatch_mxfp8 reads a token's ceil(H / 32)
    scale bytes a row, all of a token's loads before any store. Nothing in local memory."""
    publish = compiled_ptx(ep_variant("publish_mxfp8", 2, width=2064, topk=8), arch)
    whole = compiled_ptx(ep_variant("publish_mxfp8", 2, width=2048, topk=8), arch)
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", publish) == count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", whole) == 16
    assert count(r"st\.global\.[bu]8", publish) == 1 and count(r"\.local", publish) == 0
    assert re.search(r"mul\.lo\.s32\s+%r\d+, %r\d+, 65;", publish)  # (a token's 65 blocks, the last partial)
    dispatch = compiled_ptx(ep_variant("dispatch_mxfp8", 2, width=2064, topk=8), arch)
    loads = [m.start() for m in re.finditer(r"ld\.global(\.nc)?\.v2\.b32", dispatch)]
    scales = [m.start() for m in re.finditer(r"ld\.global(\.nc)?\.[bu]8", dispatch)]
    stores = [m.start() for m in re.finditer(r"st\.global\.v4", dispatch)]
    assert len(loads) == len(scales) > 0 and max(loads + scales) < min(stores) and count(r"\.local", dispatch) == 0
    one_launch = compiled_ptx(expert_mlp_variant(2064, 1040, 8, 4, save_h=False, has_shared=False, ep_world=2, dispatch_format="mxfp8"), arch)
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", one_launch) == 16 and count(r"cvt\.rn\.f16x2\.e4m3x2", one_launch) > 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_ep_fp8_dispatch_copies_e4m3_rows_and_scales_as_they_are_and_publishes_quantizing(arch):
    """dispatch_fp8_block (H = 7168: 4 vectors of 16 E4M3 bytes a thread): all of a token's 16-byte
    loads before any store, each into up to 8 rows and the padding's (16-byte stores), its 56 fp32
    scales copied as 4-byte words; no conversion of the values, no atomics. publish_fp8_block: the
    row quantizer's block (a lane's four bf16 values in one 8-byte load, a 5-step butterfly max,
    two saturating E4M3 pair conversions and one 4-byte store, the scale a 4-byte store) and the
    values and the signal as publish. The backward's dequantizer: a lane's four elements in one
    4-byte load, converted and scaled, one 8-byte bf16 store. Arch-neutral: the same on SM100
    (compiled only)."""
    ptx = compiled_ptx(ep_variant("dispatch_fp8_block", 4, width=7168, topk=8), arch)
    assert f".target {arch}" in ptx and count(r"\batom\.|\bred\.", ptx) == 0 and count(r"e4m3|bf16", ptx) == 0
    loads = [m.start() for m in re.finditer(r"ld\.global(\.nc)?\.v4\.b32", ptx)]
    stores = [m.start() for m in re.finditer(r"st\.global\.v4\.b32", ptx)]
    assert len(loads) == 4 and len(stores) == 4 * 8 + 4 and max(loads) < min(stores)
    assert count(r"st\.global\.(b32|f32)", ptx) == 8 + 1  # (a scale into each of a token's rows; zero into a padding row's)
    publish = compiled_ptx(ep_variant("publish_fp8_block", 4, width=7168, topk=8), arch)
    assert count(r"ld\.global\.v4\.b16", publish) == 1 and count(r"shfl\.sync\.bfly", publish) == 5
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", publish) == 2 and count(r"fence\.acq_rel\.sys", publish) == 2
    assert count(r"\.local", publish) == 0 and set(re.findall(r"\b(?:atom|red)\.[\w.:]+", publish)) == {
        "atom.global.acq_rel.add.u32", "atom.global.exch.b32", "atom.global.sys.release.exch.b32",
    }
    back = compiled_ptx(quantize_fp8_block_variant(7168, bounded=True, back=True), arch)
    assert count(r"ld\.global\.b32", back) >= 2 and count(r"cvt\.rn\.f16x2\.e4m3x2", back) == 2 * 2  # (rows unrolled by 2)
    assert count(r"st\.global\.v2\.b32", back) == 2 and count(r"cvt\.rn\.bf16x2\.f32", back) == 2 * 2 and count(r"\.local", back) == 0


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_ep_fp8_dispatch_in_the_mma_order_writes_e8m0_words(arch):
    """dispatch_fp8_block with scale_order "mma" (SM100): the elements as the fp32-scale dispatch
    copies them (all loads before any store, 16-byte stores into up to 8 rows and the padding's),
    each scale converted once into an E8M0 word (its exponent field times 0x01010101) and stored at
    each of a token's rows' places in the MMA order (zero words into the padding rows'); no atomics,
    nothing in local memory. Rows ending in a partial block (528: 16 values past 512): its word
    the byte at one 32-block and 127 at the other three (+ 0x7F7F7F00)."""
    ptx = compiled_ptx(ep_variant("dispatch_fp8_block", 4, width=7168, topk=8, scale_order="mma"), arch)
    assert count(r"\batom\.|\bred\.", ptx) == 0 and count(r"e4m3|bf16", ptx) == 0 and count(r"\.local", ptx) == 0
    loads = [m.start() for m in re.finditer(r"ld\.global(\.nc)?\.v4\.b32", ptx)]
    stores = [m.start() for m in re.finditer(r"st\.global\.v4\.b32", ptx)]
    assert len(loads) == 4 and len(stores) == 4 * 8 + 4 and max(loads) < min(stores)
    assert count(r"st\.global\.(b32|f32)", ptx) == 8 + 1  # (a token's word into each of its rows; zero into a padding row's)
    assert count(r"mul\.lo\.s32\s+%r\d+, %r\d+, 16843009;", ptx) == 1  # (converted once per scale, before the rows' stores)
    partial = compiled_ptx(ep_variant("dispatch_fp8_block", 2, width=528, topk=2, scale_order="mma"), arch)
    assert re.search(r"\b2139062016\b", partial) and "2139062016" not in ptx and count(r"\.local", partial) == 0
    with pytest.raises(ValueError, match=r"scale_order: dispatch_fp8_block's option, got 'mma' for dispatch_mxfp8"):
        compiled_ptx(ep_variant("dispatch_mxfp8", 2, width=512, topk=2, scale_order="mma"), arch)


def test_ep_overflow_kernel_claims_error_records_by_compare_and_swap_and_poisons_with_vector_stores():
    forward = compiled_ptx(ep_variant("overflow", 4, phase=0, width=7168, topk=8), "sm_90a")
    backward = compiled_ptx(ep_variant("overflow", 4, phase=1, width=7168, topk=8), "sm_90a")
    wait = compiled_ptx(ep_variant("wait", 4, phase=1), "sm_90a")
    for ptx in (forward, backward, wait):  # a record is claimed whole: one compare-and-swap on its code, system scope
        assert count(r"atom\.global\.sys\.cas\.b32", ptx) == 1
    for ptx in (forward, backward):
        assert count(r"\batom\.|\bred\.", ptx) == 1  # nothing else is atomic
        assert count(r"st\.global\.v4", ptx) >= 1  # NaN rows in 16-byte stores
    assert count(r"st\.global\.(f32|b32)\b", backward) > count(r"st\.global\.(f32|b32)\b", forward)  # + the router pieces


@pytest.mark.parametrize("hidden,inter,experts,options", [(7168, 2048, 256, {}), (2048, 768, 64, dict(save_h=True)),
                                                      (2048, 768, 64, dict(has_shared=True, shared_prefix=True))])
def test_one_launch_forward_keeps_both_gemms_on_wgmma_and_syncs_with_integer_release_acquire(hidden, inter, experts, options):
    """The one-launch forward: fc1's two WGMMA products and fc2's one per k block, fc1's rows by
    cp.async and every weight tile by TMA, tiles taken from an integer counter, and between the
    phases only integer release/acquire adds at gpu scope with a bounded (%globaltimer) wait; no
    float atomics, no spills."""
    ptx = compiled_ptx(expert_mlp_variant(hidden, inter, 8, experts, **options), "sm_90a")
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx) == 2 * 4  # fc1: gate and up
    assert count(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16", ptx) == 4  # fc2: 256 columns, as alone
    assert count(r"cp\.async\.cg\.shared\.global", ptx) >= 1
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) >= 3  # w_gate, w_up, a and w_down
    # the tile counter's relaxed add, the ready counters' release / acquire, the grid barriers' acq_rel add and
    # exchange, the schedule's shared-memory counts: integer atomics only
    assert set(re.findall(r"\b(?:atom|red)\.[\w.:]+", ptx)) == {
        "atom.global.release.add.u32", "atom.global.acquire.add.u32", "atom.global.add.u32", "atom.global.acq_rel.add.u32",
        "atom.global.exch.b32", "atom.shared.cta.add.u32",
    }
    assert count(r"bar\.sync\s+3, 128;", ptx) >= 1  # the producer warps share each tile index
    assert "%globaltimer" in ptx and count(r"fence\.proxy\.async\.global", ptx) >= 2
    assert count(r"\.local", ptx) == 0


def test_one_launch_forward_builds_the_schedule_meets_at_two_bounded_grid_barriers_and_combines_last():
    """The one-launch forward's other phases: the schedule's warp ranking (match.any, shared-memory
    integer adds) first, a grid barrier (integer acq_rel / acquire atomics at gpu scope bounded by
    %globaltimer) before the first tile and another before the combine, which runs in the MMA
    warps with the combine launch's 16-byte vector loads; no spills (run after the warp roles
    join, the producer warps' 40 registers would bound it)."""
    ptx = compiled_ptx(expert_mlp_variant(2048, 768, 8, 64), "sm_90a")
    assert count(r"match\.any\.sync", ptx) == 1
    assert count(r"fence\.acq_rel\.gpu", ptx) == 2 * 2  # two grid barriers
    assert count(r"ld\.global(\.nc)?\.v4", ptx) >= 8  # k = 8 rows per vector, loaded before the first FMA
    assert count(r"\.local", ptx) == 0
    assert ptxas_spill_bytes(ptx) in (0, None)
    assert_register_handover_fits(ptx)


def test_one_launch_ep_forward_adds_system_scope_flags_and_pushes_not_float_atomics():
    """The expert-parallel one-launch forward: the single-GPU one-launch kernel's WGMMAs (fc1 rows by
    cp.async, weights by TMA) with fc2's tile pushed out by the producer's idle warps (no TMA store
    of y), the epoch flags as system-scope release exchanges and acquire reads bounded by
    %globaltimer, the first error kept by a compare-and-swap; integer atomics only, no spills."""
    one = expert_mlp_variant(2048, 768, 8, 64)
    ep = compiled_ptx(expert_mlp_variant(2048, 768, 8, 64, ep_world=2), "sm_90a")
    plain = compiled_ptx(one, "sm_90a")
    for pattern in (r"wgmma\.mma_async", r"cp\.async\.cg\.shared\.global"):
        assert count(pattern, ep) == count(pattern, plain), pattern
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ep) < count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", plain)
    atomics = set(re.findall(r"\b(?:atom|red)\.[\w.:]+", ep))
    assert atomics - set(re.findall(r"\b(?:atom|red)\.[\w.:]+", plain)) == {
        "atom.global.sys.release.exch.b32", "atom.global.sys.acquire.add.u32", "atom.global.sys.cas.b32",
    }
    assert not any(".f32" in a or ".f16" in a or ".bf16" in a for a in atomics)
    assert count(r"fence\.acq_rel\.sys", ep) >= 2 and count(r"st\.global\.cs\.v4", ep) >= 1
    assert count(r"\.local", ep) == 0 and ptxas_spill_bytes(ep) in (0, None)
    assert_register_handover_fits(ep)


SM100_ONE_LAUNCH = [  # (H, I, k, E, options): DeepSeek-V3 keeping h, Qwen3 with its shared expert first, EP 8 in MXFP8, gpt-oss
    (7168, 2048, 8, 32, dict(save_h=True)),
    (2048, 768, 8, 64, dict(save_h=True, has_shared=True, shared_prefix=True)),
    (7168, 2048, 8, 32, dict(ep_world=8, dispatch_format="mxfp8")),
    (2880, 2880, 4, 32, dict(save_h=True, activation="clamped_swiglu", gate_up_stride=2 * 2880 * 2880, gate_up_row_stride=2 * 2880,
                             bias=True)),
]


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("hidden,inter,topk,experts,options", SM100_ONE_LAUNCH, ids=["dsv3", "shared-first", "ep8-mxfp8", "gpt-oss-in-place"])
def test_sm100_one_launch_forward_runs_both_gemms_on_tcgen05_and_syncs_with_integer_release_acquire(
    arch, hidden, inter, topk, experts, options
):
    """mok/kernels/sm100/expert_mlp.py: the warp-specialised tcgen05 CTA (the exit checks of every
    SM100 GEMM) with fc1's gate and up MMAs and fc2's one per 16 of K, one 512-column tensor-memory
    allocation; fc1's rows by cp.async, the weights and a by TMA; the gather thread's arrival
    for the 128 gather threads on each fc2 stage; a (and h) and the y rows stored by TMA (at EP the
    y rows pushed from registers); between the phases only integer release / acquire atomics at
    gpu scope (system scope for the EP flags), bounded by %globaltimer, fenced for the proxies;
    the grid barriers (one more at EP); no float atomics, no spills."""
    ep = "ep_world" in options
    ptx = compiled_ptx(expert_mlp_variant(hidden, inter, topk, experts, **options), arch)
    assert count(r"\bwgmma\b|\bmma\.sync", ptx) == 0
    assert count(r"tcgen05\.mma\.cta_group::1\.kind::f16", ptx) == 2 * 4 + 4  # fc1: gate and up per 16 of K; fc2
    assert_warp_specialised_tcgen05_kernel(ptx)
    assert re.search(r"mov\.b32\s+%r\d+, 512;\s+tcgen05\.alloc", ptx)
    assert count(r"cp\.async\.cg\.shared\.global", ptx) >= 1 and count(r"cp\.async\.mbarrier\.arrive\.noinc", ptx) == 1
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 4  # w_gate, w_up; a, w_down
    assert re.search(r"mov\.b32\s+(%r\d+), 128;\s+mbarrier\.arrive\.shared\.b64 %rd\d+, \[%r\d+\], \1;", ptx)
    stores = count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    assert stores == 1 + 2 * options.get("save_h", False) + (0 if ep else 1)  # a, h's halves; y rows
    integer = {"atom.global.release.add.u32", "atom.global.acquire.add.u32", "atom.global.add.u32", "atom.global.acq_rel.add.u32",
               "atom.global.exch.b32", "atom.shared.cta.add.u32"}
    if ep:
        integer |= {"atom.global.sys.release.exch.b32", "atom.global.sys.acquire.add.u32", "atom.global.sys.cas.b32"}
        assert count(r"fence\.acq_rel\.sys", ptx) >= 2
    assert set(re.findall(r"\b(?:atom|red)\.[\w.:]+", ptx)) == integer
    assert count(r"fence\.acq_rel\.gpu", ptx) >= 2 * 3 if ep else count(r"fence\.acq_rel\.gpu", ptx) == 2 * 2  # the grid barriers
    assert "%globaltimer" in ptx and count(r"fence\.proxy\.async\.global", ptx) >= 2
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (0, None)


def test_one_launch_forward_reads_interleaved_rows_in_place_and_adds_the_biases_on_hopper():
    """gpt-oss in one launch: w_gate and w_up as the even and odd rows of one [E, 2I, H] tensor change
    only B's TMA descriptor (the device code is the expert-strided kernel's byte for byte); the
    biases add their bf16-pair loads (32 bits) in both GEMMs' epilogues; no spills, the register
    hand-over fits."""
    def body(ptx):
        return ptx[ptx.index(".entry"):]

    h = i = 2880
    base = dict(save_h=True, activation="clamped_swiglu", gate_up_stride=2 * i * h)
    packed = compiled_ptx(expert_mlp_variant(h, i, 4, 32, **base), "sm_90a")
    strided = compiled_ptx(expert_mlp_variant(h, i, 4, 32, **base, gate_up_row_stride=2 * h), "sm_90a")
    assert body(strided) == body(packed)
    biased = compiled_ptx(expert_mlp_variant(h, i, 4, 32, **base, gate_up_row_stride=2 * h, bias=True), "sm_90a")
    assert count(r"ld\.global\.b32", biased) > count(r"ld\.global\.b32", packed)
    assert count(r"\.local", biased) == 0 and ptxas_spill_bytes(biased) in (0, None)
    assert_register_handover_fits(biased)


def test_one_launch_ep_forward_in_mxfp8_quantizes_as_it_publishes_and_dequantizes_as_it_copies():
    """dispatch_format="mxfp8" in the one-launch EP forward: the bf16 kernel's WGMMAs, TMA and
    atomics; the publish phase's copy becomes the quantizer's block (16 saturating E4M3
    conversions, two 16-byte stores of elements), the row copy per lane COPY_DEPTH 8-byte element
    loads (and their scale bytes) dequantized by cvt before the 16-byte stores; no spills."""
    bf16 = compiled_ptx(expert_mlp_variant(2048, 768, 8, 64, ep_world=2), "sm_90a")
    mxfp8 = compiled_ptx(expert_mlp_variant(2048, 768, 8, 64, ep_world=2, dispatch_format="mxfp8"), "sm_90a")
    for pattern in (r"wgmma\.mma_async", r"cp\.async\.bulk\.tensor", r"cp\.async\.cg\.shared\.global"):
        assert count(pattern, mxfp8) == count(pattern, bf16), pattern
    assert set(re.findall(r"\b(?:atom|red)\.[\w.:]+", mxfp8)) == set(re.findall(r"\b(?:atom|red)\.[\w.:]+", bf16))
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", mxfp8) == 16 and count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", bf16) == 0
    assert count(r"ld\.global(\.nc)?\.v2\.b32", mxfp8) == 4 and count(r"cvt\.rn\.f16x2\.e4m3x2", mxfp8) == 4 * 4
    assert count(r"\.local", mxfp8) == 0 and ptxas_spill_bytes(mxfp8) in (0, None)
    assert_register_handover_fits(mxfp8)


@pytest.mark.parametrize("mma_order", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_mxfp8_quantizer_converts_pairs_with_the_saturating_e4m3_cvt_and_moves_16_byte_vectors(arch, mma_order):
    ptx = compiled_ptx(quantize_mxfp8_variant(mma_order=mma_order), arch)
    assert f".target {arch}" in ptx
    # per thread, one block of 32: four 16-byte loads, sixteen pair conversions (round to nearest
    # even), two 16-byte stores of the elements and one byte for the scale
    assert count(r"ld\.global\.v4\.b32", ptx) == 4
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 16
    assert count(r"st\.global\.v4\.b32", ptx) == 2
    assert count(r"st\.global\.(?!v4)", ptx) == 1
    # the block maximum is an integer max over the bit patterns (a float max would drop a NaN)
    assert count(r"\bmax\.(f32|NaN)", ptx) == 0 and count(r"\bmax\.[us]32", ptx) >= 31
    assert count(r"\.local", ptx) == 0 and count(r"\batom\.", ptx) == 0
    # mma_order: the scale's place from the block's row and column (one division by the row's blocks)
    assert count(r"\bdiv\.", ptx) == (1 if mma_order else 0)


@pytest.mark.parametrize("mma_order", [False, True])
def test_mxfp8_column_quantizer_reads_a_block_down_a_column_and_converts_pairs(mma_order):
    """columns: per thread one block of 32 rows of one column (32 two-byte loads, neighbouring
    threads on neighbouring columns), the same sixteen saturating pair conversions, 32 element
    bytes and the scale byte stored; no local memory."""
    ptx = compiled_ptx(quantize_mxfp8_variant(columns=True, mma_order=mma_order), "sm_90a")
    assert count(r"ld\.global\.b16", ptx) == 32 and count(r"ld\.global", ptx) == 32
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 16
    assert count(r"st\.global\.b8", ptx) == 33 and count(r"st\.global", ptx) == 33
    assert count(r"\bmax\.[us]32", ptx) >= 31 and count(r"\.local", ptx) == 0


@pytest.mark.parametrize("back", [False, True])
def test_bounded_mxfp8_kernels_read_the_row_count_once_and_clamp_it_to_the_blocks_there_are(back):
    plain = compiled_ptx(quantize_mxfp8_variant(back=back), "sm_90a")
    ptx = compiled_ptx(quantize_mxfp8_variant(back=back, bounded=True), "sm_90a")
    assert count(r"ld\.global\.b32\s", ptx) == 1 and count(r"ld\.global\.b32\s", plain) == 0  # rows_used[0], nothing else
    assert count(r"ld\.global", ptx) == count(r"ld\.global", plain) + 1
    assert count(r"\bmin\.s32", ptx) == 1 and count(r"\bmul\.lo\.s32", ptx) >= 1  # min(blocks, rows_used · blocks per row)
    assert count(r"\.local", ptx) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_mxfp8_dequantizer_reads_the_scale_as_an_unsigned_byte_and_converts_pairs(arch):
    ptx = compiled_ptx(quantize_mxfp8_variant(back=True), arch)
    # per thread, four quarter blocks: four 8-byte loads and their scale bytes, all before the first
    # of four 16-byte stores (a warp's stores are 512 contiguous bytes)
    assert count(r"ld\.global\.v2\.b32", ptx) == 4 and count(r"st\.global\.v4\.b32", ptx) == 4
    assert ptx.rindex("ld.global") < ptx.index("st.global")
    assert count(r"ld\.global\.s8", ptx) == 0 and count(r"ld\.global\.(u8|b8)", ptx) == 4  # a sign-extended 0x80.. would be wrong
    assert re.search(r"setp\.eq\.[bsu]32\s+%p\d+, %r\d+, 255;", ptx)  # E8M0's NaN byte is tested for
    assert count(r"cvt\.rn\.f16x2\.e4m3x2", ptx) == 16 and count(r"cvt\.rn\.bf16x2\.f32", ptx) == 16
    assert count(r"\bdiv\.", ptx) == 0
    assert count(r"\.local", ptx) == 0


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("shape,padding", [
    (dict(width=2064), 0), (dict(mma_order=True, width=2880), 2), (dict(bounded=True, mma_order=True, width=1040, segments=2), 3),
    (dict(mma_order=True, width=2064, matrix_rows=1040), 3),
])
def test_mxfp8_quantizer_of_a_static_width_moves_16_byte_vectors_and_writes_the_padding_scales(arch, shape, padding):
    """Rows whose blocks or 128-value chunks the width does not tile (gpt-oss's 2880; 2064 and 1040
    end in half a block): per thread still one block, four 16-byte loads and two 16-byte stores
    (the second half's predicated off at a row's partial last block), sixteen saturating pair
    conversions, and the scale byte; in the MMA's order the row's last block also writes the
    padding blocks' bytes of its chunk (4·ceil(width / 128) - ceil(width / 32) of them); the
    divisions by the static width are multiplications; nothing in local memory, no spills."""
    ptx = compiled_ptx(quantize_mxfp8_variant(**shape), arch)
    assert count(r"ld\.global\.v4\.b32", ptx) == 4 and count(r"st\.global\.v4\.b32", ptx) == 2
    assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == 16
    assert count(r"st\.global\.b8", ptx) == 1 + padding and count(r"st\.global\.(?!v4|b8)", ptx) == 0
    assert count(r"\bdiv\.", ptx) == 0 and count(r"\brem\.", ptx) == 0
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_mxfp8_column_quantizer_of_two_segments_differs_only_in_where_the_scale_goes(arch):
    """Down the columns with dh's halves chunked apart (the split-out weight gradient where 128 does
    not divide I): the column quantizer's loads, conversions and stores (the elements' bytes and
    the scale's), the scale's place found from the static half width without a division; no spills."""
    ptx = compiled_ptx(quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True, width=1040, segments=2), arch)
    whole = compiled_ptx(quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True), arch)
    for instruction in (r"ld\.global\.\S+", r"st\.global\.\S+", r"cvt\.rn\.satfinite\.e4m3x2\.f32"):
        assert sorted(re.findall(instruction, ptx)) == sorted(re.findall(instruction, whole)), instruction
    assert count(r"\bdiv\.s32 \S+, \S+, 1040;", ptx) == 0
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("shape", [dict(width=1040), dict(bounded=True, width=1040, segments=2)])
def test_mxfp8_dequantizer_of_a_static_width_keeps_its_vectors(arch, shape):
    """The dequantizer of rows that end in half a block: the same four 8-byte loads, scale bytes and
    16-byte stores a thread as the whole-block kernel, each quarter block's scale found by a
    multiplication (the static width), no division, nothing in local memory, no spills."""
    ptx = compiled_ptx(quantize_mxfp8_variant(back=True, **shape), arch)
    assert count(r"ld\.global\.v2\.b32", ptx) == 4 and count(r"ld\.global\.(u8|b8)", ptx) == 4 and count(r"st\.global\.v4\.b32", ptx) == 4
    assert count(r"cvt\.rn\.bf16x2\.f32", ptx) == 16 and count(r"\bdiv\.", ptx) == 0
    assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0)


def test_every_kernel_takes_its_records_arguments_in_order():
    """Each kernel's launch arguments are written once, as a record (common/launch_args.py) that the
    compile step's stand-ins, the launcher and the kernel's ``__call__`` all read: the ``__call__``
    parameters (seen through ``@cute.jit``) are the record's, in order, the stream last. The bf16
    and MXFP8 GEMMs of both arches take the same lists."""
    import inspect

    from mok.kernels.common import bias_grads, combine, gather, router_grad
    from mok.kernels.common.records import COLUMN_SUMS_ARGS, EXPERT_MLP_ARGS, ROW_DOTS_ARGS, grouped_gemm_args, weight_grad_args
    from mok.kernels.sm90.expert_mlp import ExpertMlpSm90
    from mok.kernels.sm100.expert_mlp import ExpertMlpSm100
    from mok.kernels.sm90.grouped_gemm import GroupedGemmSm90
    from mok.kernels.sm90.weight_grad_gemm import WeightGradGemmSm90
    from mok.kernels.sm100.grouped_gemm import GroupedGemmMxfp8Sm100, GroupedGemmSm100
    from mok.kernels.sm100.weight_grad_gemm import WeightGradGemmMxfp8Sm100, WeightGradGemmSm100

    kernels = [
        (GroupedGemmSm90, grouped_gemm_args("bf16")), (GroupedGemmSm100, grouped_gemm_args("bf16")),
        (GroupedGemmMxfp8Sm100, grouped_gemm_args("e4m3")), (WeightGradGemmSm90, weight_grad_args("bf16")),
        (WeightGradGemmSm100, weight_grad_args("bf16")), (WeightGradGemmMxfp8Sm100, weight_grad_args("e4m3")),
        (ExpertMlpSm90, EXPERT_MLP_ARGS), (ExpertMlpSm100, EXPERT_MLP_ARGS), (combine.CombineKernel, combine.COMBINE_ARGS),
        (combine.CombineRouterGradKernel, combine.COMBINE_ROUTER_GRAD_ARGS), (router_grad.RouterGradKernel, router_grad.ROUTER_GRAD_ARGS),
        (gather.GatherRowsKernel, gather.GATHER_ARGS), (gather.GatherTwoRowsKernel, gather.GATHER_TWO_ARGS),
        (bias_grads.ColumnSumsKernel, COLUMN_SUMS_ARGS), (bias_grads.RowDotsKernel, ROW_DOTS_ARGS),
    ]
    for kernel, record in kernels:
        assert "stream" in inspect.signature(kernel.__call__).parameters  # (the decorator keeps the signature)
        record.check_signature(kernel.__call__)
    with pytest.raises(TypeError, match=r"are not the record's"):  # (and the check does check)
        grouped_gemm_args().check_signature(WeightGradGemmSm90.__call__)


@pytest.mark.parametrize("options", [dict(n=4096, k=14336), dict(n=4096, k=2 * 14336, b_major="n", k_split=True),
                                     dict(n=4096, k=14336, scatter=True, topk=2)])
def test_tail_split_adds_half_width_wgmmas_and_their_stage_arming(monkeypatch, options):
    """variants.TAIL_SPLIT: bf16's plain grouped GEMM with 256-wide tiles (the down projection's
    form, EP's scatter form of it, and dx's) gains the half tile's path: 128-wide WGMMAs beside its 256-wide ones, its own
    arming of each stage's barrier for the half stage's bytes (expect_tx), B's (and B2's) half-width
    TMA loads, the walk's last row tile found by a warp's butterfly; a config entry of its own;
    no spills, the 256-wide WGMMAs not serialized. Only that form takes it (the SwiGLU GEMM, 128-wide
    tiles, FP8 operands, gathered rows, pairs of row tiles or K below TAIL_SPLIT_MIN_K do not), and the kernel refuses it
    elsewhere, naming what it needs."""
    from mok.kernels import variants
    from mok.kernels.sm90.grouped_gemm import GroupedGemmSm90

    monkeypatch.setattr(variants, "TAIL_SPLIT", False)
    whole = grouped_gemm_variant(**options)
    monkeypatch.setattr(variants, "TAIL_SPLIT", True)
    split = grouped_gemm_variant(**options)
    assert split.config == {**whole.config, "tail_split": True}
    for others in (dict(n=2048, k=7168, epilogue="swiglu"), dict(n=4096, k=14336, tile_n=128), dict(n=2048, k=7168, epilogue="swiglu_save",
                   gather_a=True), dict(n=4096, k=14336, cluster_m=2), dict(n=4096, k=14336, operand="e4m3_block"),
                   dict(n=4096, k=variants.TAIL_SPLIT_MIN_K - 64)):
        assert "tail_split" not in grouped_gemm_variant(**others).config, others
    whole_ptx, split_ptx = compiled_ptx(whole, "sm_90a"), compiled_ptx(split, "sm_90a")
    wide, half = r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", r"wgmma\.mma_async\.sync\.aligned\.m64n128k16"
    assert count(wide, split_ptx) == count(wide, whole_ptx) > 0 and count(half, whole_ptx) == 0
    assert count(half, split_ptx) == count(wide, whole_ptx)  # (a stage's k blocks, at half the width)
    assert count(r"mbarrier\.arrive\.expect_tx", split_ptx) == count(r"mbarrier\.arrive\.expect_tx", whole_ptx) + 1
    loads = r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global"
    assert count(loads, split_ptx) > count(loads, whole_ptx)
    assert count(r"shfl\.sync\.bfly", split_ptx) == 5 and count(r"shfl\.sync\.bfly", whole_ptx) == 0
    assert_wgmmas_not_serialized(split_ptx)
    assert ptxas_spill_bytes(split_ptx) in (None, 0)
    for bad, needs in ((dict(epilogue="swiglu"), "the plain epilogue"), (dict(tile_n=128), "tile_n=256"),
                       (dict(persistent=False), "persistent=True"), (dict(cluster_m=2), "cluster_m=1")):
        with pytest.raises(ValueError, match=f"tail_split: needs .*{re.escape(needs)}"):
            GroupedGemmSm90(4096, 14336, **{"tile_n": 256, "persistent": True, **bad}, tail_split=True)


@pytest.mark.parametrize("options", [
    dict(n=2048, k=7168, epilogue="swiglu_save", gather_a=True), dict(n=2048, k=7168, epilogue="swiglu_bwd", b_major="n", topk=8),
    dict(n=4096, k=2048, cluster_m=2), dict(n=7168, k=2048, scatter=True, topk=8),
    dict(n=2048, k=7168, epilogue="swiglu", operand="e4m3_block", out_format="e4m3_block"),
], ids=["gate_up_gathering", "swiglu_bwd_pingpong", "row_tile_pairs", "scatter", "fp8_gate_up"])
def test_bounded_walk_adds_the_row_scan_and_nothing_else(monkeypatch, options):
    """variants.BOUNDED_WALK: each persistent grouped GEMM form (gathering SwiGLU, the ping-pong
    SwiGLU backward, row-tile pairs, EP's scatter, FP8's E4M3-out gate/up) walks up to the last row
    tile with rows: its warps' scan of the tile list (a butterfly of 5 shuffles) is the one thing
    added, under a config entry of its own; no spills, WGMMAs not serialized. The one-tile kernel
    refuses it."""
    from mok.kernels import variants
    from mok.kernels.sm90.grouped_gemm import GroupedGemmSm90

    monkeypatch.setattr(variants, "BOUNDED_WALK", False)
    free = grouped_gemm_variant(**options)
    monkeypatch.setattr(variants, "BOUNDED_WALK", True)
    bounded = grouped_gemm_variant(**options)
    assert bounded.config == {**free.config, "bounded_walk": True}
    if "operand" not in options:  # (FP8's kernel is persistent only)
        assert "bounded_walk" not in grouped_gemm_variant(**options, persistent=False).config
    free_ptx, bounded_ptx = compiled_ptx(free, "sm_90a"), compiled_ptx(bounded, "sm_90a")
    shuffles = r"shfl\.sync\.bfly"
    assert count(shuffles, bounded_ptx) == count(shuffles, free_ptx) + 5
    wgmma = r"wgmma\.mma_async\.sync\.aligned"
    assert count(wgmma, bounded_ptx) == count(wgmma, free_ptx) > 0
    assert_wgmmas_not_serialized(bounded_ptx)
    assert ptxas_spill_bytes(bounded_ptx) in (None, 0)
    with pytest.raises(ValueError, match="bounded_walk: only in the persistent kernel"):
        GroupedGemmSm90(4096, 2048, bounded_walk=True)
