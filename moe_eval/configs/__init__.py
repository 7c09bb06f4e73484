"""Which configs run, where: the config schema, the hardware lists and shards, baselines, GPUs and cores."""
