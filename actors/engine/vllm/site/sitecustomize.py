"""Put first on PYTHONPATH for the processes vLLM starts (engine core, workers, its model
registry check), so they hide the same unloadable torch extras as the actor that started
them (`actors.torch_extras`)."""

from actors.torch_extras import hide_unloadable_torch_extras

hide_unloadable_torch_extras()
