"""The vllm backend: a vLLM v1 engine in each engine actor, KV between engines over NATS.

* `engine.py` — `VllmEngine`: one in-process `AsyncLLM` built from `[vllm]`, token ids in,
  token ids and logprobs out, input checked before it reaches vLLM;
* `connector.py` — `ProrsaNatsConnector`, the `KVConnectorBase_V1` vLLM loads through
  `kv_connector_module_path`: holds prefilled KV, loads it into another engine's blocks;
* `kvbus.py` — the connector's NATS side (its own thread and connection inside vLLM's
  worker process): held KV with TTLs, chunked CRC-32C replies, fetches, counters;
* `site/sitecustomize.py` — first on the PYTHONPATH of the processes vLLM starts
  (`actors/torch_extras.py`).

Importing this package does not import vLLM; `engine.require_vllm()` names the extra to install.
"""
