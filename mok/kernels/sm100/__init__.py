"""Blackwell (sm_100a/sm_103a) kernels: tcgen05 + TMEM. Compile-verified here; no SM100 GPU has run them."""
