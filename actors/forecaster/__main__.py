"""python -m actors.forecaster --config CONFIG.toml --id forecaster"""

import sys

from threadpoolctl import threadpool_limits

from actors.base import actor_main
from actors.forecaster.actor import ForecasterActor

if __name__ == "__main__":
    threadpool_limits(limits=1, user_api="blas")  # small matrices: more BLAS threads only spin (runners/simulate.py)
    sys.exit(actor_main("forecaster", lambda args, config, nc, clock: ForecasterActor(args.id, config, nc, clock)))
