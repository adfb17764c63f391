"""Triton kernels and their launchers (installed as ``blockattn_layers.kernels``): no autograd, no torchrec."""
