"""Entry points that launch MoK's kernels on PyTorch tensors, one module per kernel family.

Each one validates its arguments (dtype, shape, device, layout) and raises before any launch,
then fetches its compiled kernel through the registry and cache (JIT on first call) and launches
it on the current CUDA stream. None reads device data back, so they are CUDA-graph capturable
(``raise_grid_timeouts`` reads one int; ``grid_sync_words`` synchronises once when it allocates a
device's words: call it before capture).

    rows         gather_rows, gather_rows_pair, gather_fp8_rows, combine
    quantize     quantize_mxfp8, quantize_mxfp8_columns, dequantize_mxfp8, quantize_fp8_rows, quantize_fp8_columns, dequantize_fp8_rows,
                 quantize_fp8_weights
    schedule     device_schedule
    gemm         grouped_gemm, grouped_gemm_scatter, swiglu_backward_gemm   (bf16 or MXFP8 operands)
    weight_grads weight_grad (bf16, MXFP8 or FP8 block-scaled operands), router_grad
    bias_grads   expert_column_sums, bias_router_pieces   (the expert biases' gradients)
    one_launch   scheduled_expert_mlp, grid_sync_words, raise_grid_timeouts
"""

from .bias_grads import bias_router_pieces, expert_column_sums
from .gemm import grouped_gemm, grouped_gemm_scatter, swiglu_backward_gemm
from .one_launch import grid_sync_words, raise_grid_timeouts, scheduled_expert_mlp
from .quantize import dequantize_fp8_rows, dequantize_mxfp8, quantize_fp8_columns, quantize_fp8_rows, quantize_fp8_weights, quantize_mxfp8, quantize_mxfp8_columns
from .rows import combine, gather_fp8_rows, gather_rows, gather_rows_pair
from .schedule import device_schedule
from .weight_grads import router_grad, weight_grad

__all__ = [
    "bias_router_pieces", "combine", "dequantize_fp8_rows", "dequantize_mxfp8", "device_schedule", "expert_column_sums", "gather_rows",
    "gather_fp8_rows", "gather_rows_pair", "grid_sync_words", "grouped_gemm", "grouped_gemm_scatter", "quantize_fp8_columns", "quantize_fp8_rows",
    "quantize_fp8_weights", "quantize_mxfp8", "quantize_mxfp8_columns", "raise_grid_timeouts", "router_grad", "scheduled_expert_mlp",
    "swiglu_backward_gemm", "weight_grad",
]
