"""The engine actor: a continuous-batching scheduler in front of a backend, in a role
(prefill, decode or colocated) that decides which work queue it pulls from."""
