"""Expert-parallel training steps on long-lived workspaces, a new batch every step: a soak test.

    python perf/ep_soak.py [--steps 200] [--worlds 2,3] [--seed 0]

Most EP GPU tests repeat one batch per workspace (up to 20 times), one runs eight different
batches on one workspace. Here each emulated rank group (W ranks on one GPU, one stream each,
one workspace each for the whole run) takes a fresh batch at every step, for as many steps as
asked: token counts drawn per rank (0 and 1 included), uniform, Zipf-skewed or
all-to-one-expert routing, the multi-launch or the one-launch forward. Every step's forward
output, dx, router-weight gradient and expert weight gradients must be the bits of the
single-GPU forward and backward on the concatenated batch, and no wait may time out. What this
looks for: state that leaks from one call into the next (flags, epochs, slots or rows of a
larger earlier batch) and rare orderings of the ranks' flag traffic. It prints the steps run,
the mismatches (each with its case) and the slowest step, and exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from mok.ep import EPLayout, EPWorkspace
from mok.fused_backward import moe_backward
from mok.fused_forward import moe_forward

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import gpu_layer, run_train_ranks, split_ranks, warm_up_training  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK, MAX_TOKENS = 512, 256, 12, 4, 300
ROUTINGS = ("uniform", "zipf", "one_expert")


def mismatches(results, want_out, want) -> list[str]:
    """The names of the results that are not the single-GPU bits."""
    grads = [g for _, g in results]
    got = {"out": torch.cat([out for out, _ in results]), "dx": torch.cat([g.dx for g in grads]),
           "d_topk_w": torch.cat([g.d_topk_w for g in grads])}
    for name in ("d_w_gate", "d_w_up", "d_w_down"):
        got[name] = torch.cat([getattr(g, name) for g in grads])
    expected = {"out": want_out, "dx": want.dx, "d_topk_w": want.d_topk_w,
                **{name: getattr(want, name) for name in ("d_w_gate", "d_w_up", "d_w_down")}}
    return [name for name in got if not torch.equal(got[name], expected[name])]


def warm_up(world: int) -> None:
    """Load every kernel, one rank at a time (helpers.warm_up_training), for both forwards."""
    layout = EPLayout(world=world, max_tokens=MAX_TOKENS, hidden=HIDDEN, topk=TOPK)
    x, idx, w, experts, _ = gpu_layer(8 * world, HIDDEN, INTER, EXPERTS, TOPK, seed=world)
    per_rank = split_ranks(world, [8] * world, x, idx, w, experts, None)
    for forward in ({}, {"one_launch": True}):
        warm_up_training(layout, per_rank, [args[0] for args in per_rank], **forward)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per rank group")
    parser.add_argument("--worlds", default="2,3", help="emulated EP sizes, comma-separated (each divides the 12 experts)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failures = 0
    for world in (int(w) for w in args.worlds.split(",")):
        warm_up(world)
        workspaces = EPWorkspace.local_group(EPLayout(world=world, max_tokens=MAX_TOKENS, hidden=HIDDEN, topk=TOPK))
        slowest, start = 0.0, time.perf_counter()
        for step in range(args.steps):
            counts = [rng.choice((0, 1, rng.randrange(2, MAX_TOKENS + 1))) for _ in range(world)]
            if not sum(counts):
                counts[rng.randrange(world)] = MAX_TOKENS  # (a batch of no token at all is not a step)
            routing = rng.choice(ROUTINGS)
            forward = rng.choice(({}, {"one_launch": True}))
            total = sum(counts)
            x, idx, w, experts, _ = gpu_layer(total, HIDDEN, INTER, EXPERTS, TOPK, seed=rng.randrange(1 << 30), routing=routing)
            dout = torch.randn(total, HIDDEN, device="cuda").bfloat16()
            saved = moe_forward(x, idx, w, *experts, save_for_backward=True)
            want = moe_backward(dout, x, idx, w, *experts, None, saved)
            bounds = [sum(counts[:p]) for p in range(world + 1)]
            douts = [dout[bounds[p]:bounds[p + 1]].contiguous() for p in range(world)]
            t0 = time.perf_counter()
            try:
                results = run_train_ranks(workspaces, split_ranks(world, counts, x, idx, w, experts, None), douts, **forward)
                wrong = mismatches(results, saved.out, want)
            except RuntimeError as error:  # a wait that timed out, recorded by a workspace
                wrong = [f"error: {error}"]
            slowest = max(slowest, time.perf_counter() - t0)
            if wrong:
                failures += 1
                print(f"W={world} step {step}: counts {counts}, {routing}, {forward or 'multi-launch'}: {', '.join(wrong)}")
                if any(name.startswith("error") for name in wrong):  # the workspaces are out of step now
                    workspaces = EPWorkspace.local_group(EPLayout(world=world, max_tokens=MAX_TOKENS, hidden=HIDDEN, topk=TOPK))
        print(f"W={world}: {args.steps} steps in {time.perf_counter() - start:.1f} s, slowest EP step {slowest * 1e3:.1f} ms, "
              f"{failures} with a mismatch or an error so far")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
