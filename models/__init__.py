"""Flax NNX decoders (Llama family) and the Hugging Face checkpoint loader."""
