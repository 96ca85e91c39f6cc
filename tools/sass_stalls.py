"""Where a kernel's warps wait, from Nsight Compute: stall reasons and the hottest SASS instructions.

On the GPU machine (ncu is installed there; one launch profiled, the second, after the JIT):

    ncu --set full --import-source no -k regex:persistent --launch-skip 1 --launch-count 1 -o $OUT/rep python3 script.py
    ncu -i $OUT/rep.ncu-rep --page source --csv --print-source sass > $OUT/rep_sass.csv

then anywhere:

    python tools/sass_stalls.py rep_sass.csv [more.csv ...] [--top 25]

Per kernel in each file: its SASS instruction count (a kernel of many thousands, each warpgroup
running a different part, can outgrow the instruction cache: no_instruction stalls then lead),
the share of warp-state samples per stall reason, and the instructions with the most samples.
That is how the ping-pong SwiGLU-backward GEMM's instruction-cache misses and per-value
reciprocal branches were found (docs/notes/pingpong-backward-gemms.md).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class KernelSource:
    """One kernel's rows of ncu's source page: SASS text and the per-reason sample counts."""

    name: str
    rows: list[dict[str, str]] = field(default_factory=list)

    def stall_columns(self) -> list[str]:
        return [c for c in (self.rows[0] if self.rows else {}) if c.startswith("stall_") and "Not Issued" not in c]

    def stall_shares(self) -> dict[str, float]:
        """Fraction of all warp-state samples per stall reason, largest first."""
        totals = Counter({c: sum(number(r[c]) for r in self.rows) for c in self.stall_columns()})
        whole = sum(totals.values()) or 1.0
        return {c: n / whole for c, n in totals.most_common()}

    def hottest(self, top: int) -> list[tuple[float, str, str, str]]:
        """(share of samples, address, main stall reason, SASS) of the ``top`` most sampled instructions."""
        whole = sum(number(r[SAMPLES]) for r in self.rows) or 1.0
        ranked = sorted(self.rows, key=lambda r: -number(r[SAMPLES]))[:top]
        columns = self.stall_columns()
        return [
            (number(r[SAMPLES]) / whole, r["Address"], max(columns, key=lambda c: number(r[c])) if columns else "", r["Source"].strip())
            for r in ranked
        ]


def number(text: str) -> float:
    """ncu's CSV numbers carry thousands separators; empty cells are 0."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str) -> list[KernelSource]:
    """The kernels of one ``--page source --csv`` export: a "Kernel Name" line, a header, rows."""
    kernels: list[KernelSource] = []
    header: list[str] | None = None
    with open(path, newline="") as f:
        for line in csv.reader(f):
            if not line:
                continue
            if line[0] == "Kernel Name":
                kernels.append(KernelSource(line[1] if len(line) > 1 else ""))
                header = None
            elif header is None:
                header = line
            elif kernels and len(line) == len(header):
                kernels[-1].rows.append(dict(zip(header, line)))
    return kernels


def report(kernel: KernelSource, top: int) -> str:
    lines = [f"{kernel.name[:100]}", f"  {len(kernel.rows)} SASS instructions"]
    lines += [f"  {reason:<26}{share * 100:6.1f}%" for reason, share in list(kernel.stall_shares().items())[:10]]
    lines += [f"  {share * 100:5.1f}%  {address:>16}  {reason:<24}{sass[:90]}" for share, address, reason, sass in kernel.hottest(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.files:
        for kernel in read_source_page(path):
            print(f"== {path}")
            print(report(kernel, args.top))


if __name__ == "__main__":
    main()
