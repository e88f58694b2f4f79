"""Compute backends the model calls (attention, Gated DeltaNet, routed experts), chosen once at start."""
