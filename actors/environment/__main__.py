"""python -m actors.environment --config CONFIG.toml --id env0"""

import sys

from actors.base import actor_main
from actors.environment.actor import EnvironmentActor


def _build(args, config, nc, clock) -> EnvironmentActor:
    if config.engines.backend in ("torch", "vllm"):  # real compute (torch or vLLM engines): real tasks
        from actors.environment.real import RealEnvironmentActor  # real tokens, tool and reward

        return RealEnvironmentActor(args.id, config, nc, clock)
    return EnvironmentActor(args.id, config, nc, clock)


if __name__ == "__main__":
    sys.exit(actor_main("environment", _build))
