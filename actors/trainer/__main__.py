"""python -m actors.trainer --config CONFIG.toml --id trainer"""

import sys

from actors.base import actor_main
from actors.trainer.actor import TrainerActor


def _build(args, config, nc, clock) -> TrainerActor:
    if config.engines.backend in ("torch", "vllm"):  # real compute (torch or vLLM engines): real GRPO
        from actors.trainer.torch_trainer import TorchTrainerActor  # real GRPO; imports torch only when used

        return TorchTrainerActor(args.id, config, nc, clock)
    return TrainerActor(args.id, config, nc, clock)


if __name__ == "__main__":
    sys.exit(actor_main("trainer", _build))
