"""python -m actors.engine --config CONFIG.toml --id e0 [--role prefill|decode|colocated]"""

import sys

from actors.base import actor_main
from actors.config import initial_roles
from actors.engine.actor import EngineActor
from bus_schemas.control import Role


def _args(parser) -> None:
    parser.add_argument("--role", choices=[r.value for r in Role], help="default: from the config's policy")


def _build(args, config, nc, clock) -> EngineActor:
    role = Role(args.role) if args.role else initial_roles(config).get(args.id, Role.COLOCATED)
    if config.engines.backend == "torch":
        from actors.engine.torch.actor import TorchEngineActor  # imports torch only when used

        return TorchEngineActor(args.id, config, nc, clock, role)
    if config.engines.backend == "vllm":
        from actors.engine.vllm.engine import require_vllm

        require_vllm()  # one line naming the extra to install
        from actors.engine.vllm.actor import VllmEngineActor  # imports vLLM only when used

        return VllmEngineActor(args.id, config, nc, clock, role)
    return EngineActor(args.id, config, nc, clock, role)


if __name__ == "__main__":
    sys.exit(actor_main("engine", _build, _args))
