"""Quantized weights: formats, packed tensors, the layers over them, GGUF loading."""
