"""python -m actors.environment --config CONFIG.toml --id env0"""

import sys

from actors.base import actor_main
from actors.environment.actor import EnvironmentActor

if __name__ == "__main__":
    sys.exit(actor_main("environment", lambda args, config, nc, clock: EnvironmentActor(args.id, config, nc, clock)))
