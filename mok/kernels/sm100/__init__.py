"""Blackwell (sm_100a/sm_103a) GEMMs on tcgen05 + TMEM: none written yet, so the fused layer
raises on SM100. The arch-neutral kernels of mok/kernels/common compile for sm_100a (their PTX is
checked in CI); no SM100 GPU has run anything here."""
