"""python -m actors.allocator --config CONFIG.toml --id allocator"""

import sys

from actors.allocator.actor import AllocatorActor
from actors.base import actor_main

if __name__ == "__main__":
    sys.exit(actor_main("allocator", lambda args, config, nc, clock: AllocatorActor(args.id, config, nc, clock)))
