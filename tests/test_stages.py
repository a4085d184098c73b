"""train.py's stages as configs: conf/stage/<name>.yaml names its function and the keys it reads,
which are all it is given; `--cfg job` and `--help` show them; an unknown stage is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_method
from omegaconf.errors import ConfigAttributeError

ROOT = Path(__file__).resolve().parents[1]
STAGES = sorted(p.stem for p in (ROOT / "conf" / "stage").glob("*.yaml"))


def test_every_stage_config_names_its_function_and_reads_keys_that_exist():
    import embshard.stages as stages

    assert len(STAGES) == 12
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for name in STAGES:
            cfg = compose(config_name="train", overrides=[f"stage={name}"])
            assert cfg.stage.name == name
            fn = get_method(cfg.stage._target_)
            assert fn is getattr(stages, name) and fn.__doc__
            missing = [k for k in cfg.stage.reads if k not in cfg and k != "sequence"]  # sequence: experiment=flexshard_*
            assert not missing, f"stage {name} reads {missing}, which train.yaml does not have"


def test_a_stage_is_given_only_what_it_reads(tmp_path):
    from embshard.stages import out_dir, stage_view

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["stage=pretrain", "data_dir=x"])
    view = stage_view(cfg)
    assert view.data_dir == "x" and view.cost_model.path
    with pytest.raises(ConfigAttributeError):
        view.collect  # noqa: B018  (pretrain does not read it)
    default = out_dir(view)
    assert default.parent == ROOT / "outputs" / "train" / "pretrain" and len(default.name) == len("2025-01-01_00-00-00")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        moved = compose(config_name="train", overrides=["stage=pretrain", f"paths.outputs={tmp_path}"])
    assert out_dir(stage_view(moved)).parent == tmp_path / "train" / "pretrain"


@pytest.mark.slow
def test_cfg_job_help_and_unknown_stage():
    def train(*args):
        return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    job = train("stage=collect", "--cfg", "job").stdout
    assert "_target_: embshard.stages.collect" in job and "- collect" in job and "- measure" in job
    helped = train("stage=rl", "--help").stdout
    assert "stage=rl runs embshard.stages.rl" in helped and "'rl'" in helped
    bad = train("stage=colect", "out_dir=/nonexistent/x")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: unknown stage 'colect' (did you mean 'collect'?); choose from {', '.join(STAGES)}"]
