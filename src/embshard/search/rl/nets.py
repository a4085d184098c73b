"""The networks of DreamShard and AutoShard (torch modules; Lightning wraps them in `modules`).

Every network that sees devices scores ONE device from that device's own inputs (plus, where
noted, an element-wise max over devices), with weights shared by all devices, and every
network that sees tables encodes ONE table and sums: so any number of tables and devices
goes through the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

#: The three per-device costs DreamShard's heads predict, mapped onto what the hardware
#: evaluator measures: fused forward+backward kernel, forward all-to-all (including the wait
#: for the slowest device), backward all-to-all.
HEADS = ("compute", "forward_comm", "backward_comm")


class MLP(nn.Sequential):
    """Linear and ReLU layers (the state-dict keys of nn.Sequential), run without a module call
    per layer: planning runs thousands of small forwards, where that call is most of the time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = nn.functional.linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else torch.relu(x)
        return x


def mlp(sizes: Sequence[int], relu_last: bool = False) -> MLP:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or relu_last:
            layers.append(nn.ReLU())
    return MLP(*layers)


def _zero_linear(width: int) -> nn.Linear:
    layer = nn.Linear(width, 1)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def log1p_ms(y: torch.Tensor) -> torch.Tensor:
    """A head's output is log(1 + ms); this turns it into ms (>= 0)."""
    return torch.expm1(y.clamp(min=0.0, max=20.0))


class ShardEncoder(nn.Module):
    """A per-table encoder (features → hidden → out, ReLU) whose sum over a shard's tables
    describes the shard.

    With `additive`, one more column holds the table's own compute estimate (ms, >= 0), so a
    shard's sum also carries the sum of its tables' costs, and `compute_log` predicts the
    shard's compute as that sum times a bounded interaction factor (e^±1) from the rest of
    the encoding. That extrapolates to shards of more tables than training saw, where an
    unbounded MLP on the sum (the reference's head; `additive: false`) does not.
    """

    def __init__(self, num_features: int, hidden: int = 128, out: int = 32, additive: bool = True,
                 volume: tuple[int, float, float] | None = None):
        super().__init__()
        self.mlp = mlp([num_features, hidden, out], relu_last=True)
        self.own = nn.Linear(out, 1) if additive else None
        self.out = out
        #: (input column, its mean, its std): the table's pooled output MB at the task's batch,
        #: un-normalised into the last column, so a device's sum is its all-to-all payload
        self.volume = volume
        self.width = out + (1 if additive else 0) + (1 if volume is not None else 0)  # columns of an encoding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.mlp(x)
        parts = [e]
        if self.own is not None:
            parts.append(nn.functional.softplus(self.own(e)))
        if self.volume is not None:
            col, mean, std = self.volume
            parts.append((x[..., col : col + 1] * std + mean).clamp_min(0.0))
        return torch.cat(parts, dim=-1) if len(parts) > 1 else e

    def features(self, sums: torch.Tensor) -> torch.Tensor:
        """What heads read from a sum: the encoding part, and log(1 + summed own cost) (and
        log(1 + summed output MB))."""
        if self.width == self.out:
            return sums
        return torch.cat([sums[..., : self.out], torch.log1p(sums[..., self.out :])], dim=-1)

    def volume_mb(self, sums: torch.Tensor) -> torch.Tensor:
        """[...] the summed pooled-output MB of shards (the volume column)."""
        return sums[..., -1]

    def compute_log(self, head: nn.Module, sums: torch.Tensor, counts: torch.Tensor,
                    feats: torch.Tensor | None = None) -> torch.Tensor:
        """[...] log(1 + compute ms) of shards from sums [..., width] and table counts [...]
        (an empty shard computes nothing); `feats`: `features(sums)` where the caller has them."""
        if self.own is None and self.volume is None:
            y = head(sums).squeeze(-1)
        else:
            feats = self.features(sums) if feats is None else feats
            y = head(feats).squeeze(-1)
            if self.own is not None:
                y = torch.log1p(sums[..., self.out] * torch.exp(torch.tanh(y)))
        return y * (counts > 0)


