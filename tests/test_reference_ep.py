"""The expert-parallel reference over gloo equals the single-process reference."""

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import random_layer
from mok import MoELayer
from mok.reference import moe_reference, moe_reference_ep

HIDDEN, INTER, SHARED_INTER = 16, 8, 12


def _tokens_per_rank(world):
    return [5 + 3 * r for r in range(world)]  # uneven on purpose


def _global_problem(world, num_experts, topk, skew, biased=False):
    """x, idx, w, the experts (with ``biased`` their (gate, up, down) biases after the weights), shared."""
    total = sum(_tokens_per_rank(world))
    x, idx, w, experts, shared = random_layer(total, HIDDEN, INTER, num_experts, topk, SHARED_INTER, seed=world * 100 + topk)
    if skew:  # every token of every rank on the last k experts: the first ranks get no rows
        base = num_experts - topk
        idx = torch.stack([torch.full((total,), base + j, dtype=torch.int32) for j in range(topk)], 1)
    if biased:
        g = torch.Generator().manual_seed(world)
        experts = (*experts, *(torch.randn(num_experts, n, generator=g) for n in (INTER, INTER, HIDDEN)))
    return x, idx, w, experts, shared


def _rank_step(rank, world, num_experts, topk, skew, biased=False):
    """This rank's slice of the global problem through the EP reference, forward and backward."""
    x, idx, w, experts, shared = _global_problem(world, num_experts, topk, skew, biased)
    counts = _tokens_per_rank(world)
    lo = sum(counts[:rank])
    sl = slice(lo, lo + counts[rank])
    e_local = num_experts // world
    esl = slice(rank * e_local, (rank + 1) * e_local)
    leaves = [x[sl].clone().requires_grad_(), w[sl].clone().requires_grad_()]
    leaves += [t[esl].clone().requires_grad_() for t in experts]
    leaves += [t.clone().requires_grad_() for t in shared]
    biases = tuple(leaves[5:8]) if biased else None  # (after the routed weights; the shared expert's then follow)
    out = moe_reference_ep(leaves[0], idx[sl], leaves[1], *leaves[2:5], tuple(leaves[-3:]), biases=biases)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
    out.backward(dout)
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]  # unused experts: zero
    return {"out": out.detach(), "dout": dout, "grads": grads}


def _worker(rank, world, num_experts, topk, skew, biased, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_rank_step(rank, world, num_experts, topk, skew, biased), os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while a peer still has an exchange in flight
    finally:
        dist.destroy_process_group()


def _teardown_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _rank_step(rank, world, 8, 2, False)
    layer = MoELayer(HIDDEN, INTER, 8, 2, group=dist.group.WORLD, dtype=torch.float32)  # the layer's CPU path too
    layer(torch.randn(3 + rank, HIDDEN, requires_grad=True)).sum().backward()
    del layer
    dist.barrier()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    torch.save(group() is None, os.path.join(out_dir, f"released{rank}.pt"))


@pytest.mark.parametrize("world,num_experts,topk,skew,biased", [
    (2, 8, 2, False, False), (2, 4, 1, True, False), (4, 8, 3, False, False), (4, 16, 8, True, False), (2, 8, 2, False, True),
])
def test_ep_reference_equals_single_process(tmp_path, world, num_experts, topk, skew, biased):
    """Forward bitwise, gradients to fp32 order; with ``biased`` the experts' biases (each rank its
    experts' slice, their gradients too)."""
    torch.set_num_threads(1)
    mp.spawn(_worker, args=(world, num_experts, topk, skew, biased, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    parts = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]

    x, idx, w, experts, shared = _global_problem(world, num_experts, topk, skew, biased)
    leaves = [t.clone().requires_grad_() for t in (x, w, *experts, *shared)]
    biases = tuple(leaves[5:8]) if biased else None
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], tuple(leaves[-3:]), biases=biases)
    want.backward(torch.cat([p["dout"] for p in parts]))

    # forward: bitwise equal (every expert sees the same rows in the same order)
    assert torch.equal(torch.cat([p["out"] for p in parts]), want.detach())
    # backward: the same gradients up to fp32 summation order
    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    assert close(torch.cat([p["grads"][0] for p in parts]), leaves[0].grad)  # dx
    assert close(torch.cat([p["grads"][1] for p in parts]), leaves[1].grad)  # d topk_w
    routed = len(experts)  # the routed weights (and biases): each rank holds its experts' slice
    for i in range(2, 2 + routed):
        assert close(torch.cat([p["grads"][i] for p in parts]), leaves[i].grad)
    for i in range(2 + routed, 5 + routed):  # shared expert: replicated, per-rank contributions sum to the total
        assert close(sum(p["grads"][i] for p in parts), leaves[i].grad)


def test_ep_reference_and_layer_let_the_process_group_go_at_destroy(tmp_path):
    """After a forward and backward (the EP reference, then mok.MoELayer on the CPU), destroy_process_group
    frees the group: nothing of MoK's keeps it.

    A group that outlives it is torn down during the interpreter's shutdown, with gloo's worker
    threads still running; the 4-rank torchrun example aborted there now and then ("terminate
    called without an active exception") while torch.distributed.nn's default arguments held the
    group: torch's functional collectives (which the EP reference used) and optimizers import that
    module lazily, after init_process_group; mok now imports it first.
    """
    world = 2
    mp.spawn(_teardown_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    released = [torch.load(tmp_path / f"released{r}.pt") for r in range(world)]
    assert released == [True] * world, f"process group still alive after destroy_process_group on ranks {released}"
