"""The engine: its own process running the scheduler, the model runner and the sampler, and its clients."""