class DreamShardCostNet(nn.Module):
    """DreamShard's cost network.

    A table encoder is summed over each device's tables (`ShardEncoder`). Per-device heads
    predict log(1 + ms) of compute (from the device's sum), forward and backward comm (from
    the sum and the element-wise max of all devices' sums: an all-to-all's time, and the
    forward wait, depend on the other devices too). An overall head on the element-wise MAX
    over devices of the sums predicts the plan cost.
    """

    def __init__(self, num_features: int, hidden: int = 128, out: int = 32, head_hidden: int = 64, additive: bool = True,
                 structured_comm: bool = False, volume: tuple[int, float, float] | None = None):
        super().__init__()
        if structured_comm and volume is None:
            raise ValueError("structured_comm needs the volume column (the input column of pooled-output MB)")
        self.structured_comm = bool(structured_comm)
        self.encoder = ShardEncoder(num_features, hidden, out, additive, volume if structured_comm else None)
        w = self.encoder.width
        self.compute = mlp([w, head_hidden, 1])
        comm_in = 2 * w + (len(COMM_CONTEXT) if structured_comm else 0)
        self.forward_comm = mlp([comm_in, head_hidden, 1])
        self.backward_comm = mlp([comm_in, head_hidden, 1])
        self.overall = mlp([w, head_hidden, 1])
        if structured_comm:  # ms per MB moved and a per-step constant (log), forward and backward
            self.comm_rate = nn.Parameter(torch.full((2,), math.log(0.8)))
            self.comm_base = nn.Parameter(torch.full((2,), math.log(0.5)))
        self.width = w

    def device_log(self, sums: torch.Tensor, counts: torch.Tensor, device_mask: torch.Tensor | None = None,
                   max_sums: torch.Tensor | None = None, task: "TaskContext | None" = None) -> torch.Tensor:
        """[..., D, 3] raw head outputs, log(1 + ms) of compute, forward comm, backward comm,
        from per-device encoding sums [..., D, E] and table counts [..., D] (an empty device
        computes nothing); `device_mask` [..., D] marks real devices when D is padded.
        `max_sums` [..., E]: the element-wise max of the sums over ALL the task's devices, when
        `sums` holds only some of them (the comm heads' context is taken from it); `task`: the
        same for the structured comm heads (total payload, device count, slowest compute);
        `max_sums` [..., D, E] gives each device its own context."""
        feats = self.encoder.features(sums)
        if max_sums is None:
            ctx = self.context(feats, device_mask)
        else:  # features are monotone in the sums: the max of the features is the features of the max
            ctx = self.encoder.features(max_sums)
        if ctx.dim() < feats.dim():
            ctx = ctx.unsqueeze(-2)
        ctx = ctx.expand_as(feats)
        both = torch.cat([feats, ctx], dim=-1)
        compute = self.encoder.compute_log(self.compute, sums, counts, feats)
        if self.structured_comm:
            return self._structured(sums, both, compute, device_mask, task)
        return torch.stack([compute, self.forward_comm(both).squeeze(-1), self.backward_comm(both).squeeze(-1)], dim=-1)

    def _structured(self, sums: torch.Tensor, both: torch.Tensor, compute: torch.Tensor,
                    device_mask: torch.Tensor | None, task: "TaskContext | None") -> torch.Tensor:
        """Comm as the all-to-all pays it: each device's payload in MB (what it sends and
        receives, from its own and the task's pooled outputs, at any device count) times a
        learned rate the heads bend by at most e^±2 from what the device and the task look
        like (device count included), plus a constant; forward comm adds the wait for the
        slowest device's compute. So comm extrapolates in devices and tables as the volume does."""
        out_d = self.encoder.volume_mb(sums)
        c_ms = log1p_ms(compute)
        if task is None:  # every device is here
            m = torch.ones_like(out_d, dtype=torch.bool) if device_mask is None else device_mask
            total = (out_d * m).sum(-1, keepdim=True)
            d = m.sum(-1, keepdim=True).to(out_d.dtype)
            slowest = c_ms.masked_fill(~m, 0.0).max(-1, keepdim=True).values
        else:
            total, d, slowest = task.total_mb.unsqueeze(-1), task.devices.unsqueeze(-1), task.slowest_ms.unsqueeze(-1)
            slowest = torch.maximum(slowest, c_ms)
        volume, extra = self._payload(out_d, total, d)
        x = torch.cat([both, extra], dim=-1)
        raw = torch.stack([self.forward_comm(x).squeeze(-1), self.backward_comm(x).squeeze(-1)], dim=-1)
        return self._comm_log(raw, volume, d, slowest, c_ms, compute)

    @staticmethod
    def _payload(out_d: torch.Tensor, total: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each device's all-to-all payload MB, the comm heads' extra inputs `COMM_CONTEXT`)."""
        volume = (out_d * (d - 1) + (total - out_d)).clamp_min(0.0) / d.clamp_min(1.0)
        extra = torch.stack(torch.broadcast_tensors(torch.log1p(volume), torch.log(d.clamp_min(1.0)),
                                                    torch.log1p(total)), dim=-1)
        return volume, extra

    def _comm_log(self, raw: torch.Tensor, volume: torch.Tensor, d: torch.Tensor, slowest: torch.Tensor,
                  c_ms: torch.Tensor, compute: torch.Tensor) -> torch.Tensor:
        """[..., 3] log(1 + ms) of compute and the structured comm from the comm heads' raw
        outputs [..., 2] (forward, backward)."""
        many = (d > 1).to(volume.dtype)
        rate, base = self.comm_rate.exp(), self.comm_base.exp()
        bw = many * (volume * rate[1] * torch.exp(2.0 * torch.tanh(raw[..., 1] / 2.0)) + base[1])
        fw = many * (volume * rate[0] * torch.exp(2.0 * torch.tanh(raw[..., 0] / 2.0)) + base[0])
        fw = fw + (slowest - c_ms).detach().clamp_min(0.0)
        return torch.stack([compute, torch.log1p(fw), torch.log1p(bw)], dim=-1)

    def placement_costs(self, sums: torch.Tensor, counts: torch.Tensor, table: torch.Tensor, max_sums: torch.Tensor,
                        task: "TaskContext | None" = None, taken: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a placement step needs of M candidate devices, in one pass of the heads:
        (now, with, taken), [K, M, 3] predicted ms each.

        `now`: the devices as they are (sums [K, M, E], counts [K, M]; `max_sums` [K, E] the
        element-wise max over ALL the task's devices, `task` their context for structured comm
        heads). `with`: each device were it to take the table (encoding `table` [E]), the
        context's max and the task's payload grown by the table once, as `device_costs` on
        [sums + table, counts + 1, max_sums + table] gives. `taken` (when asked): the same
        but the context's max grown by that device only, `torch.maximum(max_sums, sums + table)`:
        the device's costs once the table is placed there.

        Equal to `device_costs` on those inputs (tests/test_rl_numpy_episode.py checks), computed by
        parts: the comm heads' first layer applied to a device's features, to the context
        (once per block, not per device: it is the same for every candidate) and to the
        structured extras, summed; "with" and "taken" share the devices' features, compute,
        payload and extras, and differ only in the context's part.
        """
        k, m, _ = sums.shape
        enc = self.encoder
        sums2 = torch.cat([sums, sums + table], dim=1)  # [K, 2M, E]: now, then with the table
        feats = enc.features(sums2)
        compute = enc.compute_log(self.compute, sums2, torch.cat([counts, counts + 1], dim=1), feats)
        ctx = enc.features(torch.stack([max_sums, max_sums + table], dim=1))  # [K, 2, F]
        f = feats.shape[-1]
        heads = (self.forward_comm, self.backward_comm)
        w1 = torch.cat([h[0].weight for h in heads])  # [2H, F + F (+ extras)]: both heads' first layers
        b1 = torch.cat([h[0].bias for h in heads])
        pre = nn.functional.linear(feats, w1[:, :f], b1)
        if self.structured_comm:
            out_d = enc.volume_mb(sums2)
            total = torch.cat([task.total_mb[:, None].expand(k, m),
                               (task.total_mb + enc.volume_mb(table))[:, None].expand(k, m)], dim=1)
            d = task.devices[:, None]
            volume, extra = self._payload(out_d, total, d)
            pre = pre + nn.functional.linear(extra, w1[:, 2 * f :])
        blocks = [pre + nn.functional.linear(ctx, w1[:, f : 2 * f]).repeat_interleave(m, dim=1)]
        rows = [slice(None)]
        if taken:
            blocks.append(pre[:, m:] + nn.functional.linear(torch.maximum(ctx[:, :1], feats[:, m:]), w1[:, f : 2 * f]))
            rows.append(slice(m, None))
        w2 = torch.block_diag(*[h[2].weight for h in heads])  # [2, 2H]: each head's second layer on its half
        raw = nn.functional.linear(torch.relu(torch.cat(blocks, dim=1)), w2, torch.cat([h[2].bias for h in heads]))
        comp = torch.cat([compute[:, r] for r in rows], dim=1)
        if self.structured_comm:
            c_ms = log1p_ms(comp)
            slowest = torch.maximum(task.slowest_ms[:, None], c_ms)
            vol = torch.cat([volume[:, r] for r in rows], dim=1)
            out = self._comm_log(raw, vol, d, slowest, c_ms, comp)
        else:
            out = torch.cat([comp.unsqueeze(-1), raw], dim=-1)
        out = log1p_ms(out)
        return out[:, :m], out[:, m : 2 * m], out[:, 2 * m :] if taken else None

    def device_costs(self, sums: torch.Tensor, counts: torch.Tensor, device_mask: torch.Tensor | None = None,
                     max_sums: torch.Tensor | None = None, task: "TaskContext | None" = None) -> torch.Tensor:
        """[..., D, 3] predicted ms (see `device_log`)."""
        return log1p_ms(self.device_log(sums, counts, device_mask, max_sums, task))

    def plan_log(self, sums: torch.Tensor, device_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[...] raw overall head output, log(1 + plan cost ms)."""
        return self.overall(self.context(self.encoder.features(sums), device_mask)).squeeze(-1)

    def plan_cost(self, sums: torch.Tensor, device_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[...] predicted plan cost (ms) from the overall head."""
        return log1p_ms(self.plan_log(sums, device_mask))

    @staticmethod
    def context(feats: torch.Tensor, device_mask: torch.Tensor | None) -> torch.Tensor:
        if device_mask is not None:
            feats = feats.masked_fill(~device_mask.unsqueeze(-1), 0.0)  # features are >= 0
        return feats.max(dim=-2).values


#: What the structured comm heads see besides a device's encoding and the devices' max: log(1 +
#: its payload MB), log(devices), log(1 + the task's total pooled output MB)
COMM_CONTEXT = ("log1p_volume_mb", "log_devices", "log1p_total_mb")


@dataclass
class TaskContext:
    """What structured comm heads need of ALL the task's devices when scoring only some: the
    total pooled-output MB, the device count and the slowest device's compute (ms), [K] each."""

    total_mb: torch.Tensor
    devices: torch.Tensor
    slowest_ms: torch.Tensor


#: Inputs per device that describe its predicted costs: log(1 + ms) of the three costs and
#: the three as shares of an even split of the task's predicted compute.
COST_FEATURES = 6


def cost_features(costs: torch.Tensor, even_ms: float) -> torch.Tensor:
    """[..., D, 6] from [..., D, 3] predicted ms and the task's even share of compute (ms)."""
    return torch.cat([torch.log1p(costs), costs / max(even_ms, 1e-3)], dim=-1)


class DreamShardPolicy(nn.Module):
    """One logit per device.

    Inputs of a device: an encoding of its current tables (the policy's own table encoder,
    summed, scaled by devices / tables so it reads as a multiple of an even share) and an
    encoding of its three predicted costs. With `encode_table` (not in the reference) also
    the encoding of the table being placed and of the device's three predicted costs if it
    took that table.
    """

    def __init__(self, num_features: int, hidden: int = 128, out: int = 32, cost_hidden: int = 32,
                 scorer_hidden: int = 64, encode_table: bool = True, skip: bool = True):
        super().__init__()
        self.encode_table = encode_table
        self.encoder = mlp([num_features, hidden, out], relu_last=True)
        self.cost_encoder = mlp([COST_FEATURES, cost_hidden, cost_hidden], relu_last=True)
        width = out + cost_hidden + ((out + cost_hidden) if encode_table else 0)
        self.scorer = mlp([width, scorer_hidden, 1])
        # a linear path from the raw cost features to the logit, starting at zero: "prefer the
        # device whose cost (with the table) is lowest" is then one direction away, which
        # REINFORCE finds far sooner than through the MLP alone
        self.skip = _zero_linear(COST_FEATURES * (2 if encode_table else 1)) if skip else None

    def logits(self, device_enc: torch.Tensor, costs: torch.Tensor, table_enc: torch.Tensor | None,
               whatif: torch.Tensor | None) -> torch.Tensor:
        """[..., D] logits from device encodings [..., D, E], cost features [..., D, 6] and,
        with encode_table, the table's encoding [..., E] and what-if cost features [..., D, 6]."""
        if not self.encode_table:
            out = self.scorer(torch.cat([device_enc, self.cost_encoder(costs)], dim=-1))
            if self.skip is not None:
                out = out + self.skip(costs)
            return out.squeeze(-1)
        # the scorer reads [device, its costs, the table, its costs with the table]; the table's
        # part of the first layer is the same for every device, so it is applied once, not per
        # device, and both cost inputs go through the cost encoder in one call
        e, first = device_enc.shape[-1], self.scorer[0]
        w = first.weight
        raw = torch.cat([costs, whatif], dim=-1)
        enc = self.cost_encoder(raw.unflatten(-1, (2, COST_FEATURES))).flatten(-2)  # [..., D, 2C]
        c = enc.shape[-1] // 2
        per_table = nn.functional.linear(table_enc, w[:, e + c : 2 * e + c], first.bias).unsqueeze(-2)
        x = torch.cat([device_enc, enc], dim=-1)
        h = nn.functional.linear(x, torch.cat([w[:, : e + c], w[:, 2 * e + c :]], dim=1)) + per_table
        for layer in self.scorer[1:-1]:
            h = nn.functional.linear(h, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else torch.relu(h)
        last = self.scorer[-1]
        if self.skip is None:
            return nn.functional.linear(h, last.weight, last.bias).squeeze(-1)
        # the scorer's last layer and the skip path as one layer on [hidden, raw costs]
        return nn.functional.linear(torch.cat([h, raw], dim=-1), torch.cat([last.weight, self.skip.weight], dim=1),
                                    last.bias + self.skip.bias).squeeze(-1)


#: AutoShard's per-device action inputs besides the summed encoding: log(1 + predicted ms),
#: predicted ms as a share of an even split, memory used as a share of the device's.
AUTOSHARD_DEVICE_FEATURES = 3


class AutoShardNet(nn.Module):
    """AutoShard: a table encoder shared by the cost model and the policy.

    Cost model: sum of a shard's encodings → head → log(1 + compute ms) (`ShardEncoder`). Policy: an LSTM over
    the placement sequence (input: the current table's encoding and the fraction of tables
    placed); each device's action vector [summed encoding of its shard (scaled by devices /
    tables), predicted shard cost, memory used] is projected to the LSTM's width and scored
    by an MLP over [state, action, state ⊙ action]. A value head sees the state and the
    mean and max of the action vectors (the state alone does not depend on the placements
    so far).
    """

    def __init__(self, num_features: int, hidden: int = 128, out: int = 32, head_hidden: int = 64,
                 lstm_hidden: int = 64, scorer_hidden: int = 64, additive: bool = True, skip: bool = True):
        super().__init__()
        self.encoder = ShardEncoder(num_features, hidden, out, additive)
        w = self.encoder.width
        self.cost_head = mlp([w, head_hidden, 1])
        self.lstm = nn.LSTM(w + 1, lstm_hidden, batch_first=True)
        self.action = nn.Linear(w + AUTOSHARD_DEVICE_FEATURES, lstm_hidden)
        self.scorer = mlp([3 * lstm_hidden, scorer_hidden, 1])
        self.value = mlp([3 * lstm_hidden, scorer_hidden, 1])
        self.skip = _zero_linear(AUTOSHARD_DEVICE_FEATURES) if skip else None  # as DreamShardPolicy's
        self.width = w

    def shard_log(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[...] raw cost head output, log(1 + compute ms), from encoding sums [..., E] and
        table counts [...] (an empty shard computes nothing)."""
        return self.encoder.compute_log(self.cost_head, sums, counts)

    def shard_cost(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[...] predicted compute ms of shards."""
        return log1p_ms(self.shard_log(sums, counts))

    def actions(self, device_sums: torch.Tensor, device_feats: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.action(torch.cat([self.encoder.features(device_sums), device_feats], dim=-1)))

    def logits(self, state: torch.Tensor, actions: torch.Tensor, device_feats: torch.Tensor) -> torch.Tensor:
        """[..., D] from LSTM states [..., H], action vectors [..., D, H] and the raw device
        features [..., D, 3] (through a linear skip path)."""
        s = state.unsqueeze(-2).expand_as(actions)
        out = self.scorer(torch.cat([s, actions, s * actions], dim=-1))
        if self.skip is not None:
            out = out + self.skip(device_feats)
        return out.squeeze(-1)

    def values(self, state: torch.Tensor, actions: torch.Tensor, device_mask: torch.Tensor | None = None) -> torch.Tensor:
        if device_mask is None:
            mean, top = actions.mean(-2), actions.max(-2).values
        else:
            m = device_mask.unsqueeze(-1).float()
            mean = (actions * m).sum(-2) / m.sum(-2).clamp_min(1.0)
            top = (actions * m).max(-2).values
        return self.value(torch.cat([state, mean, top], dim=-1)).squeeze(-1)
