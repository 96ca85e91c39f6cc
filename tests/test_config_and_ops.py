"""Static config validation and the op's checks that run before any GPU is touched."""

import pytest
import torch

from mok import MoKConfig, combine


def test_config_derived_values():
    c = MoKConfig(hidden=7168, intermediate=2048, num_experts=256, topk=8, shared_intermediate=2048, ep_size=8)
    assert c.experts_per_rank == 32 and c.has_shared_expert
    assert hash(c) == hash(MoKConfig(**c.as_dict()))


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(hidden=100), ValueError, "hidden: expected a multiple of 8"),
        (dict(intermediate=0), ValueError, "intermediate: expected an int >= 1, got 0"),
        (dict(num_experts=4.0), TypeError, "num_experts: expected an int, got float"),
        (dict(topk=300), ValueError, "topk: expected at most num_experts=256, got 300"),
        (dict(ep_size=3), ValueError, "num_experts: expected a multiple of ep_size=3, got 256"),
        (dict(shared_intermediate=-1), ValueError, "shared_intermediate: expected an int >= 1"),
        (dict(precision="fp16"), ValueError, "precision: expected one of ('bf16',), got 'fp16'"),
        (dict(topk=True), TypeError, "topk: expected an int, got bool"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, words):
    args = dict(hidden=7168, intermediate=2048, num_experts=256, topk=8)
    args.update(kwargs)
    with pytest.raises(error) as info:
        MoKConfig(**args)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "args,error,words",
    [
        ((torch.zeros(4, 2, 16, dtype=torch.bfloat16), torch.rand(4, 2)), ValueError, "y: expected a CUDA tensor, got one on cpu"),
        ((torch.zeros(4, 2, 16, dtype=torch.float16), torch.rand(4, 2)), TypeError, "y: expected dtype bfloat16, got float16"),
        ((torch.zeros(4, 16, dtype=torch.bfloat16), torch.rand(4, 2)), ValueError, "y: expected a 3-d tensor"),
        (("y", torch.rand(4, 2)), TypeError, "y: expected a torch.Tensor, got str"),
    ],
)
def test_combine_rejects_bad_input_before_launch(args, error, words):
    with pytest.raises(error) as info:
        combine(*args)
    assert words in str(info.value)
