"""The OpenAI-compatible HTTP front door of the gateway (issue 16): request models in
pydantic (models.py) and their mapping onto the gateway's own GenerateRequest, so an HTTP
request takes the same path as a gRPC one (convert.py), with OpenAI's error shape."""
