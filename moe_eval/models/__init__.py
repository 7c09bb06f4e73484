"""The models moe-eval builds itself: the tiny builtin MoE, the canary checkpoint's loader, and shape twins
of the seed models (random seeded weights at the real MoE shapes)."""
