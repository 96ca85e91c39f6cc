"""Expert-parallel training steps on long-lived workspaces, a new batch every step: a soak test.

    python tools/ep_soak.py [--steps 200] [--worlds 2,3] [--seed 0]

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

from mok.pipeline.workspace import EPLayout, EPWorkspace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import (  # noqa: E402
    ep_training_case, ep_training_mismatches, run_train_ranks, warm_up_both_forwards,
)

HIDDEN, INTER, EXPERTS, TOPK, MAX_TOKENS = 512, 256, 12, 4, 300
ROUTINGS = ("uniform", "zipf", "one_expert")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per rank group")
    parser.add_argument("--worlds", default="2,3", help="emulated EP sizes, comma-separated (each divides the 12 experts)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failures = 0
    for world in (int(w) for w in args.worlds.split(",")):
        layout = EPLayout(world=world, max_tokens=MAX_TOKENS, hidden=HIDDEN, topk=TOPK)
        warm_up_both_forwards(layout, INTER, EXPERTS)
        workspaces = EPWorkspace.local_group(layout)
        slowest, start = 0.0, time.perf_counter()
        for step in range(args.steps):
            counts = [rng.choice((0, 1, rng.randrange(2, MAX_TOKENS + 1))) for _ in range(world)]
            if not sum(counts):
                counts[rng.randrange(world)] = MAX_TOKENS  # (a batch of no token at all is not a step)
            routing = rng.choice(ROUTINGS)
            forward = rng.choice(({}, {"one_launch": True}))
            seed = rng.randrange(1 << 30)
            per_rank, douts, want_out, want = ep_training_case(world, counts, HIDDEN, INTER, EXPERTS, TOPK, seed=seed, routing=routing)
            t0 = time.perf_counter()
            try:
                wrong = ep_training_mismatches(run_train_ranks(workspaces, per_rank, douts, **forward), want_out, want)
            except RuntimeError as error:  # a wait that timed out, recorded by a workspace
                wrong = [f"error: {error}"]
            slowest = max(slowest, time.perf_counter() - t0)
            if wrong:
                failures += 1
                print(f"W={world} step {step}: counts {counts}, {routing}, {forward or 'multi-launch'}: {', '.join(wrong)}")
                if any(name.startswith("error") for name in wrong):  # the workspaces are out of step now
                    workspaces = EPWorkspace.local_group(layout)
        print(f"W={world}: {args.steps} steps in {time.perf_counter() - start:.1f} s, slowest EP step {slowest * 1e3:.1f} ms, "
              f"{failures} with a mismatch or an error so far")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
