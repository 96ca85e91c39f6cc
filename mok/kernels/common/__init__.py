"""Arch-neutral device code: the GEMMs' contracts, launch records and epilogue math (grouped_gemm.py,
weight_grad.py, gemm_args.py), schedule, flags and barriers, SwiGLU, combine, gathers, quantization."""
