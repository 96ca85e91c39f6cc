"""Symmetric device memory across the ranks of a group, through cuda-python's VMM API.

Every rank allocates the same number of bytes with ``cuMemCreate`` and exports it. Where
every rank's device reports fabric handles (NVLink fabrics such as NVL72 racks, through
IMEX), the 64-byte fabric handles are exchanged with one all_gather; otherwise (or if any
rank fails to create, export or import one: every rank then falls back together) the
allocation is exported as a POSIX file descriptor and sent to every peer over a UNIX
socket (descriptors cannot travel through torch.distributed's TCP store; this path is
for the ranks of one host). Each rank imports all peers' allocations and maps them, its
own included, into one reserved virtual range, rank r's at ``base + r·size``, with
read/write access for its device: kernels reach any rank's memory at ``peer_ptr(r)``,
over NVLink where there is one. ``handle_type`` says which path was taken.

Creation checks once, with one collective, that every rank asks for the same workspace
(size and layout spec) and raises on all ranks if not. ``close()`` unmaps and releases
everything; it also runs at interpreter exit. NVLink multicast is not created here: it
is refused while any of NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 or
NVSHMEM_DISABLE_NVLS=1 is set (a shared host's GPUs can be put out of service by it), and
MoK has no multicast path yet either way.
"""

from __future__ import annotations

import atexit
import os
import socket
import uuid
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

MULTICAST_OFF_SWITCHES = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def check_multicast_allowed(requested: bool, env: Mapping[str, str] | None = None) -> None:
    """Refuse NVLink multicast unless asked for and allowed by the environment.

    Raises RuntimeError naming the variable that forbids it. MoK has no multicast path yet,
    so an allowed request is refused too (NotImplementedError) rather than half-served.
    """
    if not requested:
        return
    env = os.environ if env is None else env
    for name, off in MULTICAST_OFF_SWITCHES.items():
        if env.get(name) == off:
            raise RuntimeError(
                f"NVLink multicast refused: {name}={off} is set (multicast can take a shared host's "
                "GPUs out of service); leave multicast=False"
            )
    raise NotImplementedError("NVLink multicast: MoK has no multicast path yet; use multicast=False")


def _cu(result: Any, what: str) -> Any:
    """Unwrap a cuda-python driver call's (error, value...) tuple, raising on error."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"MoK workspace: {what} failed with {err.name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def agree_on_spec(spec: Mapping[str, Any], group) -> None:
    """One collective: every rank must ask for the same workspace, else all ranks raise."""
    import torch.distributed as dist

    mine = dict(sorted(spec.items()))
    specs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(specs, mine, group=group)
    for rank, other in enumerate(specs):
        if other != mine:
            diff = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
            here = dist.get_rank(group)
            raise ValueError(
                f"MoK workspace: ranks disagree on {', '.join(diff)}: rank {here} has "
                f"{ {k: mine.get(k) for k in diff} }, rank {rank} has { {k: other.get(k) for k in diff} }"
            )


def _every_rank(ok: bool, group) -> bool:
    """True when ``ok`` holds on every rank of ``group`` (one all_gather: every rank gets the same answer)."""
    import torch.distributed as dist

    votes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, bool(ok), group=group)
    return all(votes)


def _fabric_supported(device: int) -> bool:
    """Whether the driver reports fabric handles for ``device`` (creating one may still be refused: no IMEX channel)."""
    from cuda.bindings import driver

    try:
        dev = _cu(driver.cuDeviceGet(device), "cuDeviceGet")
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
        return _cu(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute") == 1
    except RuntimeError:  # a driver that does not know the attribute: no fabric (never raise before the vote)
        return False


def _exchange_fds(fd: int, group, token: str) -> list[int]:
    """Send this rank's descriptor to every peer over abstract UNIX sockets; returns all ranks' (own first is ours)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name = lambda r: f"\0mok-ws-{token}-{r}".encode()  # noqa: E731
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name(rank))
    listener.listen(world)
    listener.settimeout(60.0)  # a peer that never connects raises instead of hanging
    try:
        dist.barrier(group=group)  # every rank listens before anyone connects
        for peer in range(world):
            if peer != rank:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(60.0)
                    conn.connect(name(peer))
                    socket.send_fds(conn, [rank.to_bytes(4, "little")], [fd])
        fds = [-1] * world
        fds[rank] = fd
        try:
            for _ in range(world - 1):
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(60.0)
                    msg, got, _, _ = socket.recv_fds(conn, 4, 1)
                    fds[int.from_bytes(msg, "little")] = got[0]
        except BaseException:  # the peers' descriptors received so far are ours to close (our own: the caller's)
            for r, received in enumerate(fds):
                if r != rank and received >= 0:
                    os.close(received)
            raise
        return fds
    finally:
        listener.close()


