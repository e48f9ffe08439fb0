"""Kernels of our own for one backend, each a choice its caller makes (the model imports none of them).

  cpu_matmul.py  x . w^T for weights held [out, in] on XLA's CPU backend (cpu_matmul.cc, built on first use), and
                 OutInProducts, the dense-product choice that hands it to the model for CPU decoding
"""
