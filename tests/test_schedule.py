"""The routing schedule against a naive Python placement, on random and adversarial routings."""

import pytest
import torch

from mok.schedule import build_schedule, worst_case_capacity


def naive_schedule(topk_idx, num_experts, block_m, capacity, rank, world):
    """Walk experts in order, their (g, j) pairs in canonical order, padding each to block_m."""
    idx = topk_idx.tolist()
    num_local = num_experts // world
    counts, offsets = [], [0]
    row_of = {}
    for local in range(num_local):
        e = rank * num_local + local
        pairs = [(g, j) for g, row in enumerate(idx) for j, ex in enumerate(row) if ex == e]
        for r, pair in enumerate(pairs):
            row_of[pair] = offsets[-1] + r
        counts.append(len(pairs))
        offsets.append(offsets[-1] + -(-len(pairs) // block_m) * block_m)
    row_token = [-1] * capacity
    row_slot = [-1] * capacity
    slot_row = [[-1] * len(idx[0]) for _ in idx]
    for (g, j), r in row_of.items():
        if r < capacity:
            row_token[r], row_slot[r], slot_row[g][j] = g, j, r
    tile_expert = []
    for t in range(capacity // block_m):
        start = t * block_m
        owner = [e for e in range(num_local) if offsets[e] <= start < offsets[e + 1]]
        tile_expert.append(owner[0] if owner else -1)
    return counts, offsets, row_token, row_slot, slot_row, tile_expert, offsets[-1] > capacity


def check_against_naive(topk_idx, num_experts, block_m, capacity=None, rank=0, world=1):
    s = build_schedule(topk_idx, num_experts, block_m=block_m, capacity=capacity, rank=rank, world_size=world)
    cap = s.capacity
    counts, offsets, row_token, row_slot, slot_row, tile_expert, overflow = naive_schedule(
        topk_idx, num_experts, block_m, cap, rank, world
    )
    assert s.expert_counts.tolist() == counts
    assert s.expert_offsets.tolist() == offsets
    assert s.row_token.tolist() == row_token
    assert s.row_slot.tolist() == row_slot
    assert s.slot_row.tolist() == slot_row
    assert s.tile_expert.tolist() == tile_expert
    assert bool(s.overflow) == overflow
    for t in (s.expert_counts, s.expert_offsets, s.row_token, s.row_slot, s.slot_row, s.tile_expert):
        assert t.dtype == torch.int32
    return s


def routing(num_tokens, num_experts, topk, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=g).topk(topk, dim=1).indices.to(torch.int32)


@pytest.mark.parametrize("num_tokens,num_experts,topk,block_m", [(1, 4, 1, 8), (37, 8, 2, 8), (100, 64, 6, 16), (64, 256, 8, 4), (50, 5, 5, 128)])
def test_random_routing(num_tokens, num_experts, topk, block_m):
    s = check_against_naive(routing(num_tokens, num_experts, topk, seed=num_tokens), num_experts, block_m)
    assert not bool(s.overflow)
    # every (t, j) has exactly one row, and every placed row points back to it
    assert (s.slot_row >= 0).all()
    assert sorted(s.slot_row.flatten().tolist()) == sorted(r for r, g in enumerate(s.row_token.tolist()) if g >= 0)
    assert int(s.expert_counts.sum()) == num_tokens * topk


def test_all_tokens_to_one_expert_and_empty_experts():
    idx = torch.full((300, 1), 3, dtype=torch.int64)
    s = check_against_naive(idx, 8, 128)
    assert s.expert_counts.tolist() == [0, 0, 0, 300, 0, 0, 0, 0]
    assert s.expert_offsets.tolist() == [0, 0, 0, 0, 384, 384, 384, 384, 384]


def test_k8_e256_expert_parallel_ranks_partition_the_pairs():
    idx = routing(96, 256, 8, seed=7)
    world = 4
    placed = 0
    for rank in range(world):
        s = check_against_naive(idx, 256, 16, rank=rank, world=world)
        mine = (idx // 64 == rank)
        assert torch.equal(s.slot_row >= 0, mine)
        placed += int(mine.sum())
    assert placed == idx.numel()


def test_rank_with_nothing_routed():
    idx = torch.randint(0, 4, (20, 2), generator=torch.Generator().manual_seed(1))  # all on rank 0 of 2
    s = check_against_naive(idx, 8, 8, rank=1, world=2)
    assert int(s.expert_offsets[-1]) == 0 and (s.row_token == -1).all() and (s.tile_expert == -1).all()


def test_overflow_is_flagged_and_nothing_is_placed_past_capacity():
    idx = routing(40, 4, 2, seed=3)
    s = check_against_naive(idx, 4, 8, capacity=32)
    assert bool(s.overflow)
    assert int(s.slot_row.max()) < 32
    with pytest.raises(RuntimeError, match="overflow: the routing needs .* capacity is 32"):
        s.check_overflow()


def test_worst_case_capacity_is_enough_and_tight_for_one_token_per_expert():
    for num_tokens, topk, experts, bm in [(1, 1, 1, 128), (5, 8, 256, 16), (1000, 8, 32, 128)]:
        cap = worst_case_capacity(num_tokens, topk, experts, bm)
        assert cap % bm == 0
        idx = torch.arange(num_tokens * topk).view(num_tokens, topk) % experts
        s = build_schedule(idx, experts, block_m=bm)
        assert s.capacity == cap and not bool(s.overflow)
    # k distinct experts per token, one token: k rows each padded to a whole tile
    assert worst_case_capacity(1, 8, 256, 16) == 8 * 16


@pytest.mark.parametrize("experts,topk,bm", [(4, 1, 16), (6, 3, 8), (4, 2, 128)])
def test_worst_case_capacity_is_reached_when_every_expert_overflows_a_tile_by_one_row(experts, topk, bm):
    """Every expert holding one row more than a multiple of the tile pads the most: the routing
    then needs exactly the worst-case capacity (fits), one tile less overflows."""
    per_expert = next(m * bm + 1 for m in range(1, 64) if (m * bm + 1) * experts % topk == 0)  # ≡ 1 (mod bm)
    tokens = per_expert * experts // topk  # (>= per_expert as experts >= topk: a token's slots are distinct experts)
    pairs = torch.arange(experts).repeat_interleave(per_expert)  # expert of each (token, slot) pair
    idx = pairs.view(topk, tokens).T.contiguous()  # token t's slots: experts pairs[t], pairs[tokens + t], ...: distinct
    assert all(len(set(row.tolist())) == topk for row in idx)
    worst = worst_case_capacity(tokens, topk, experts, bm)
    fits = build_schedule(idx, experts, block_m=bm, capacity=worst)
    assert not bool(fits.overflow) and int(fits.expert_offsets[-1]) == worst == experts * (per_expert + bm - 1)
    assert bool(build_schedule(idx, experts, block_m=bm, capacity=worst - bm).overflow)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(topk_idx=torch.zeros(4, 2)), TypeError, "topk_idx: expected dtype int32 or int64"),
        (dict(topk_idx=torch.zeros(4, dtype=torch.int32)), ValueError, "topk_idx: expected a 2-d tensor"),
        (dict(num_experts=6, world_size=4), ValueError, "num_experts: expected a multiple of world_size=4"),
        (dict(rank=2, world_size=2), ValueError, "rank: expected an int in [0, 2)"),
        (dict(capacity=100), ValueError, "capacity: expected a multiple of block_m=128"),
        (dict(block_m=0), ValueError, "block_m: expected an int >= 1"),
    ],
)
def test_schedule_rejects_bad_input(kwargs, error, words):
    args = dict(topk_idx=torch.zeros(4, 2, dtype=torch.int32), num_experts=8)
    args.update(kwargs)
    with pytest.raises(error) as info:
        build_schedule(args.pop("topk_idx"), args.pop("num_experts"), **args)
    assert words in str(info.value)


def test_a_shared_prefix_puts_every_token_first_and_moves_the_routed_rows_behind_it():
    """build_schedule(shared_prefix=True): rows 0 .. N-1 are tokens 0 .. N-1 (slot k), padding to
    whole tiles, those tiles expert E_local; the routed schedule follows unchanged but for the
    shift (offsets, slot_row, row_token and tile_expert of its rows)."""
    g = torch.Generator().manual_seed(3)
    n, e, k, bm = 300, 8, 4, 128
    idx = torch.rand(n, e, generator=g).topk(k, dim=1).indices
    plain = build_schedule(idx, e, block_m=bm)
    shared = build_schedule(idx, e, block_m=bm, shared_prefix=True)
    prefix = 384  # 300 tokens in whole 128-row tiles
    assert shared.shared_rows == prefix and shared.capacity == prefix + plain.capacity
    assert shared.row_token[:n].tolist() == list(range(n)) and (shared.row_token[n:prefix] == -1).all()
    assert (shared.row_slot[:n] == k).all() and (shared.row_slot[n:prefix] == -1).all()
    assert (shared.tile_expert[: prefix // bm] == e).all()
    assert torch.equal(shared.row_token[prefix:], plain.row_token) and torch.equal(shared.row_slot[prefix:], plain.row_slot)
    assert torch.equal(shared.tile_expert[prefix // bm :], plain.tile_expert)
    assert torch.equal(shared.expert_offsets, plain.expert_offsets + prefix)
    assert torch.equal(shared.expert_counts, plain.expert_counts)
    assert torch.equal(shared.slot_row, plain.slot_row + prefix)  # (every pair placed)
    for t in range(n):  # each pair's row holds that pair
        for j in range(k):
            row = int(shared.slot_row[t, j])
            assert (int(shared.row_token[row]), int(shared.row_slot[row])) == (t, j)

