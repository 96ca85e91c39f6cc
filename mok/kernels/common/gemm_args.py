"""The tensors the GEMMs' ``__call__`` builds from their launch arguments (either arch; the records: records.py)."""

from __future__ import annotations

import cutlass.cute as cute



def expert_weights(
    ptr: cute.Pointer, n: int, k: int, num_experts, b_major: str, expert_stride: int | None = None, row_stride: int | None = None
) -> cute.Tensor:
    """One weight matrix per expert as (N, K, E): K-major [E, N, K] or N-major [E, K, N] in memory,
    the experts ``expert_stride`` elements apart (default N·K: packed; more for the halves of one
    [E, 2I, H] gate/up tensor), the rows of each (along N when K-major, along K when N-major)
    ``row_stride`` apart (default: packed; twice that for the even or odd rows of one [E, 2I, H]
    tensor, gpt-oss's interleaved gate and up)."""
    expert_stride = n * k if expert_stride is None else expert_stride
    if b_major == "k":
        stride = (k if row_stride is None else row_stride, 1, expert_stride)
    else:
        stride = (1, n if row_stride is None else row_stride, expert_stride)
    return cute.make_tensor(ptr, cute.make_layout((n, k, num_experts), stride=stride))


def halves(ptr: cute.Pointer, rows, width: int, count: int) -> cute.Tensor:
    """Rows of ``count`` halves side by side, [R, count·width] in memory, as (R, width, count): each
    half bounded at its own width, so a partial last column tile of one half stops there (TMA
    clips and zero-fills per mode) instead of reaching into the next (h = [gate | up], dh)."""
    return cute.make_tensor(ptr, cute.make_layout((rows, width, count), stride=(count * width, 1, width)))


def grouped_row_tensors(ptrs: tuple, num_rows, num_tokens, n: int, c_halves: int, partial_cols: int, topk: int) -> tuple:
    """The grouped GEMM's row-indexed tensors from ``ptrs`` = (C, h, a_scaled, partial, row_token,
    row_slot, topk_w): C [R, c_halves·N] as (R, N, c_halves), h [R, 2N] as (R, N, 2), a_scaled [R, N],
    partial [R, partial_cols], row_token and row_slot [R], topk_w [T·k] (the arguments of variants
    that do not use one are placeholders)."""
    c_ptr, h_ptr, a_scaled_ptr, partial_ptr, row_token_ptr, row_slot_ptr, topk_w_ptr = ptrs
    return (
        halves(c_ptr, num_rows, n, c_halves),
        halves(h_ptr, num_rows, n, 2),
        cute.make_tensor(a_scaled_ptr, cute.make_layout((num_rows, n), stride=(n, 1))),
        cute.make_tensor(partial_ptr, cute.make_layout((num_rows, partial_cols), stride=(partial_cols, 1))),
        cute.make_tensor(row_token_ptr, cute.make_layout((num_rows,))),
        cute.make_tensor(row_slot_ptr, cute.make_layout((num_rows,))),
        cute.make_tensor(topk_w_ptr, cute.make_layout((num_tokens * topk,))),
    )


def weight_grad_output(
    out_ptr: cute.Pointer, m: int, n: int, num_experts, half_stride, split_out: bool, interleaved: bool = False
) -> cute.Tensor:
    """The weight gradient as (M, N, E), or with ``split_out`` as (M/2, N, E, 2): two [E, M/2, N]
    tensors ``half_stride`` elements apart, or with ``interleaved`` the even and odd rows of one
    [E, M, N] tensor (the first half's row j its row 2j; ``half_stride`` N)."""
    if split_out and interleaved:
        return cute.make_tensor(out_ptr, cute.make_layout((m // 2, n, num_experts, 2), stride=(2 * n, 1, m * n, half_stride)))
    if split_out:
        return cute.make_tensor(out_ptr, cute.make_layout((m // 2, n, num_experts, 2), stride=(n, 1, m // 2 * n, half_stride)))
    return cute.make_tensor(out_ptr, cute.make_layout((m, n, num_experts), stride=(n, 1, m * n)))


def expert_row_ranges(offsets_ptr: cute.Pointer, counts_ptr: cute.Pointer, counted, num_experts) -> tuple:
    """(offsets [E + 1], counts [E], counted): where each expert's rows start and end (common/weight_grad.py)."""
    m_off = cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,)))
    return m_off, cute.make_tensor(counts_ptr, cute.make_layout((num_experts,))), counted
