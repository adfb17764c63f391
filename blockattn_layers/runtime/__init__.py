"""Host-side runtime support shared by every layer: the caches of host work (:mod:`.caches`) and
the private torch and Triton APIs the package relies on (:mod:`.private_api`). Core Python and
torch only, so every layer may import it."""
