"""Text side of the engine: tokenizer, chat template, tiny tokenizer builder."""
