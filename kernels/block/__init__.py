"""Block attention for blocks that fit one tile: the Triton kernels (:mod:`.fwd`, :mod:`.bwd`),
their launch plans (:mod:`.plan`) and the variants that compute them (:mod:`.variants`)."""
