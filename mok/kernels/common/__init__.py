"""Arch-neutral device code: schedule, flags and barriers, SwiGLU, combine."""