class SymmetricWorkspace:
    """``nbytes`` of device memory on every rank of ``group``, each rank's mapped on every rank."""

    def __init__(
        self, nbytes: int, group=None, *, spec: Mapping[str, Any] | None = None, multicast: bool = False
    ) -> None:
        import torch.distributed as dist
        from cuda.bindings import driver

        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: expected a positive int, got {nbytes!r}")
        check_multicast_allowed(multicast)
        group = group if group is not None else dist.group.WORLD
        self._group = weakref.ref(group)  # (the collectives are all here: holding the group would keep it past its destroy)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        agree_on_spec({**(spec or {}), "nbytes": nbytes, "world": self.world}, group)

        self.device = torch.cuda.current_device()
        torch.cuda.init()
        torch.empty(1, device=self.device)  # make the device's primary context current
        fd_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.handle_type = "posix"
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = fd_type
        gran = _cu(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
        self.size = -(-nbytes // gran) * gran
        self.nbytes = nbytes

        self._handles: list[Any] = []
        self._mapped: list[int] = []
        self._fds: list[int] = []
        self.base = 0
        try:
            peers = self._import_by_fabric(prop, group) if _every_rank(_fabric_supported(self.device), group) else None
            if peers is None:
                own = _cu(driver.cuMemCreate(self.size, prop, 0), "cuMemCreate")
                self._handles.append(own)
                fd = _cu(driver.cuMemExportToShareableHandle(own, fd_type, 0), "cuMemExportToShareableHandle")
                token = [uuid.uuid4().hex if self.rank == 0 else None]
                dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
                self._fds = [int(fd)]  # (closed by close() if the exchange fails)
                self._fds = _exchange_fds(int(fd), group, token[0])
                peers = []
                for r in range(self.world):  # each imported handle is kept at once: close() releases it if a later one fails
                    if r != self.rank:
                        self._handles.append(
                            _cu(driver.cuMemImportFromShareableHandle(self._fds[r], fd_type), "cuMemImportFromShareableHandle")
                        )
                    peers.append(own if r == self.rank else self._handles[-1])
            self.base = int(_cu(driver.cuMemAddressReserve(self.size * self.world, gran, 0, 0), "cuMemAddressReserve"))
            for r, handle in enumerate(peers):
                _cu(driver.cuMemMap(self.base + r * self.size, self.size, 0, handle, 0), "cuMemMap")
                self._mapped.append(self.base + r * self.size)
            access = driver.CUmemAccessDesc()
            access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.device
            access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _cu(driver.cuMemSetAccess(self.base, self.size * self.world, [access], 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise
        self.peer_table = torch.tensor([self.peer_ptr(r) for r in range(self.world)], dtype=torch.int64, device=self.device)
        self._finalizer = weakref.finalize(
            self, SymmetricWorkspace._release, self._mapped, self._handles, self._fds, self.base, self.size, self.device
        )
        _live.add(self)

    @property
    def group(self):
        """The process group this workspace was built on; None once that group is gone (held weakly)."""
        return self._group()

    def _import_by_fabric(self, prop, group) -> list | None:
        """Every rank's allocation through fabric handles (own first in ``_handles``), or None, on
        every rank alike, when any rank could not create, export or import one (its pieces released)."""
        import torch.distributed as dist
        from cuda.bindings import driver

        fabric = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        prop.requestedHandleTypes = fabric
        held: list[Any] = []
        blob = None
        try:
            held.append(_cu(driver.cuMemCreate(self.size, prop, 0), "cuMemCreate (fabric)"))
            blob = bytes(_cu(driver.cuMemExportToShareableHandle(held[0], fabric, 0), "cuMemExportToShareableHandle (fabric)").data)
        except Exception:  # anything: this rank then votes against fabric (raising here would leave the peers waiting)
            blob = None
        blobs: list[Any] = [None] * self.world
        dist.all_gather_object(blobs, blob, group=group)
        peers = None
        if all(b is not None for b in blobs):
            try:
                peers = []
                for r, data in enumerate(blobs):
                    if r == self.rank:
                        peers.append(held[0])
                        continue
                    handle = driver.CUmemFabricHandle()
                    handle.data = data
                    imported = driver.cuMemImportFromShareableHandle(handle.getPtr(), fabric)
                    peers.append(_cu(imported, "cuMemImportFromShareableHandle (fabric)"))
                    held.append(peers[-1])
            except Exception:  # likewise: vote against, never raise alone
                peers = None
        if not _every_rank(peers is not None, group):
            for handle in held:
                driver.cuMemRelease(handle)
            prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            return None
        self._handles += held
        self.handle_type = "fabric"
        return peers

    def peer_ptr(self, rank: int) -> int:
        """Device address of rank ``rank``'s buffer, as mapped on this rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank: expected an int in [0, {self.world}), got {rank}")
        return self.base + rank * self.size

    @property
    def local_ptr(self) -> int:
        return self.peer_ptr(self.rank)

    @staticmethod
    def _release(mapped: list[int], handles: list[Any], fds: list[int], base: int, size: int, device: int) -> None:
        """Undo construction, whatever part of it happened; errors are ignored (runs at exit too)."""
        from cuda.bindings import driver

        if handles:
            try:
                torch.cuda.synchronize(device)  # no kernel on the workspace's device may still be reading a peer's memory
            except RuntimeError:
                pass
        for addr in mapped:
            driver.cuMemUnmap(addr, size)
        if base and handles:  # reserved only after every rank's handle was imported: one slot each
            driver.cuMemAddressFree(base, size * len(handles))
        for handle in handles:
            driver.cuMemRelease(handle)
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        mapped.clear(), handles.clear(), fds.clear()

    def close(self) -> None:
        """Unmap and release every mapping, allocation and descriptor (idempotent)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:  # construction failed part-way
            SymmetricWorkspace._release(self._mapped, self._handles, self._fds, self.base, self.size, self.device)
            self.base = 0
        _live.discard(self)

    @property
    def closed(self) -> bool:
        return not self._handles

    def __enter__(self) -> "SymmetricWorkspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_live: "weakref.WeakSet[SymmetricWorkspace]" = weakref.WeakSet()


class PerGroupCache:
    """Workspaces built once per (process group, key) and reused while open.

    Keyed weakly by the group: an entry goes with its group once that is destroyed and nothing
    else holds it, so the cache never keeps a group (or its workspaces' memory) alive."""

    def __init__(self) -> None:
        self._by_group: "weakref.WeakKeyDictionary[Any, dict[Hashable, Any]]" = weakref.WeakKeyDictionary()

    def get(self, group, key: Hashable, build: Callable[[], Any]):
        """The workspace cached for (group, key); built by ``build()`` when missing or closed."""
        built = self._by_group.setdefault(group, {})
        ws = built.get(key)
        if ws is None or ws.closed:
            ws = built[key] = build()
        return ws

    def __len__(self) -> int:
        return len(self._by_group)


_cache = PerGroupCache()


def get_workspace(nbytes: int, group=None, *, spec: Mapping[str, Any] | None = None) -> SymmetricWorkspace:
    """The workspace for (group, size, spec), created on first use and reused after.

    Kept for as long as its group lives: once the group is destroyed and nothing else holds
    it or the workspace, the workspace's memory is released."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    key = (nbytes, tuple(sorted((spec or {}).items())))
    return _cache.get(group, key, lambda: SymmetricWorkspace(nbytes, group, spec=spec))


@atexit.register
def _close_all() -> None:
    for ws in list(_live):
        ws.close()
