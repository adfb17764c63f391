"""Kernels for Hopper (sm_90) written in Gluon: the ``hopper`` block kernels (:mod:`.block`) and
their rotary helpers (:mod:`.rotary`). Imported only where Triton has Gluon."""
