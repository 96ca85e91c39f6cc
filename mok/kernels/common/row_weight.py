"""The router weight a buffer row's gradient is scaled by (arch-neutral: both SwiGLU backwards read it)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def row_router_weight(row, num_rows, m_row_token, m_row_slot, m_topk_w, topk: cutlass.Constexpr, unit_scale: cutlass.Constexpr):
    """topk_w[token, slot] of buffer row ``row`` (the schedule's row_token / row_slot); 1 for the
    shared expert (``unit_scale``, or a schedule's shared-prefix row: slot ``topk``), 0 for padding
    rows and rows past ``num_rows``."""
    s = cutlass.Float32(0.0)
    if row < num_rows:
        if cutlass.const_expr(unit_scale):
            s = cutlass.Float32(1.0)
        else:
            token = m_row_token[row]
            if token >= 0:
                slot = m_row_slot[row]
                s = cutlass.Float32(1.0)
                if slot < topk:
                    s = m_topk_w[token * topk + slot]
    return s
