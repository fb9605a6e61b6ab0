"""Environments that ship with Prorsa, by task family (each implements `interface.Environment`).

`calc` learns on the tiny model in a minute or two; `code` is a miniature SWE family: the
agent writes Python that runs in a sandbox (`actors/environment/sandbox.py`), and tests decide
the reward. `environments.entrypoint` runs a user's class instead, for every family.
"""

from __future__ import annotations

BUILTIN: dict[str, str] = {
    "calc": "actors.environment.envs.calc:CalcEnvironment",
    "code": "actors.environment.envs.code:CodeEnvironment",
}


def entrypoint_for(family: str, entrypoint: str = "") -> str | None:
    """The class that runs `family`: the configured entrypoint, else the built-in one (None: no such family)."""
    return entrypoint or BUILTIN.get(family)
