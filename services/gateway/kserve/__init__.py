"""The KServe v2 / Triton gRPC protocol on the gateway (--kserve-port)."""
