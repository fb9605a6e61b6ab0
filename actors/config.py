"""The run configuration as a run loads it: the schema (``actors.config_schema``, a leaf)
with the checks and the cost model that need other packages' registries.

``load_config`` reads a file into this module's ``Config``, whose sections also check that
the cost-model preset and links exist and fit the layout (``actors.engine.emulated.costmodel``),
that every task family has a profile (``actors.environment.workloads``) and that the
forecaster's model is registered (``forecasting.models``); ``EngineSection.cost_preset``
gives the cost model an engine runs with in a role; a `workload.trace` is read and checked
against the trainer's shape (``actors.environment.trace``). Every schema name is re-exported, so
``from actors.config import ...`` keeps working; a module that needs only the shape of a
config imports ``actors.config_schema`` and none of these packages.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from actors import config_schema as schema
from actors.config_schema import (
    DYNAMIC_POLICIES,
    POLICIES,
    AllocatorSection,
    BusSection,
    ConfigError,
    EnvironmentSection,
    FamilyOverride,
    LayoutSection,
    ModelSection,
    Policy,
    RunSection,
    TrainerSection,
    VllmSection,
    WorkloadPhase,
    initial_roles,
    policy_label,
    with_policy,
)
from actors.engine.emulated.costmodel import LINKS, PRESETS, CostPreset, Layout, scaled, with_layout, with_lockstep
from actors.environment.trace import ReplaySchedule
from actors.environment.workloads import PROFILES  # profiles live with the environment
from bus_schemas.control import Role
from forecasting.models import REGISTRY  # the registry lives with the models

__all__ = [
    "DYNAMIC_POLICIES",
    "POLICIES",
    "AllocatorSection",
    "BusSection",
    "Config",
    "ConfigError",
    "EngineSection",
    "EnvironmentSection",
    "FamilyOverride",
    "ForecasterSection",
    "LayoutSection",
    "ModelSection",
    "Policy",
    "RunSection",
    "TrainerSection",
    "VllmSection",
    "WorkloadPhase",
    "WorkloadSection",
    "initial_roles",
    "load_config",
    "policy_label",
    "with_policy",
]


def _known(names) -> str:
    return ", ".join(sorted(names))


class EngineSection(schema.EngineSection):
    """The schema's engine section, checked against the cost model's presets and links."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_store_link not in LINKS:
            raise ValueError(f"unknown engines.kv_store_link {self.kv_store_link!r} (known: {_known(LINKS)})")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown engines.preset {self.preset!r} (known: {_known(PRESETS)})")
        if self.link not in LINKS:
            raise ValueError(f"unknown engines.link {self.link!r} (known: {_known(LINKS)})")
        for role in Role:
            self.cost_preset(role)  # a layout the model does not fit raises here, naming it
        if not self.truth.exact:
            if self.backend != "emulated":
                raise ValueError(f"engines.truth applies to emulated engines only ({self.backend} engines run their own)")
            if self.truth.preset and self.truth.preset not in PRESETS:
                raise ValueError(f"unknown engines.truth.preset {self.truth.preset!r} (known: {_known(PRESETS)})")
            for role in Role:
                self.truth_preset(role)

    @property
    def decode_lockstep(self) -> bool:
        """Decode engines run SGLang's prefill-first lockstep over several DP-attention ranks:
        one rank's prefill chunk holds every rank's decodes for its step."""
        decode = self.cost_preset(Role.DECODE)
        return decode.dp_ranks > 1 and decode.dp_sync == "sglang"

    def engine_presets(self, role: Role, engine_id: str) -> tuple[CostPreset, CostPreset | None]:
        """(the cost model emulated engine `engine_id` runs in `role`, the one it is priced
        with where that differs: `engines.truth`; else None)."""
        return self.truth_preset(role, engine_id), None if self.truth.exact else self.cost_preset(role)

    def truth_preset(self, role: Role, engine_id: str = "") -> CostPreset:
        """The cost model an emulated engine in `role` runs (`engines.truth`): `cost_preset`
        where the truth is exact; `engine_id` draws that engine's own spread."""
        truth = self.truth
        if truth.exact:
            return self.cost_preset(role)
        try:
            base = msgspec.structs.replace(
                self,
                preset=truth.preset or self.preset,
                lockstep_constants=truth.lockstep_constants or self.lockstep_constants,
                truth=schema.EngineTruth(),
            )
            preset = base.cost_preset(role)
        except ValueError as err:
            raise ValueError(f"engines.truth: {err}") from None
        own = 1.0
        if truth.spread and engine_id:
            own = random.Random(f"truth:{engine_id}").uniform(1.0 - truth.spread, 1.0 + truth.spread)
        return scaled(preset, truth.prefill * own, truth.decode * own, truth.kv)

    def cost_preset(self, role: Role) -> CostPreset:
        """The cost-model preset an engine in `role` runs with (its layout and the DP-attention
        lockstep mode applied)."""
        layout = self.layout_for(role)
        if (layout.tp, layout.dp, layout.ep) == (1, 1, 1):  # the preset's own layout
            preset = PRESETS[self.preset]
        else:
            try:
                preset = with_layout(self.preset, Layout(layout.tp, layout.dp, layout.ep))
            except ValueError as err:
                raise ValueError(f"engines layout for {role.value}: {err}") from None
        return with_lockstep(preset, self.dp_sync, self.mixed_chunk, self.lockstep_constants)


class WorkloadSection(schema.WorkloadSection):
    """The schema's workload section, a trace's path made absolute (relative to the working
    directory), so every actor reads the same file. Its task families are checked by `Config`."""

    def __post_init__(self) -> None:
        if self.trace:
            self.trace = str(Path(self.trace).expanduser().absolute())
        super().__post_init__()


class ForecasterSection(schema.ForecasterSection):
    """The schema's forecaster section, its model checked against the registry and its prior
    log found (a run's folder stands for its events.parquet; the path made absolute)."""

    def __post_init__(self) -> None:
        if self.model not in REGISTRY:
            raise ValueError(f"unknown forecaster.model {self.model!r} (known: {_known(REGISTRY)})")
        if self.prior_log:
            path = Path(self.prior_log).expanduser().absolute()
            path = path / "events.parquet" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"forecaster.prior_log = {self.prior_log!r}: no event log there (a run's folder or its events.parquet)")
            self.prior_log = str(path)
        super().__post_init__()


class Config(schema.Config):
    """The schema's config with the checked sections above."""

    engines: EngineSection = msgspec.field(default_factory=EngineSection)
    workload: WorkloadSection = msgspec.field(default_factory=WorkloadSection)
    forecaster: ForecasterSection = msgspec.field(default_factory=ForecasterSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        # every family has a modelled profile, but where a user's environment or an outside
        # harness runs every trajectory (real backends, environments.entrypoint or the
        # gateway): there a family is only a name
        user_families = (self.environments.entrypoint or self.gateway.enabled) and self.engines.backend != "emulated"
        for family in () if user_families else self.workload.families():
            if family not in PROFILES:
                raise ValueError(f"unknown task family {family!r} (known: {_known(PROFILES)})")
        if self.workload.trace:  # read and checked now: a trace that cannot fill the run fails before anything starts
            if self.engines.backend != "emulated":
                raise ValueError(
                    f"workload.trace replays recorded trajectories on the emulated backend only (engines.backend = {self.engines.backend!r})"
                )
            ReplaySchedule.of(self)


def load_config(path: str | Path) -> Config:
    """Read and check a TOML (or JSON) config; raise ConfigError naming the file and what is wrong."""
    return schema.parse_config(path, Config)
