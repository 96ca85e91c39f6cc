"""Blackwell (sm_100a / sm_103a) GEMMs on tcgen05 + tensor memory, one output tile per CTA: the
grouped GEMM of the layer's forward and backward (grouped_gemm.py) and the per-expert weight
gradients (weight_grad_gemm.py), on a shared TMA + tcgen05 pipeline (tcgen05_tile.py). Compiled
and PTX-checked in CI; never run: no SM100 GPU was available to this project (see README).
"""
