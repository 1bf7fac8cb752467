"""The prefill worker: computes prompts' KV, samples first tokens, leases the KV out."""
