"""A stand-in for the CUDA plugin's version module, so a CPU-only jaxlib can lower cuDNN attention (see _versions)."""
