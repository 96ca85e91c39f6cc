"""MoK's bf16 layer from two trees side by side: a commit's ``mok`` package against the working
tree's, each timed in processes of its own that take turns, their outputs compared bit for bit.

    python perf/compare_trees.py --base COMMIT|DIR [--configs dsv3,qwen3-30b-32k] [--passes forward,step]
                                 [--rounds 2] [--seconds 1]

For a change that should not move the layer (a regression check against the tree before it, or
against the tree an issue started from): per config (perf/bench_layer.py's CONFIGS) and pass
(``forward``: ``mok.forward`` without saving; ``step``: forward and ``mok.backward``), the ms of a
call in each round (S seconds of calls, then S seconds timed), the working tree's over the base's,
and whether every round of both trees gave the same bits (the forward's output; the step's dx,
router-weight and weight gradients). Only the functional API (``mok.MoKConfig``, ``mok.forward``,
``mok.backward``) is called, so any tree that has it can be the base. The base's ``mok`` is taken
from ``git archive`` into a temporary folder, or, where ``--base`` names a folder holding a ``mok``
package, from there (a copy without git, as on a GPU machine that gets the working tree only:
``git archive COMMIT mok | tar -x -C DIR`` beforehand); it is imported through PYTHONPATH, with a
kernel cache of its own (``$TMPDIR/mok-compare-kernels-<commit or folder>``); the processes
alternate so that both see the machine's drift alike.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSES = ("forward", "step")


def commit_of(rev: str) -> str:
    """The full hash of ``rev`` in this repository; SystemExit naming it where git knows no such commit."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--base: expected a commit of {ROOT}, got {rev!r} (git rev-parse found none)")
    return found.stdout.strip()


def base_folder(base: str) -> Path | None:
    """``base`` as a folder holding a ``mok`` package (the base tree given as files), else None."""
    folder = Path(base)
    return folder.resolve() if (folder / "mok" / "__init__.py").is_file() else None


def extract_package(commit: str, into: Path) -> Path:
    """The ``mok`` package of ``commit`` written under ``into`` (``into/mok``); returns ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "mok"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def cases_of(configs: str, passes: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(config, pass, (T, H, I, E, k)) for every named config and pass; uniform routing, no shared expert."""
    if str(ROOT / "perf") not in sys.path:  # (run as a script it is there already)
        sys.path.insert(0, str(ROOT / "perf"))
    from bench_layer import CONFIGS

    cases = []
    for name in configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--configs: no config {name!r}; known: {', '.join(CONFIGS)}")
        T, H, I, E, k, shared, routing = CONFIGS[name]
        if shared or routing != "uniform":
            raise SystemExit(f"--configs: {name!r} has a shared expert or {routing} routing; this comparison takes uniform routing, routed experts only")
        for p in passes.split(","):
            if p not in PASSES:
                raise SystemExit(f"--passes: expected some of {', '.join(PASSES)}, got {p!r}")
            cases.append((name, p, (T, H, I, E, k)))
    return cases


def summary(results: list[dict]) -> list[str]:
    """The table's lines from the processes' records ({"tree": "base" | "head", "round", "config",
    "pass", "ms", "bits"}): per case each round's ms for both trees, head / base of their means, and
    whether every record of the case has the same bits."""
    cases = list(dict.fromkeys((r["config"], r["pass"]) for r in results))
    lines = [f"{'config':<16}{'pass':<9}{'base ms':>20}{'head ms':>20}{'head/base':>11}  same bits"]
    for config, kind in cases:
        mine = [r for r in results if (r["config"], r["pass"]) == (config, kind)]
        ms = {tree: [r["ms"] for r in mine if r["tree"] == tree] for tree in ("base", "head")}
        rounds = {tree: " ".join(f"{m:.3f}" for m in ms[tree]) for tree in ms}
        ratio = (sum(ms["head"]) / len(ms["head"])) / (sum(ms["base"]) / len(ms["base"])) if ms["base"] and ms["head"] else float("nan")
        same = len({r["bits"] for r in mine}) == 1
        lines.append(f"{config:<16}{kind:<9}{rounds['base']:>20}{rounds['head']:>20}{ratio:>10.3f}x  {same}")
    return lines


