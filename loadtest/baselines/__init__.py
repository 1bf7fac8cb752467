"""Peers run in the same scenarios as pdserve: transformers ``generate`` behind an
OpenAI-compatible server of ours, and llama.cpp's server when it is installed."""
