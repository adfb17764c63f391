"""What every kernel family shares: launches (:mod:`.launch`), launch-side facts (:mod:`.meta`),
the sync-free block schedule (:mod:`.schedule`), and the ``@triton.jit`` helpers for row tiles
(:mod:`.tiles`) and rotary embeddings (:mod:`.rotary`, the Triton home of the rotary math)."""
