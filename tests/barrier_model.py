"""A model of the mbarrier pipelines of MoK's Blackwell GEMMs (mok/kernels/sm100/tcgen05_tile.py),
for checking on any machine what no SM100 GPU here can run: that every wait completes, that no
stage or accumulator is overwritten before it is read, and that nothing arrives on shared memory
after the CTA has exited.

The model follows the PTX semantics the kernels rely on:
- an mbarrier completes a phase when its expected arrivals are in; ``try_wait.parity p`` passes
  once the phase of parity p has completed, so before any completion a wait on parity 1 passes and
  one on parity 0 blocks;
- pipeline states as CUTLASS's ``PipelineState`` (index, phase, count; the phase flips when the
  index wraps), producers starting at phase 1 and consumers at phase 0;
- asynchronous work as events that land later in any order, except that tcgen05.commit arrivals
  land in issue order (each covers every MMA issued before it): TMA loads arrive on a stage's full
  barrier, MMA commits on a stage's empty barrier or on an accumulator's full barrier.

The agents are the kernels' warps (mok/kernels/sm100/tcgen05_tile.py): the load warp (each tile's
K tiles into the stages as they free up, then the producer's tail), the MMA warp (per tile an
accumulator stage acquired, each stage's MMAs issued and the stage released by commit, the
accumulator committed), the epilogue warps (each tile's accumulator waited for, read,
released) and, where A's rows are gathered, the gather warps (each stage's rows, a second
arrival on its full barrier; in the one-launch expert MLP's fc2 tiles an arrival without rows).
``tail_state="setup"`` drains with the state the pipeline was created with instead of the
advanced one, as the kernels once did: the model must report that as a hang.

:func:`run_pair` runs a CTA pair (``mma_ctas`` = 2, tcgen05.mma.cta_group::2): both CTAs' load
warps fill their own stages and their bytes complete the leader's full barrier; the leader's MMA
warp reads both CTAs' stages, its commits land on both CTAs' empty and accumulator-full barriers;
both CTAs' epilogues read their own accumulators and arrive on the leader's accumulator-empty
barrier (remote arrivals, landing later); the leader's MMA warp drains the accumulator pipeline
(the producer's tail) and the epilogues meet on each other's tensor-memory dealloc barrier before
exit. Anything that lands on a CTA after it exited is a hazard.

:func:`run_one_launch` runs the one-launch forward's protocol across CTAs, a tile at a time: the
fc2 tiles' waits for their row tiles' fc1 tiles, which the CTAs publish as their stores complete.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


class Hang(AssertionError):
    """Every agent waits and nothing is in flight that could release it."""


class Hazard(AssertionError):
    """A buffer written before its reader finished, read before its data landed, or an arrival after exit."""


class Barrier:
    def __init__(self, name: str, arrivals: int = 1) -> None:
        self.name, self.arrivals, self.pending, self.completed = name, arrivals, arrivals, 0

    def arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.arrivals

    def passes(self, parity: int) -> bool:
        """try_wait.parity: the phase of this parity has completed (the current phase's parity differs)."""
        return self.completed % 2 != parity


@dataclass
class State:
    stages: int
    index: int = 0
    phase: int = 0
    count: int = 0

    def advance(self) -> None:
        self.index, self.count = self.index + 1, self.count + 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


@dataclass
class Wait:
    barrier: Barrier
    parity: int
    who: str


@dataclass
class Cta:
    """One CTA's barriers, buffers and in-flight events."""

    stages: int
    acc_stages: int
    gather: bool = False  # A's rows come from the gather warps: a stage is full once both parts landed
    full_arrivals: int | None = None  # the full barriers' arrival count (None: the kernels', one per part)
    full: list = field(init=False)
    empty: list = field(init=False)
    acc_full: list = field(init=False)
    acc_empty: list = field(init=False)
    stage_data: list = field(init=False)  # per stage: part -> (tile, k) landed ({} when empty)
    stage_in_flight: list = field(init=False)  # per stage: the parts whose loads are issued, not landed
    stage_readers: list = field(init=False)  # per stage: MMAs issued on it and not yet committed
    acc_owner: list = field(init=False)  # per accumulator: "mma" (being accumulated), "epilogue" or None
    events: list = field(default_factory=list)  # TMA loads (any order), then the commits (in order)
    commits: list = field(default_factory=list)

    @property
    def parts(self) -> tuple:
        """What fills a stage: the load warp's TMA bytes, and with ``gather`` the gather warps' rows."""
        return ("tma", "rows") if self.gather else ("tma",)

    def __post_init__(self) -> None:
        arrivals = len(self.parts) if self.full_arrivals is None else self.full_arrivals
        self.full = [Barrier(f"full[{s}]", arrivals=arrivals) for s in range(self.stages)]
        self.empty = [Barrier(f"empty[{s}]") for s in range(self.stages)]
        self.acc_full = [Barrier(f"acc_full[{a}]") for a in range(self.acc_stages)]
        self.acc_empty = [Barrier(f"acc_empty[{a}]") for a in range(self.acc_stages)]
        self.stage_data = [{} for _ in range(self.stages)]
        self.stage_in_flight = [set() for _ in range(self.stages)]
        self.stage_readers = [0] * self.stages
        self.acc_owner = [None] * self.acc_stages

    # the load, gather and MMA warps' operations
    def load(self, stage: int, tile: int, k: int, part: str = "tma") -> None:
        if part in self.stage_data[stage] or part in self.stage_in_flight[stage] or self.stage_readers[stage]:
            raise Hazard(f"{part} load of tile {tile} k {k} into stage {stage} while it holds {self.stage_data[stage]}, "
                         f"loads in flight {sorted(self.stage_in_flight[stage])} or {self.stage_readers[stage]} MMAs reading it")
        self.stage_in_flight[stage].add(part)
        self.events.append(("load", stage, part, (tile, k)))

    def mma(self, stage: int, tile: int, k: int, acc: int) -> None:
        if self.stage_data[stage] != {part: (tile, k) for part in self.parts}:
            raise Hazard(f"MMA of tile {tile} k {k} on stage {stage} holding {self.stage_data[stage]}")
        if self.acc_owner[acc] != "mma":
            raise Hazard(f"MMA into accumulator {acc} owned by {self.acc_owner[acc]}")
        self.stage_readers[stage] += 1

    def land(self, rng: random.Random) -> bool:
        """Land one in-flight event (a random TMA load, or the oldest commit); False if none is in flight."""
        choices = [("event", i) for i in range(len(self.events))] + ([("commit", 0)] if self.commits else [])
        if not choices:
            return False
        kind, i = rng.choice(choices)
        if kind == "event":
            _, stage, part, data = self.events.pop(i)
            self.stage_in_flight[stage].discard(part)
            self.stage_data[stage][part] = data
            self.full[stage].arrive()
        else:
            what, index = self.commits.pop(0)
            if what == "stage":
                self.stage_readers = [0] * self.stages  # a commit covers every MMA issued before it
                self.empty[index].arrive()
            else:
                self.acc_owner[index] = "done"
                self.acc_full[index].arrive()
        return True


def load_warp(cta: Cta, tiles: list[int], tail_state: str, who: str = "load warp"):
    """The load warp: each tile's K tiles, each into the next stage once it is free; then the
    producer's tail on the advanced state (or, ``tail_state="setup"``, on a fresh one)."""
    producer = State(cta.stages, phase=1)
    for tile, k_tiles in enumerate(tiles):
        for k in range(k_tiles):
            yield Wait(cta.empty[producer.index], producer.phase, f"{who}: stage {producer.index} for a load")
            cta.load(producer.index, tile, k)
            producer.advance()
    drain = producer if tail_state == "advanced" else State(cta.stages, phase=1)
    for _ in range(cta.stages):
        yield Wait(cta.empty[drain.index], drain.phase, f"{who}: tail, stage {drain.index}")
        drain.advance()
    pending = [index for what, index in cta.commits if what == "stage"]
    if pending or any(cta.stage_readers):
        raise Hazard(f"load warp: the tail passed with the releases of stages {pending} still to land")


def gather_warps(cta: Cta, tiles: list[int], copied: list[bool] | None = None, wait_free: bool = True):
    """The gather warps (``gather``): each tile's rows of each K tile into the next stage once it is
    free, on a state of their own that follows the load warp's; their copies arrive as they land.
    ``copied[tile]`` False (the one-launch expert MLP's fc2 tiles, whose A comes by TMA): the first
    gather thread arrives for all of them at once, with no data, once the stage is free (or, with
    ``wait_free`` False, without waiting: the arrival may then count towards the stage's earlier
    fill)."""
    producer = State(cta.stages, phase=1)
    for tile, k_tiles in enumerate(tiles):
        for k in range(k_tiles):
            if copied is None or copied[tile]:
                yield Wait(cta.empty[producer.index], producer.phase, f"gather warps: stage {producer.index} for rows")
                cta.load(producer.index, tile, k, part="rows")
            else:
                if wait_free:
                    yield Wait(cta.empty[producer.index], producer.phase, f"gather warps: stage {producer.index} for an arrival")
                cta.stage_data[producer.index]["rows"] = (tile, k)  # (nothing copied: the stage's A is the TMA's)
                cta.full[producer.index].arrive()
            producer.advance()


def mma_warp(ctas: list, tiles: list[int], acc_tail: str | None = None):
    """The MMA warp of ``ctas[0]`` (the leader of a pair: its MMAs read both CTAs' stages and
    accumulate into both CTAs' accumulators): per tile an accumulator stage once free (the
    leader's barrier), the K tiles' MMAs in order as their stages fill, each stage released by
    commit, the accumulator committed (the leader's commits reach every CTA of ``ctas``); then the
    accumulator producer's tail: a wait for the release of ``"every stage"`` (the pair kernels'),
    of the ``"last stage"`` used only (CuTe DSL's PipelineUmmaAsync.producer_tail, which counts on
    one thread's remote arrivals landing in order: the model does not), or none (a lone CTA's
    epilogue arrives on its own barriers before it exits)."""
    leader = ctas[0]
    consumer, acc_producer = State(leader.stages), State(leader.acc_stages, phase=1)
    for tile, k_tiles in enumerate(tiles):
        acc = acc_producer.index
        yield Wait(leader.acc_empty[acc], acc_producer.phase, f"MMA warp: accumulator {acc} for tile {tile}")
        for rank, cta in enumerate(ctas):
            if cta.acc_owner[acc] is not None:
                raise Hazard(f"MMA warp took accumulator {acc} for tile {tile} while CTA {rank}'s holds the {cta.acc_owner[acc]} "
                             "state of an earlier tile")
            cta.acc_owner[acc] = "mma"
        acc_producer.advance()
        for k in range(k_tiles):
            yield Wait(leader.full[consumer.index], consumer.phase, f"MMA warp: stage {consumer.index} full")
            for cta in ctas:
                cta.mma(consumer.index, tile, k, acc)
                cta.stage_data[consumer.index] = {}  # the MMAs have their operands; the stage is the next load's once they complete
            leader.commits.append(("stage", consumer.index))  # tcgen05.commit onto the stage's empty barrier(s)
            consumer.advance()
        leader.commits.append(("acc", acc))  # tcgen05.commit onto the accumulator's full barrier(s)
    if acc_tail == "last stage":
        for _ in range(leader.acc_stages - 1):
            acc_producer.advance()
        yield Wait(leader.acc_empty[acc_producer.index], acc_producer.phase, "MMA warp: accumulator tail")
    elif acc_tail == "every stage":
        for _ in range(leader.acc_stages):
            yield Wait(leader.acc_empty[acc_producer.index], acc_producer.phase, f"MMA warp: accumulator tail, stage {acc_producer.index}")
            acc_producer.advance()


def epilogue(cta: Cta, tiles: list[int], release=None, who: str = "epilogue"):
    """The epilogue warps: each tile's accumulator waited for, read, released (``release(acc)``:
    an arrival on this CTA's accumulator-empty barrier unless given)."""
    acc_consumer = State(cta.acc_stages)
    for tile in range(len(tiles)):
        acc = acc_consumer.index
        yield Wait(cta.acc_full[acc], acc_consumer.phase, f"{who}: accumulator {acc} of tile {tile}")
        if cta.acc_owner[acc] != "done":
            raise Hazard(f"{who} read accumulator {acc} of tile {tile} before its MMAs completed")
        cta.acc_owner[acc] = None
        if release is None:
            cta.acc_empty[acc].arrive()
        else:
            release(acc)
        acc_consumer.advance()


LANDINGS = ("eager", "lazy", "random")


def run_agents(agents: dict, land, landing: str, rng: random.Random, on_finish=None) -> None:
    """Step ``agents`` (name -> generator of Waits) until all have finished; ``land()`` lands one
    in-flight event (False: none), as ``landing`` says; ``on_finish(agents)`` after an agent
    finished (the ones left). Raises Hang when every agent waits and nothing is in flight."""
    waits = {name: None for name in agents}
    while agents:
        progressed = False
        for name in list(agents):
            while landing == "eager" and land():
                pass
            wait = waits[name]
            if wait is not None and not wait.barrier.passes(wait.parity):
                continue
            try:
                waits[name] = next(agents[name])
            except StopIteration:
                del agents[name], waits[name]
                if on_finish is not None:
                    on_finish(agents)
            progressed = True
        if not progressed and not land():
            raise Hang("; ".join(f"{w.who} waits on {w.barrier.name} parity {w.parity}" for w in waits.values()))
        if landing == "random" and rng.random() < 0.5:
            land()


def run_cta(
    tiles: list[int], stages: int, *, acc_stages: int = 1, tail_state: str = "advanced", landing: str = "random", seed: int = 0,
    gather: bool = False, full_arrivals: int | None = None, copied: list[bool] | None = None, wait_free: bool = True,
) -> None:
    """Run one CTA's agents over ``tiles`` (each a K-tile count) to the end; raises Hang or Hazard.
    ``landing``: when in-flight work lands: "eager" (all of it before each agent's step), "lazy"
    (only when every agent waits) or "random" (seeded). ``copied`` and ``wait_free``: the gather
    warps' (:func:`gather_warps`)."""
    if landing not in LANDINGS:
        raise ValueError(f"landing: expected one of {LANDINGS}, got {landing!r}")
    rng = random.Random(seed)
    cta = Cta(stages, acc_stages, gather, full_arrivals)
    agents = {"load warp": load_warp(cta, tiles, tail_state), "MMA warp": mma_warp([cta], tiles), "epilogue": epilogue(cta, tiles)}
    if gather:
        agents["gather warps"] = gather_warps(cta, tiles, copied, wait_free)
    run_agents(agents, lambda: cta.land(rng), landing, rng)
    if cta.events or cta.commits:
        raise Hazard(f"the CTA exits with {len(cta.events)} loads and {len(cta.commits)} commits still to arrive on its shared memory")


@dataclass
class Pair:
    """A CTA pair: the two CTAs, the remote arrivals in flight (epilogue releases onto the leader's
    accumulator-empty barriers, the dealloc handshake) and which CTAs have exited."""

    ctas: list
    remote: list = field(default_factory=list)  # (cta rank, barrier) arrivals still to land
    exited: set = field(default_factory=set)
    dealloc: list = field(default_factory=lambda: [Barrier("dealloc[0]"), Barrier("dealloc[1]")])

    def land(self, rng: random.Random) -> bool:
        """Land one in-flight thing of either CTA or one remote arrival; False if nothing is in flight."""
        sources = [c for c in range(2) if self.ctas[c].events or self.ctas[c].commits]
        choices = [("cta", c) for c in sources] + [("remote", i) for i in range(len(self.remote))]
        if not choices:
            return False
        kind, i = rng.choice(choices)
        if kind == "cta":
            self.land_cta(i, rng)
        else:
            rank, barrier = self.remote.pop(i)
            self.check_alive(rank, f"a remote arrival on {barrier.name}")
            barrier.arrive()
        return True

    def check_alive(self, rank: int, what: str) -> None:
        if rank in self.exited:
            raise Hazard(f"{what} lands on CTA {rank} after it exited")

    def land_cta(self, rank: int, rng: random.Random) -> None:
        """One event of CTA ``rank``: a TMA load (into its own stage; its bytes complete the leader's
        full barrier) or the leader's oldest commit (multicast: both CTAs' barriers)."""
        cta, leader = self.ctas[rank], self.ctas[0]
        choices = [("event", i) for i in range(len(cta.events))] + ([("commit", 0)] if cta.commits else [])
        kind, i = rng.choice(choices)
        if kind == "event":
            _, stage, part, data = cta.events.pop(i)
            self.check_alive(0, f"CTA {rank}'s load of stage {stage}")
            self.check_alive(rank, f"CTA {rank}'s load of stage {stage}")
            cta.stage_in_flight[stage].discard(part)
            cta.stage_data[stage][part] = data
            leader.full[stage].arrive()
            return
        what, index = cta.commits.pop(0)
        for c in range(2):
            self.check_alive(c, f"the leader's commit onto {what} {index}")
            if what == "stage":
                self.ctas[c].stage_readers = [0] * cta.stages
                self.ctas[c].empty[index].arrive()
            else:
                self.ctas[c].acc_owner[index] = "done"
                self.ctas[c].acc_full[index].arrive()


ACC_TAILS = ("every stage", "last stage", None)


def pair_epilogue(pair: Pair, rank: int, tiles: list[int]):
    """A pair CTA's epilogue: its own accumulator of each tile, released by an arrival on the
    leader's accumulator-empty barrier; then the dealloc handshake (arrive on the peer's barrier,
    wait on its own)."""
    leader = pair.ctas[0]
    yield from epilogue(pair.ctas[rank], tiles, lambda acc: pair.remote.append((0, leader.acc_empty[acc])), f"CTA {rank} epilogue")
    pair.remote.append((rank ^ 1, pair.dealloc[rank ^ 1]))
    yield Wait(pair.dealloc[rank], 0, f"CTA {rank} epilogue: dealloc handshake")


def run_pair(
    tiles: list[int], stages: int, *, acc_stages: int = 1, landing: str = "random", seed: int = 0,
    acc_tail: str | None = "every stage", full_parts: int = 2,
) -> None:
    """Run a CTA pair's agents over ``tiles`` (each a K-tile count, the same for both CTAs) to the
    end; raises Hang or Hazard. ``acc_tail``: the leader's accumulator tail (:func:`mma_warp`);
    without one the peer's last releases may land after the leader exited. ``full_parts``: the
    loads the leader's full barrier waits for (the kernels': 2, its own and the peer's bytes)."""
    if landing not in LANDINGS:
        raise ValueError(f"landing: expected one of {LANDINGS}, got {landing!r}")
    if acc_tail not in ACC_TAILS:
        raise ValueError(f"acc_tail: expected one of {ACC_TAILS}, got {acc_tail!r}")
    rng = random.Random(seed)
    ctas = [Cta(stages, acc_stages), Cta(stages, acc_stages)]
    for barrier in ctas[0].full:  # the leader's expect-tx covers both CTAs' bytes: a part from each
        barrier.arrivals = barrier.pending = full_parts
    for barrier in ctas[0].acc_empty:  # both CTAs' epilogues release the leader's accumulator stage
        barrier.arrivals = barrier.pending = 2
    pair = Pair(ctas)
    agents = {
        # each load warp fills its own stages, freed by the leader's commits (multicast), then drains them
        (0, "load warp"): load_warp(ctas[0], tiles, "advanced", "CTA 0 load warp"),
        (1, "load warp"): load_warp(ctas[1], tiles, "advanced", "CTA 1 load warp"),
        (0, "MMA warp"): mma_warp(ctas, tiles, acc_tail),
        (0, "epilogue"): pair_epilogue(pair, 0, tiles), (1, "epilogue"): pair_epilogue(pair, 1, tiles),
    }
    def exit_finished_ctas(agents: dict) -> None:
        for rank in (0, 1):
            if rank not in pair.exited and not any(r == rank for r, _ in agents):
                if pair.ctas[rank].events or pair.ctas[rank].commits:
                    raise Hazard(f"CTA {rank} exits with its loads or commits still to land")
                pair.exited.add(rank)

    run_agents(agents, lambda: pair.land(rng), landing, rng, exit_finished_ctas)
    while pair.land(rng):  # what is still in flight lands on exited CTAs: a hazard
        pass



B_UNITS = {"a": 2, "b": 2, "b0": 1, "b1": 1}  # a stage's bytes in halves of a B tile: A's, B's whole, either half of B


@dataclass
class SharingPair:
    """Two CTAs of a cluster on the two row tiles of each pair (``cluster_m`` = 2, one-CTA MMAs; the
    Hopper and Blackwell grouped GEMMs): each CTA loads its own A; where one expert has both row
    tiles each loads half of B into both CTAs' stages (multicast: a load per destination, landing
    on each at its own time), else its own whole B. A stage is full once a whole stage's bytes
    landed (``B_UNITS``: the expect-tx of a constant byte count), and free once ``empty_arrivals``
    releases landed: the kernels' two, each CTA's MMA commit (Hopper: its consumer warps'
    releases) multicast to both CTAs (``release_to_peer``), in order per source and destination,
    each after the MMAs it covers completed."""

    ctas: list
    release_to_peer: bool = True
    commits: dict = field(default_factory=dict)  # (source, destination) -> ("stage" | "acc", index) in issue order
    exited: set = field(default_factory=set)

    def land(self, rng: random.Random) -> bool:
        """Land one load (on its destination) or the oldest commit of one (source, destination); False if none is in flight."""
        choices = [("load", c, i) for c in range(2) for i in range(len(self.ctas[c].events))]
        choices += [("commit", route, 0) for route, queue in self.commits.items() if queue]
        if not choices:
            return False
        kind, where, i = rng.choice(choices)
        if kind == "load":
            cta = self.ctas[where]
            _, stage, part, data = cta.events.pop(i)
            self.check_alive(where, f"a load into stage {stage}")
            cta.stage_in_flight[stage].discard(part)
            cta.stage_data[stage][part] = data
            for _ in range(B_UNITS[part]):
                cta.full[stage].arrive()
        else:
            source, dest = where
            what, index = self.commits[where].pop(0)
            self.check_alive(dest, f"CTA {source}'s commit onto {what} {index}")
            cta = self.ctas[dest]
            if what == "stage":  # (the MMAs completed before the commit arrives anywhere: it covers every earlier MMA of its CTA)
                self.ctas[source].stage_readers = [0] * cta.stages
                cta.empty[index].arrive()
            else:
                cta.acc_owner[index] = "done"
                cta.acc_full[index].arrive()
        return True

    def check_alive(self, rank: int, what: str) -> None:
        if rank in self.exited:
            raise Hazard(f"{what} lands on CTA {rank} after it exited")

    def commit(self, source: int, what: str, index: int) -> None:
        dests = (source, source ^ 1) if what == "stage" and self.release_to_peer else (source,)
        for dest in dests:
            self.commits.setdefault((source, dest), []).append((what, index))

    def in_flight_to(self, rank: int) -> bool:
        return bool(self.ctas[rank].events) or any(q for (_, dest), q in self.commits.items() if dest == rank)


def sharing_load_warp(pair: SharingPair, rank: int, tiles: list):
    """CTA ``rank``'s load warp: per (K tiles, shared) tile its A, and B whole or (shared) its half
    into both CTAs' stages, each stage once its own empty barrier passed; then the producer's tail."""
    cta, peer = pair.ctas[rank], pair.ctas[rank ^ 1]
    producer = State(cta.stages, phase=1)
    who = f"CTA {rank} load warp"
    for tile, (k_tiles, shared) in enumerate(tiles):
        for k in range(k_tiles):
            yield Wait(cta.empty[producer.index], producer.phase, f"{who}: stage {producer.index} for a load")
            cta.load(producer.index, tile, k, "a")
            if shared:
                cta.load(producer.index, tile, k, f"b{rank}")
                peer.load(producer.index, tile, k, f"b{rank}")  # (a hazard if the peer's stage is not free)
            else:
                cta.load(producer.index, tile, k, "b")
            producer.advance()
    for _ in range(cta.stages):
        yield Wait(cta.empty[producer.index], producer.phase, f"{who}: tail, stage {producer.index}")
        producer.advance()


def sharing_mma_warp(pair: SharingPair, rank: int, tiles: list):
    """CTA ``rank``'s MMA warp (one-CTA MMAs): per tile its own accumulator stage, each stage's MMAs
    once its full barrier passed (A and the whole of B of this tile and K tile there), the stage
    released by a commit to both CTAs, the accumulator committed to its own."""
    cta = pair.ctas[rank]
    consumer, acc_producer = State(cta.stages), State(cta.acc_stages, phase=1)
    for tile, (k_tiles, shared) in enumerate(tiles):
        acc = acc_producer.index
        yield Wait(cta.acc_empty[acc], acc_producer.phase, f"CTA {rank} MMA warp: accumulator {acc} for tile {tile}")
        if cta.acc_owner[acc] is not None:
            raise Hazard(f"CTA {rank} took accumulator {acc} for tile {tile} while it holds the {cta.acc_owner[acc]} state of an earlier tile")
        cta.acc_owner[acc] = "mma"
        acc_producer.advance()
        parts = ("a", "b0", "b1") if shared else ("a", "b")
        for k in range(k_tiles):
            yield Wait(cta.full[consumer.index], consumer.phase, f"CTA {rank} MMA warp: stage {consumer.index} full")
            if cta.stage_data[consumer.index] != {part: (tile, k) for part in parts}:
                raise Hazard(f"CTA {rank}'s MMA of tile {tile} k {k} on stage {consumer.index} holding {cta.stage_data[consumer.index]}")
            cta.stage_readers[consumer.index] += 1
            cta.stage_data[consumer.index] = {}
            pair.commit(rank, "stage", consumer.index)
            consumer.advance()
        pair.commit(rank, "acc", acc)


def run_sharing_pair(
    tiles: list, stages: int, *, acc_stages: int = 1, landing: str = "random", seed: int = 0, empty_arrivals: int = 2,
    release_to_peer: bool = True,
) -> None:
    """Run both CTAs of a B-sharing pair (:class:`SharingPair`) over ``tiles``, each (K tiles, whether
    one expert has both row tiles), to the end; raises Hang or Hazard. ``empty_arrivals`` and
    ``release_to_peer``: the kernels' 2 and True; 1 (a stage freed by its own CTA's release
    alone) lets the peer's half of B land in a stage still being read."""
    if landing not in LANDINGS:
        raise ValueError(f"landing: expected one of {LANDINGS}, got {landing!r}")
    rng = random.Random(seed)
    ctas = [Cta(stages, acc_stages, full_arrivals=sum(B_UNITS[p] for p in ("a", "b"))) for _ in range(2)]
    for cta in ctas:
        for barrier in cta.empty:
            barrier.arrivals = barrier.pending = empty_arrivals
    pair = SharingPair(ctas, release_to_peer)
    agents = {}
    for rank in (0, 1):
        agents[(rank, "load warp")] = sharing_load_warp(pair, rank, tiles)
        agents[(rank, "MMA warp")] = sharing_mma_warp(pair, rank, tiles)
        agents[(rank, "epilogue")] = epilogue(ctas[rank], tiles, who=f"CTA {rank} epilogue")

    def exit_finished_ctas(agents: dict) -> None:
        for rank in (0, 1):
            if rank not in pair.exited and not any(r == rank for r, _ in agents):
                if pair.in_flight_to(rank):
                    raise Hazard(f"CTA {rank} exits with loads or commits still to land on it")
                pair.exited.add(rank)

    run_agents(agents, lambda: pair.land(rng), landing, rng, exit_finished_ctas)
    while pair.land(rng):  # what is still in flight lands on exited CTAs: a hazard
        pass


PUBLISH = ("lazy", "eager", "next_tile", "at_exit")


def run_one_launch(
    ctas: int, row_tiles: int, fc1_cols: int, fc2_cols: int, *, stage_tiles: int = 1, acc_stages: int = 2, publish: str = "lazy",
    seed: int = 0,
) -> None:
    """The one-launch forward's cross-CTA protocol (mok/kernels/common/expert_mlp.py, SM100's static
    walk: sm100/expert_mlp.py), tile by tile: ``ctas`` CTAs each walk tiles c, c + ctas, ... of the
    fc1 tiles (row_tiles x fc1_cols, row-major) and then of the fc2 tiles (row_tiles x fc2_cols).
    Per CTA the load warp may run ``stage_tiles`` tiles ahead of the MMA warp and the MMA warp
    ``acc_stages`` ahead of the epilogue; before loading an fc2 tile of row tile m the load warp
    waits until ready[m] counts all fc1_cols column tiles. ``publish``: when the epilogue counts
    an fc1 tile in ready: "lazy" (the kernels': once the CTA's next tile's accumulator is full,
    or right away for its last fc1 tile), "eager" (once its own epilogue is done), "next_tile"
    (lazy without the last fc1 tile's own publish: it waits for an fc2 tile that may wait for
    it) or "at_exit" (after every tile of the CTA: its fc2 tiles may wait for its own fc1 tiles
    for ever). Agents
    step in a random (seeded) order; raises Hang when every one waits, Hazard if a count is off
    at the end."""
    if publish not in PUBLISH:
        raise ValueError(f"publish: expected one of {PUBLISH}, got {publish!r}")
    rng = random.Random(seed)
    fc1_tiles, all_tiles = row_tiles * fc1_cols, row_tiles * (fc1_cols + fc2_cols)
    ready = [0] * row_tiles

    def row_of(t: int) -> int:
        return t // fc1_cols if t < fc1_tiles else (t - fc1_tiles) // fc2_cols

    def cta_agents(c: int) -> dict:
        tiles = list(range(c, all_tiles, ctas))
        last_fc1 = max((t for t in tiles if t < fc1_tiles), default=None)
        loaded, multiplied = [], []  # tiles handed from the load warp to the MMA warp, from the MMA warp to the epilogue

        def load():  # each agent yields (what it waits for, a test that it may go on)
            for t in tiles:
                yield f"CTA {c} load warp: room for tile {t}", lambda: len(loaded) < stage_tiles
                if t >= fc1_tiles:
                    yield f"CTA {c} load warp: row tile {row_of(t)} of fc2 tile {t}", lambda t=t: ready[row_of(t)] == fc1_cols
                loaded.append(t)

        def mma():
            for t in tiles:
                yield f"CTA {c} MMA warp: tile {t} loaded, an accumulator free", lambda: loaded and len(multiplied) < acc_stages
                multiplied.append(loaded.pop(0))

        def epilogue():
            pending = []
            for t in tiles:
                yield f"CTA {c} epilogue: tile {t}'s accumulator", lambda: bool(multiplied)
                multiplied.pop(0)
                if publish in ("lazy", "next_tile"):  # the previous fc1 tile's stores have drained under this tile's MMAs
                    for p in pending:
                        ready[row_of(p)] += 1
                    pending = []
                if t < fc1_tiles:
                    pending.append(t)
                    if publish == "eager" or (publish == "lazy" and t == last_fc1):
                        for p in pending:
                            ready[row_of(p)] += 1
                        pending = []
            for p in pending:
                ready[row_of(p)] += 1

        return {(c, "load"): load(), (c, "mma"): mma(), (c, "epilogue"): epilogue()}

    agents = {}
    for c in range(ctas):
        agents.update(cta_agents(c))
    waits = {name: next(agent, None) for name, agent in agents.items()}
    while any(w is not None for w in waits.values()):
        runnable = [name for name, w in waits.items() if w is not None and w[1]()]
        if not runnable:
            raise Hang("; ".join(w[0] for w in waits.values() if w is not None))
        name = rng.choice(runnable)
        waits[name] = next(agents[name], None)
    if ready != [fc1_cols] * row_tiles:
        raise Hazard(f"ready counts {ready} after the launch, expected {fc1_cols} for each row tile")
