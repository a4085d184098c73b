"""Hydra entry for the offline stages: data, tasks, cost-data collection, cost-model
pre-training, and end-to-end DLRM training under sharding plans.

    python train.py stage=synthetic dataset.num_tables=856 dataset.batch_size=65536
    python train.py stage=pool dataset=dlrm_2021 dataset.path=/data/fbgemm_t856_bs65536.pt.gz
    python train.py stage=tasks task=dreamshard out_dir=tasks/dreamshard
    python train.py stage=collect collect=cpu out_dir=costdata/cpu        # resumable; torchrun for ranks
    python train.py stage=pretrain data_dir=costdata/cpu out_dir=checkpoints/cpu_fbgemm
    python train.py stage=refine refine.data_dir=costdata/cpu out_dir=experiments/refine   # close the loop
    python train.py stage=rl rl=dreamshard experiment=rl_cpu out_dir=checkpoints/dreamshard_cpu  # or rl=autoshard
    python train.py stage=dlrm_task experiment=e2e_embedding_heavy out_dir=DIR  # the end-to-end task JSON
    torchrun --nproc_per_node 2 train.py stage=dlrm dlrm.plan=neuroshard        # DLRM training under a plan
    torchrun --nproc_per_node 2 train.py stage=throughput experiment=e2e_embedding_heavy \
        dlrm.plans=[neuroshard,torchrec,pile_up]                              # samples/s per plan
    python train.py stage=sequence_task experiment=flexshard_e2e out_dir=DIR  # FlexShard: a sequence task
    torchrun --nproc_per_node 4 train.py stage=sequence_throughput experiment=flexshard_e2e  # sequence DLRM per plan
    python train.py stage=sequence_throughput experiment=flexshard_e2e cluster=emulated  # on 2 emulated hosts

Each stage is a config, conf/stage/<name>.yaml: `_target_` names its function
(src/embshard/stages.py) and `reads` the keys it takes, which is all it is given;
`python train.py stage=X --cfg job` shows them. Output folders: out_dir=DIR, else the `paths`
group (conf/paths/default.yaml). Every run writes its resolved config (config.yaml) beside
its outputs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from embshard.cli import one_line_errors, refuse_additions, refuse_unknown_keys
from embshard.errors import InputError, nearest_name

ROOT = Path(__file__).resolve().parent


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return one_line_errors(run, cfg)


def run(cfg: DictConfig) -> float | None:
    """Run the stage `cfg.stage` names on the part of the config it reads."""
    from hydra.utils import get_method

    from embshard.stages import stage_view

    view = stage_view(cfg)
    if cfg.cluster.kind not in ("loopback", "emulated"):
        raise InputError(f"cluster must be loopback or emulated, got {cfg.cluster.kind!r}")
    if cfg.cluster.kind == "emulated":
        from embshard.hardware.cluster import ENV_HOST
        from embshard.stages import run_on_cluster

        if cfg.stage.name not in ("throughput", "sequence_throughput"):
            raise InputError(f"cluster=emulated runs stage=throughput or stage=sequence_throughput, not {cfg.stage.name}")
        if ENV_HOST not in os.environ:  # this process starts the hosts; the ones it starts run the stage
            return run_on_cluster(view)
    return get_method(cfg.stage._target_)(view)


def refuse_unknown_stage(argv: list[str]) -> None:
    """`stage=X` with no conf/stage/X.yaml: one line and exit 2 (Hydra's own message is a page)."""
    known = sorted(p.stem for p in (ROOT / "conf" / "stage").glob("*.yaml"))
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "stage" and value not in known:
            near = nearest_name(value, known)
            hint = f" (did you mean {near!r}?)" if near else ""
            print(f"error: unknown stage {value!r}{hint}; choose from {', '.join(known)}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    refuse_additions(sys.argv[1:], ROOT / "conf", "train", "train.py")
    refuse_unknown_stage(sys.argv[1:])
    refuse_unknown_keys(sys.argv[1:], ROOT / "conf", "train", "train.py")
    main()
