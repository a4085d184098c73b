"""The RL losses in plain torch: masked categorical, REINFORCE, V-trace.

TorchRL has all three, but no TorchRL release installs beside this project's stack: the
current one (0.14) requires tensordict < 0.15 (TorchRec's tensordict here is 0.15.3), and
the last one that accepts tensordict 0.15 (0.7.2) was built for torch 2.6, so its C++
extension does not load under torch 2.13. What we need is about sixty lines.
"""

from __future__ import annotations

import torch

NEG = -1e9  # a masked logit (finite, so a row whose mask is all False gives no NaN)


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π over the last axis, restricted to `mask` (log π = NEG outside it)."""
    return torch.log_softmax(logits.masked_fill(~mask, NEG), dim=-1).masked_fill(~mask, NEG)


def masked_entropy(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy of a masked categorical from its log-probabilities (0 outside the mask)."""
    p = logp.exp()
    return -(torch.where(mask, p * logp, torch.zeros_like(logp))).sum(-1)


def normalised_advantages(rewards: torch.Tensor, groups: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Rewards z-scored over the batch, or within each group (several rollouts of one task:
    a per-task baseline) when `groups` gives each episode's group id."""
    if groups is None:
        return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)
    out = torch.empty_like(rewards)
    for g in torch.unique(groups):
        sel = groups == g
        r = rewards[sel]
        out[sel] = (r - r.mean()) / (r.std(unbiased=False) + eps) if r.numel() > 1 else torch.zeros_like(r)
    return out


def reinforce_loss(logp_actions: torch.Tensor, entropy: torch.Tensor, steps: torch.Tensor, advantages: torch.Tensor,
                   entropy_coef: float) -> torch.Tensor:
    """REINFORCE with an entropy bonus.

    Args:
        logp_actions: [B, T] log π(a_t | s_t) of the taken actions.
        entropy: [B, T] policy entropy per step.
        steps: [B, T] True where step t of episode b happened (episodes differ in length).
        advantages: [B] one (normalised) return per episode.
    """
    w = steps.float()
    pg = -(advantages[:, None].detach() * logp_actions * w).sum() / w.shape[0]
    return pg - entropy_coef * (entropy * w).sum() / w.sum().clamp_min(1.0)


def vtrace(behaviour_logp: torch.Tensor, target_logp: torch.Tensor, rewards: torch.Tensor, values: torch.Tensor,
           steps: torch.Tensor, gamma: float = 1.0, rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, IMPALA).

    All inputs [B, T]; `steps` marks real steps (an episode ends at its last True; the value
    after it is 0). Returns (v_s targets, ρ_s (r_s + γ v_{s+1} - V(x_s))), both detached.
    """
    with torch.no_grad():
        w = steps.float()
        rho = torch.exp(target_logp - behaviour_logp) * w
        rho_clip = rho.clamp(max=rho_bar)
        c = rho.clamp(max=c_bar)
        next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1) * torch.cat(
            [w[:, 1:], torch.zeros_like(w[:, :1])], dim=1)
        deltas = rho_clip * (rewards + gamma * next_values - values) * w
        acc = torch.zeros_like(values[:, 0])
        diffs = torch.zeros_like(values)
        for t in range(values.shape[1] - 1, -1, -1):
            acc = deltas[:, t] + gamma * c[:, t] * acc * (w[:, t + 1] if t + 1 < values.shape[1] else 0.0)
            diffs[:, t] = acc
        vs = (values + diffs) * w
        next_vs = torch.cat([vs[:, 1:], torch.zeros_like(vs[:, :1])], dim=1)
        adv = rho_clip * (rewards + gamma * next_vs - values) * w
    return vs, adv
