"""Flap damping for role changes (pure): a change that undoes the one before it (split <->
colocate, grow <-> shrink) is allowed once, and starts a hold during which the next reversal
is refused; each reversal doubles the hold (at least a decision horizon), and the hold halves
every `FLAP_HALF_LIFE_HORIZONS` horizons (BGP's route-flap damping, in model seconds). Each
undone kind of change also has its least saving doubled (`margin`: ski rental's doubling,
which the evaluator applies to a move's switch cost)."""

from __future__ import annotations

from dataclasses import dataclass, field

FLAP_HALF_LIFE_HORIZONS = 6.0  # flap penalty half-life, in decision horizons [A]
REVERSES = {"split": "colocate", "colocate": "split", "grow": "shrink", "shrink": "grow"}


@dataclass(slots=True)
class FlapDamping:
    horizon_s: float  # the allocator's decision horizon: the shortest hold, and the half-life's unit
    penalty_s: float = 0.0  # the hold as the last change left it
    last_change: tuple[str, float] = ("", 0.0)  # (kind, model s) of the last change
    # by kind of change, a factor on the least saving it must show: doubled each time a change
    # of that kind is undone (the evaluator's margin on a move's switch cost)
    margin: dict[str, float] = field(default_factory=dict)

    def hold_s(self, now_s: float) -> float:
        """The hold left at `now_s`: the last penalty, halved every half-life since the change."""
        kind, at_s = self.last_change
        if not kind:
            return 0.0
        half_life_s = FLAP_HALF_LIFE_HORIZONS * self.horizon_s
        return self.penalty_s * 0.5 ** (max(0.0, now_s - at_s) / half_life_s)

    def refuses(self, kind: str, now_s: float) -> bool:
        """Whether a change of `kind` would undo the last one within its hold."""
        kind_last, at_s = self.last_change
        return REVERSES.get(kind) == kind_last and now_s - at_s < self.hold_s(now_s)

    def record(self, kind: str, now_s: float) -> None:
        """A change of `kind` was made; one that undoes the last doubles the hold, and the undone
        kind's margin."""
        penalty = self.hold_s(now_s)
        undone = self.last_change[0]
        if REVERSES.get(kind) == undone:
            penalty = max(self.horizon_s, 2.0 * penalty)
            self.margin[undone] = 2.0 * self.margin.get(undone, 1.0)
        self.penalty_s, self.last_change = penalty, (kind, now_s)
