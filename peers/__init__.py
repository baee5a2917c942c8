"""Peers: identity and DHT records, the DHT layer, gRPC transport helpers, link shaping and probes."""
