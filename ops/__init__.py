"""Operating Prorsa: the launcher, the embedded nats-server, exporting the event log."""
