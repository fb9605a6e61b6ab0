"""GRPO on finished trajectories (pure: a model, an optimizer and data in; no bus).

    advantage_i = (r_i - mean(r_group)) / (std(r_group) + eps)     over the G samples of a task
    loss = - Σ_tokens min(ρ A, clip(ρ, 1-ε, 1+ε) A) / Σ_tokens,   ρ = exp(logπ_θ(t) - logπ_rollout(t))

summed over the tokens the policy generated (observation and prompt tokens are masked out),
with log-probabilities of the tempered distribution the engines sampled from. No KL term.

Off-policy correction (async RL, `trainer.off_policy_correction`): "none" is the above, the
ratio taken against the behaviour policy that sampled the tokens. "clipped_is" is decoupled
PPO (AReaL): the ratio is clipped against the policy before this update (π_prox) and each
token is weighted by the truncated importance ratio w = min(π_prox / π_rollout, is_cap):

    loss = - Σ_tokens w · min(ρ' A, clip(ρ', 1-ε, 1+ε) A) / Σ_tokens,   ρ' = π_θ / π_prox

`min_version` (stale_policy "partial"): the generated tokens of turns whose policy version is
older are masked out of the loss (turn i's tokens are the i-th run of 1s in generated_mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bus_schemas.train import FinishedTrajectory


@dataclass(frozen=True, slots=True)
class StepStats:
    loss: float
    tokens: int  # generated tokens trained on
    trajectories: int
    mean_abs_logprob_gap: float  # |logπ_θ - logπ_rollout| before the update: ~0 when engines and trainer agree
    clipped_fraction: float  # tokens whose ratio left [1-ε, 1+ε] in the last epoch
    is_capped_tokens: int = 0  # clipped_is: tokens whose importance weight hit is_cap
    masked_tokens: int = 0  # min_version: generated tokens of too-old turns, left out


def group_advantages(rewards: list[float], groups: list[str], eps: float = 1e-6) -> list[float]:
    by_group: dict[str, list[float]] = {}
    for r, g in zip(rewards, groups):
        by_group.setdefault(g, []).append(r)
    stats = {g: (sum(rs) / len(rs), torch.tensor(rs).std(unbiased=False).item() if len(rs) > 1 else 0.0) for g, rs in by_group.items()}
    return [0.0 if stats[g][1] < eps else (r - stats[g][0]) / (stats[g][1] + eps) for r, g in zip(rewards, groups)]


def usable(t: FinishedTrajectory) -> bool:
    n = len(t.token_ids)
    return n > 1 and len(t.generated_mask) == n and len(t.logprobs) == n and any(t.generated_mask)


def token_logprobs(lm, ids: torch.Tensor, attention: torch.Tensor, temperature: float) -> torch.Tensor:
    """logπ(ids[:, t] | ids[:, :t]) for t >= 1, shape [B, T-1]."""
    logits = lm(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(2, ids[:, 1:, None])[..., 0]


def turn_mask(t: FinishedTrajectory, min_version: int) -> list[int]:
    """generated_mask with the tokens of turns older than `min_version` set to 0."""
    if min_version < 0:
        return list(t.generated_mask)
    mask, turn, previous = [], -1, 0
    for bit in t.generated_mask:
        if bit and not previous:
            turn += 1
        previous = bit
        version = t.policy_versions[turn] if 0 <= turn < len(t.policy_versions) else -1
        mask.append(1 if bit and version >= min_version else 0)
    return mask


def grpo_update(
    lm,
    optimizer,
    trajectories: list[FinishedTrajectory],
    *,
    temperature: float,
    clip_eps: float,
    epochs: int,
    pad_id: int,
    max_grad_norm: float = 1.0,
    correction: str = "none",
    is_cap: float = 2.0,
    min_version: int = -1,
) -> StepStats:
    data = [t for t in trajectories if usable(t)]
    advantages = group_advantages([t.reward for t in data], [t.task_id for t in data])
    keep = [i for i, a in enumerate(advantages) if a != 0.0]
    if not keep:
        return StepStats(0.0, 0, 0, 0.0, 0.0)
    data, advantages = [data[i] for i in keep], [advantages[i] for i in keep]
    device = next(lm.parameters()).device
    length = max(len(t.token_ids) for t in data)
    ids = torch.full((len(data), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(data), length, dtype=torch.long)
    mask = torch.zeros(len(data), length)
    old = torch.zeros(len(data), length)
    for i, t in enumerate(data):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(turn_mask(t, min_version), dtype=torch.float)
        old[i, :n] = torch.tensor(t.logprobs)
    ids, attention, mask, old = ids.to(device), attention.to(device), mask[:, 1:].to(device), old[:, 1:].to(device)
    adv = torch.tensor(advantages, device=device)[:, None]
    all_generated = sum(sum(t.generated_mask) for t in data)
    n_tokens = mask.sum()
    if n_tokens.item() == 0:  # every generated token masked (too old)
        return StepStats(0.0, 0, 0, 0.0, 0.0, 0, all_generated)
    lm.train()
    gap, clipped, loss_value = 0.0, 0.0, 0.0
    base, weight, capped = old, torch.ones_like(old), 0
    for epoch in range(epochs):
        new = token_logprobs(lm, ids, attention, temperature)
        if epoch == 0:
            gap = ((new.detach() - old).abs() * mask).sum().item() / n_tokens.item()
            if correction == "clipped_is":  # π_prox: the policy before this update (no second forward)
                base = new.detach()
                raw = torch.exp(base - old)
                weight = torch.clamp(raw, max=is_cap)
                capped = int(((raw > is_cap).float() * mask).sum().item())
        ratio = torch.exp(new - base)
        surrogate = weight * torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        loss = -(surrogate * mask).sum() / n_tokens
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), max_grad_norm)
        optimizer.step()
        loss_value = loss.item()
        clipped = ((((ratio - 1).abs() > clip_eps).float() * mask).sum() / n_tokens).item()
    lm.eval()
    return StepStats(loss_value, int(n_tokens.item()), len(data), gap, clipped, capped, all_generated - int(n_tokens.item()))
