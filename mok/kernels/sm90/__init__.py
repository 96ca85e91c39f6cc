"""Hopper (sm_90a) kernels: WGMMA + TMA, warp-specialised and persistent."""
