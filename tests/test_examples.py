"""The README's training example runs and learns: one process, and 2 or 4 ranks under torchrun (CPU, gloo);
on one GPU (the fused kernels) and on two GPUs under torchrun (the expert-parallel kernels over NVLink)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_toy.py"


def losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss (\d+\.\d+)", stdout)]


def run_example(cmd, timeout=300) -> subprocess.CompletedProcess:
    """``cmd`` with this checkout importable; fails the test on a non-zero exit, with its output's end."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def run(cmd):
    return losses(run_example(cmd).stdout)


def test_toy_training_on_one_process():
    got = run([sys.executable, str(EXAMPLE), "--steps", "16", "--device", "cpu"])
    assert len(got) == 4 and got[-1] < 0.9 * got[0]  # steps 0, 5, 10, 15


def test_toy_training_compare_prints_both_curves_and_exits_on_the_tolerance():
    """--compare: both runs from the same start on the same batches (bf16 against bf16 on the CPU:
    the same losses, so the relative difference is 0 and within any tolerance)."""
    done = run_example([sys.executable, str(EXAMPLE), "--steps", "12", "--device", "cpu", "--compare"])
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", done.stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 10, 11] and all(r[1] == r[2] for r in rows)
    assert "relative difference 0.00%: within 2%" in done.stdout


@pytest.mark.gpu
def test_fp8_block_toy_training_tracks_bf16_over_200_steps():
    """precision="fp8_block" (DeepSeek-V3's recipe) against bf16 from the same start: the final
    loss within 2% (the example's default tolerance; exit status 1 otherwise)."""
    done = run_example([sys.executable, str(EXAMPLE), "--steps", "200", "--device", "cuda", "--precision", "fp8_block", "--compare"],
                       timeout=600)
    assert "within 2%" in done.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo over localhost")
@pytest.mark.parametrize("ranks", [2, 4])
def test_toy_training_under_torchrun(ranks):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(29510 + ranks),
           str(EXAMPLE), "--steps", "6", "--device", "cpu"]
    got = run(cmd)
    assert len(got) == 2 and got[-1] < got[0]


@pytest.mark.gpu
def test_toy_training_on_one_gpu():
    got = run([sys.executable, str(EXAMPLE), "--steps", "16", "--device", "cuda"])
    assert len(got) == 4 and got[-1] < 0.9 * got[0]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_toy_training_on_two_gpus_under_torchrun():
    """The README's torchrun command: one rank per GPU (NCCL), each with half the experts."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29530",
           str(EXAMPLE), "--steps", "16", "--device", "cuda"]
    got = run(cmd)
    assert len(got) == 4 and got[-1] < 0.9 * got[0]
