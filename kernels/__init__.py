"""GPU kernels (Triton) and compute-path dispatch for NVFP4 linears."""
