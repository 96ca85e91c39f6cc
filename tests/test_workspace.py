"""Workspace rules that need no GPU: the multicast guard and the cross-rank shape check."""

import gc

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from mok.runtime.workspace import MULTICAST_OFF_SWITCHES, PerGroupCache, SymmetricWorkspace, agree_on_spec, check_multicast_allowed

from helpers import value_errors_on_two_ranks


@pytest.mark.parametrize("name,value", [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")])
def test_multicast_refused_by_each_switch(name, value):
    with pytest.raises(RuntimeError, match=f"NVLink multicast refused: {name}={value}"):
        check_multicast_allowed(True, env={name: value})


def test_multicast_not_requested_is_fine_and_allowed_request_is_not_served():
    check_multicast_allowed(False, env={"NCCL_NVLS_ENABLE": "0"})
    with pytest.raises(NotImplementedError, match="no multicast path"):
        check_multicast_allowed(True, env={})


def test_workspace_refuses_multicast_before_touching_anything(monkeypatch):
    for name in MULTICAST_OFF_SWITCHES:  # (GPU machines set NCCL_NVLS_ENABLE=0: that one would be named)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    with pytest.raises(RuntimeError, match="NVSHMEM_DISABLE_NVLS=1"):
        SymmetricWorkspace(1 << 20, group=object(), multicast=True)


def test_workspace_rejects_bad_size():
    with pytest.raises(ValueError, match="nbytes: expected a positive int, got 0"):
        SymmetricWorkspace(0)


def _agree_then_disagree(rank):
    agree_on_spec({"hidden": 7168, "topk": 8}, None)  # agreement passes
    agree_on_spec({"hidden": 7168 if rank == 0 else 4096, "topk": 8}, None)


def test_ranks_disagreeing_on_shapes_raise_on_every_rank(tmp_path):
    for msg in value_errors_on_two_ranks(tmp_path, _agree_then_disagree):
        assert "ranks disagree on hidden" in msg, msg
        assert "7168" in msg and "4096" in msg


def _vote_worker(rank, init_file, out_dir):
    from mok.runtime.workspace import _every_rank

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        answers = [_every_rank(True, None), _every_rank(rank == 0, None), _every_rank(False, None)]
        with open(f"{out_dir}/{rank}.txt", "w") as f:
            f.write(repr(answers))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_handle_type_is_used_only_when_every_rank_can():
    """The fabric-or-POSIX decision is one vote: one rank that cannot makes every rank fall back."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_vote_worker, args=(f"{tmp}/init", tmp), nprocs=2)
        for rank in range(2):
            with open(f"{tmp}/{rank}.txt") as f:
                assert f.read() == repr([True, False, False]), rank


class _FakeGroup:
    """Stands in for a process group: PerGroupCache only needs it hashable and weakly referable."""


class _FakeWorkspace:
    def __init__(self) -> None:
        self.closed = False


def test_per_group_cache_reuses_rebuilds_when_closed_and_lets_the_group_go():
    cache, group, other = PerGroupCache(), _FakeGroup(), _FakeGroup()
    builds = []

    def build():
        builds.append(_FakeWorkspace())
        return builds[-1]

    first = cache.get(group, ("a", 1), build)
    assert cache.get(group, ("a", 1), build) is first and len(builds) == 1  # reused
    assert cache.get(group, ("b", 1), build) is not first  # another key: another workspace
    assert cache.get(other, ("a", 1), build) is not first  # another group: another workspace
    first.closed = True
    rebuilt = cache.get(group, ("a", 1), build)
    assert rebuilt is not first and not rebuilt.closed and len(builds) == 4
    assert len(cache) == 2
    del group, first, rebuilt
    gc.collect()
    assert len(cache) == 1  # the cache did not keep the dropped group (and with it its entries) alive
