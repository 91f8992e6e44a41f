"""A scheduler simulator: workloads replayed through the real Scheduler and KVCacheManager, no weights."""