def run_child(cases: list, seconds: float) -> None:
    """In a process of one tree: which mok it imported, then each case's record, a JSON line each."""
    import torch

    import mok

    print(json.dumps({"mok": mok.__file__}), flush=True)
    for name, kind, shape in cases:
        print(json.dumps({"config": name, "pass": kind, **timed_case(mok, kind, shape, seconds)}), flush=True)
        torch.cuda.empty_cache()


def timed_case(mok, kind: str, shape: tuple, seconds: float) -> dict:
    """{"ms": a call's mean time, "bits": sha1 of its outputs} for one pass at one shape (T, H, I, E, k):
    bench_layer's inputs (the same draws from seed 0), ``seconds`` of calls, then as long timed."""

    import torch

    T, H, I, E, k = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices.int()
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), dim=1)
    experts = [(torch.randn(*s, device="cuda", generator=g) * s[2] ** -0.5).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))]
    dout = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    config = mok.MoKConfig(H, I, E, k, None)

    def forward():
        return [mok.forward(config, None, x, idx, w, *experts, None, save_for_backward=False, check_routing=False)[0]]

    def step():
        _, ctx = mok.forward(config, None, x, idx, w, *experts, None, check_routing=False)
        grads = mok.backward(config, None, ctx, dout)
        return [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down]

    fn = forward if kind == "forward" else step
    digest = hashlib.sha1()
    for t in fn():
        digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    end = time.time() + seconds  # (to the clock and power this load holds)
    while time.time() < end:
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, began = 0, time.time()
    start.record()
    while time.time() - began < seconds:
        for _ in range(5):
            fn()
        calls += 5
    stop.record()
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(stop) / calls, "bits": digest.hexdigest()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the commit whose mok package is compared with the working tree's, or a folder holding one")
    parser.add_argument("--configs", default="dsv3,qwen3-30b-32k")
    parser.add_argument("--passes", default="forward,step")
    parser.add_argument("--rounds", type=int, default=2, help="turns of both trees' processes")
    parser.add_argument("--seconds", type=float, default=1.0, help="of calls before each case's timing, and timed")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # (the cases, as JSON: run in this process)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child), args.seconds)
        return 0
    if not args.base:
        raise SystemExit("--base: expected a commit (or a folder holding a mok package) to compare the working tree with")
    folder = base_folder(args.base)
    label = hashlib.sha1(str(folder).encode()).hexdigest()[:12] if folder else commit_of(args.base)[:12]
    cases = cases_of(args.configs, args.passes)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("compare_trees: needs a CUDA GPU (none visible to torch)")
    print(f"# base {folder or label} ({args.base}) against the working tree {ROOT}; {args.rounds} rounds, {args.seconds} s a case")
    results = []
    with tempfile.TemporaryDirectory(prefix="mok-base-") as scratch:
        trees = {"base": folder or extract_package(commit_of(args.base), Path(scratch)), "head": ROOT}
        for turn in range(args.rounds):
            for tree, root in trees.items():
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
                if tree == "base":
                    env["MOK_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"mok-compare-kernels-{label}")
                child = subprocess.run([sys.executable, __file__, "--child", json.dumps(cases), "--seconds", str(args.seconds)],
                                       env=env, capture_output=True, text=True)
                records = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
                imported = Path(records[0]["mok"]).resolve() if records else None
                if imported is not None and not imported.is_relative_to(Path(root).resolve()):
                    raise SystemExit(f"{tree}: expected mok from {root}, the process imported {imported} (an installed mok ahead of PYTHONPATH?)")
                if child.returncode != 0 or not records:
                    raise SystemExit(f"{tree} (round {turn + 1}) failed, rc {child.returncode}:\n{child.stderr[-3000:]}")
                for r in records[1:]:
                    results.append({**r, "tree": tree, "round": turn + 1})
                print(f"# {tree} round {turn + 1}: " + ", ".join(f"{r['config']} {r['pass']} {r['ms']:.3f} ms" for r in records[1:]), flush=True)
    print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
