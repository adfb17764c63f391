"""Kernels that ``auto`` never runs, kept with their tests and compile checks: the persistent,
warp-specialized sm_90 block kernels (:mod:`.sm90_ws`, the ``hopper_ws`` variant, forced only),
the starting point of warp-specialized Blackwell kernels."""
