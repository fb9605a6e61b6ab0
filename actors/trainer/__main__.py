"""python -m actors.trainer --config CONFIG.toml --id trainer"""

import sys

from actors.base import actor_main
from actors.trainer.actor import TrainerActor

if __name__ == "__main__":
    sys.exit(actor_main("trainer", lambda args, config, nc, clock: TrainerActor(args.id, config, nc, clock)))
