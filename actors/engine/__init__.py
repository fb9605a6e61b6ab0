"""The engine actor: a continuous-batching scheduler in front of a backend, in a role
(prefill, decode or colocated) that decides which work queue it pulls from.

Where things are:
* `core.py` — the scheduler core (pure): admission, chunked prefill, decode runs, the prefix
  cache, preemption, held KV;
* `actor.py` — the bus adapter: pulls work by role, runs steps, publishes lifecycle events;
* `commands.py` — role commands and the switch protocol; `handoff.py` — KV hand-off;
* `backend.py` — the backend interface, one step at a time;
* `emulated/` — the calibrated cost model and the backend that waits its times;
* `torch/` — a real model on torch, real KV over NATS.
"""
