"""The block store: the shared, content-addressed KV tier (pdserve.kv.v1.BlockStoreService)."""
