"""python -m actors.forecaster --config CONFIG.toml --id forecaster"""

import sys

from actors.base import actor_main
from actors.forecaster.actor import ForecasterActor

if __name__ == "__main__":
    sys.exit(actor_main("forecaster", lambda args, config, nc, clock: ForecasterActor(args.id, config, nc, clock)))
