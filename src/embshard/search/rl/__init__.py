"""DreamShard and AutoShard: placement policies trained by reinforcement learning against a
cost network, planning tasks of any number of tables and devices without hardware.

Modules, read in this order:

* `features`: per-table inputs (the cost models' `table_features` at the task's batch, plus
  log2 batch), z-scored with statistics of the TRAIN pool saved in the checkpoint.
* `losses`: masked categorical, REINFORCE with normalised rewards and an entropy bonus, V-trace
  (plain torch; docs/rl.md says why not TorchRL).
* `nets`: DreamShard's cost network and policy, AutoShard's shared encoder, cost model,
  LSTM policy and value head. Every network scores one device at a time with shared
  weights, so any number of tables and devices works.
* `env`: the estimated MDP both share: tables placed one at a time in descending predicted
  cost, feasibility masks from the foundation's `MemoryLedger` (room plus look-ahead),
  batched rollouts of K episodes of one task, the plan at the end.
* `agents`: what each algorithm computes per step (inputs of its scorer, the estimated cost).
* `modules`: the Lightning modules that train them (hardware measurements in the loop).
* `checkpoint`: save / load (`torch.load(weights_only=True)`), data cards, one-line errors.
* `sharders`: `search=dreamshard` and `search=autoshard` (argmax or best-of-K inference).
* `stage`: `python train.py stage=rl rl=dreamshard|autoshard`.
"""
