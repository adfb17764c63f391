"""Multi-tile ("jagged flash") attention for blocks over one tile and full attention: the
kernels (:mod:`.fwd`, :mod:`.bwd`) and their tile schedule and helpers (:mod:`.schedule`)."""
