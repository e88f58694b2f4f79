"""Reading model files from disk: HF directories (config, safetensors shards, tokenizer)."""
