"""Prorsa's actors: each one an OS process that talks to the others only over NATS."""

from actors.torch_extras import hide_unloadable_torch_extras

hide_unloadable_torch_extras()  # before anything imports transformers (see actors/torch_extras.py)
