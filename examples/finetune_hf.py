"""Fine-tune a small random-initialised Qwen3-MoE (or gpt-oss) with transformers' own experts backend and with MoK.

    python examples/finetune_hf.py                            # one Hopper GPU, bf16, 50 steps
    python examples/finetune_hf.py --device cpu --steps 3     # smoke test anywhere (MoK's CPU reference path, fp32)
    python examples/finetune_hf.py --model gpt_oss            # gpt-oss: its clamped SwiGLU and expert biases

The same initial weights, batches and optimizer run twice: once with transformers' default experts
backend (grouped_mm), once on MoK (``mok.integrations.transformers.apply(model)``: every MoE layer's
experts through MoK's op, the model's own router handing it the top-k ids and weights). The data is
a random bigram language (each token a fixed random function of the previous one, one in ten
random), so the loss falls. Prints both loss curves side by side, their largest relative
difference, both mean step times (the first --warmup steps left out: they compile kernels) and
the part of each spent in the experts modules (forward and backward; the router and the rest of
the MoE block are outside it), on a GPU both peak memories; exits 1 if the curves differ by more
than --tol. ``--model gpt_oss``: gpt-oss's experts (interleaved, transposed gate/up weights with
biases, its clamped SwiGLU).

Needs transformers (``pip install 'mok[hf]'``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (one Hopper GPU, bf16) or cpu (MoK's reference path, fp32)")
    p.add_argument("--model", choices=MODELS, default="qwen3_moe", help="the model family (default qwen3_moe)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the mean step time")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16 on a GPU, 2 on the CPU)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512 on a GPU, 32 on the CPU)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4 on a GPU, 2 on the CPU)")
    p.add_argument("--hidden", type=int, default=None, help="H, a multiple of 8 on the GPU (default 1024 on a GPU, 256 on the CPU)")
    p.add_argument("--intermediate", type=int, default=None, help="each expert's I, a multiple of 8 on the GPU (default 256; 128 on the CPU)")
    p.add_argument("--experts", type=int, default=None, help="default 32 on a GPU, 8 on the CPU")
    p.add_argument("--topk", type=int, default=None, help="default 4 on a GPU, 2 on the CPU")
    p.add_argument("--vocab", type=int, default=None, help="default 1024 on a GPU, 512 on the CPU")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on a GPU (MoK's kernels take bf16), fp32 on the CPU")
    p.add_argument("--lr", type=float, default=3e-4,
                   help="AdamW's learning rate (default 3e-4; at 1e-3 AdamW amplifies the backends' bf16 rounding "
                        "differences until the two curves part, ~5%% by step 17 at the default shape)")
    p.add_argument("--baselines", default=None,
                   help="transformers experts backends to run beside MoK, comma-separated, the first the loss curves' "
                        "reference (default: the model's own, grouped_mm); e.g. grouped_mm,batched_mm,eager,sonicmoe,deepgemm "
                        "(one that does not run here, e.g. its package missing, is reported and left out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=None,
                   help="largest relative loss difference allowed (default 5e-2 in bf16, 1e-3 in fp32: "
                        "AdamW's first steps follow the gradients' signs, which rounding can flip where a gradient is near 0)")
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    defaults = dict(batch=(16, 2), seq=(512, 32), layers=(4, 2), hidden=(1024, 256), intermediate=(256, 128), experts=(32, 8),
                    topk=(4, 2), vocab=(1024, 512))
    for name, (on_gpu, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if gpu else "fp32")]
    args.tol = args.tol if args.tol is not None else (5e-2 if args.dtype == torch.bfloat16 else 1e-3)
    return args


MODELS = ("qwen3_moe", "gpt_oss")


def model_config(args):
    heads = args.hidden // 64
    kv_heads = max(d for d in range(1, max(heads // 4, 1) + 1) if heads % d == 0)  # (a divisor: 45 heads at H = 2880)
    if args.model == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, num_local_experts=args.experts,
            num_experts_per_tok=args.topk, layer_types=["full_attention"] * args.layers,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.intermediate, moe_intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True, max_position_embeddings=args.seq,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def batches(args, device):
    """A random bigram language: each next token is a fixed random permutation of the previous one,
    except for a random token one time in ten (so the loss falls toward ~0.1·ln(vocab), not 0)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    successor = torch.randperm(args.vocab - 3, generator=g) + 3
    out = []
    for _ in range(args.steps):
        ids = torch.empty(args.batch, args.seq, dtype=torch.long)
        ids[:, 0] = torch.randint(3, args.vocab, (args.batch,), generator=g)
        noise = torch.rand(args.batch, args.seq, generator=g) < 0.1
        random = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
        for t in range(1, args.seq):
            ids[:, t] = torch.where(noise[:, t], random[:, t], successor[ids[:, t - 1] - 3])
        out.append((ids.to(device), ids.to(device)))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ExpertsTimer:
    """The time a step spends in the model's MoE experts modules (those transformers runs through its
    experts interface, whichever backend), forward and backward: a mark at each module's forward
    entry and exit and at its backward's (module hooks), CUDA events on a GPU, the wall clock on
    the CPU. The router, the shared experts and the rest of the MoE block are outside it."""

    def __init__(self, model, device):
        import mok.integrations.transformers as mok_hf

        self.cuda = device.type == "cuda"
        self.marks = []  # (entry, exit) pairs of this step
        self.handles = []
        for _, experts in mok_hf.experts_modules(model):
            self.handles += [
                experts.register_forward_pre_hook(lambda *_: self.enter()), experts.register_forward_hook(lambda *_: self.leave()),
                experts.register_full_backward_pre_hook(lambda *_: self.enter()),
                experts.register_full_backward_hook(lambda *_: self.leave()),
            ]

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def enter(self) -> None:
        self.marks.append([self.mark(), None])

    def leave(self) -> None:
        self.marks[-1][1] = self.mark()

    def step_s(self) -> float:
        """Seconds in the experts modules since the last call (after the step's synchronisation)."""
        if self.cuda:
            total = sum(start.elapsed_time(end) for start, end in self.marks) / 1e3
        else:
            total = sum(end - start for start, end in self.marks)
        self.marks = []
        return total

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def train(model, data, args, device):
    """Losses, step times (forward, backward, AdamW step) and the experts modules' share of each
    (ExpertsTimer) of one run over ``data``."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, times, experts_times = [], [], []
    timer = ExpertsTimer(model, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ids, labels in data:
        sync(device)
        start = time.perf_counter()
        loss = model(ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
        experts_times.append(timer.step_s())
        losses.append(loss.item())
    timer.remove()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return losses, times, experts_times, peak


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    import mok.integrations.transformers as mok_hf

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # (max_memory_allocated and friends want an index)
        device = torch.device("cuda", torch.cuda.current_device())
    warnings.filterwarnings("ignore", message="MoK: running the MoE layer on the CPU")
    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_config(model_config(args), dtype=args.dtype).to(device)
    base.train()
    data = batches(args, device)
    tokens = args.batch * args.seq
    print(f"{'gpt-oss' if args.model == 'gpt_oss' else 'Qwen3-MoE'}, random init: {args.layers} layers, H {args.hidden}, {args.experts} experts of I {args.intermediate}, "
          f"top-{args.topk}, vocab {args.vocab}; {args.steps} steps of {args.batch} x {args.seq} tokens on {device}, "
          f"{str(args.dtype).replace('torch.', '')}, AdamW lr {args.lr}")

    runs = {}  # backend -> (losses, step times, experts modules' times, peak memory)
    for name in (args.baselines.split(",") if args.baselines else [None]) + ["mok"]:
        model = copy.deepcopy(base)
        try:
            if name == "mok":
                mok_hf.apply(model)
            elif name is not None:
                model.set_experts_implementation(name)
            backend = model.config._experts_implementation
            runs[backend] = train(model, data, args, device)
        except Exception as err:  # noqa: BLE001 (a baseline that does not run here: said, left out)
            if name == "mok" or not runs:  # (MoK and the reference must run)
                raise
            print(f"{name}: does not run here ({type(err).__name__}: {str(err).splitlines()[0][:160]}); left out")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    reference, mok = next(iter(runs)), "mok"
    print(f"\n{'step':>5} {'loss ' + reference:>18} {'loss ' + mok:>18} {'rel diff':>10}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(runs[reference][0], runs[mok][0])):
        rel = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, rel)
        print(f"{step:>5} {a:>18.5f} {b:>18.5f} {rel:>10.2e}")

    def mean_ms(times):
        kept = times[args.warmup:] or times
        return 1e3 * statistics.mean(kept)

    steps = {b: mean_ms(r[1]) for b, r in runs.items()}
    experts = {b: mean_ms(r[2]) for b, r in runs.items()}
    last = len(runs[mok][1]) - 1
    print(f"\nmean step time (steps {min(args.warmup, last)}..{last}): " + ", ".join(f"{b} {ms:.2f} ms" for b, ms in steps.items())
          + f" ({steps[reference] / steps[mok]:.2f}x {reference}'s), {tokens / steps[mok] * 1e3:,.0f} tokens/s on MoK")
    print("of which the experts modules, forward + backward: " + ", ".join(f"{b} {experts[b]:.2f} ms ({experts[b] / steps[b]:.0%})" for b in runs)
          + f" ({experts[reference] / max(experts[mok], 1e-9):.2f}x {reference}'s)")
    if device.type == "cuda":
        print("peak memory: " + ", ".join(f"{b} {r[3] / 2**30:.2f} GiB" for b, r in runs.items()))
    ok = worst <= args.tol
    print(f"largest relative loss difference {worst:.2e}: {'within' if ok else 'OUTSIDE'} tolerance {args.tol:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
