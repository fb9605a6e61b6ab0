"""The torch backend: a Hugging Face causal LM run for real, KV tensors handed over NATS.

* `model.py` — building / loading the model and tokenizer, weights as bytes, checksums;
* `kv.py` — KV buffers, the prefix cache and the chunked wire format of a hand-off;
* `backend.py` — `TorchBackend`, which runs a planned step (prefill chunks, decode batch);
* `actor.py` — `TorchEngineActor`, the engine actor with real KV serving and fetching.

Importing this package imports torch; emulated runs never do.
"""
