"""Gluon kernels for Blackwell (sm_100): the warp-specialized block-attention kernels (``block``)."""
