"""Runtime around the kernels: target arch, compiled-kernel cache, offline precompilation."""
