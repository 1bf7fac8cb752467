"""The gateway: the public GatewayService; tokenizes, routes, relays, detokenizes."""
