"""Prorsa's actors: each one an OS process that talks to the others only over NATS."""
