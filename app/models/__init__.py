"""Model architectures in torch: config parsing, layers, and the Qwen3 MoE family decoder."""
