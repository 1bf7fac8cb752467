"""The decode worker: imports prompt KV and decodes in a continuous batch, streaming tokens."""
