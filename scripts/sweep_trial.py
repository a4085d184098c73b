"""One offline trial of a W&B sweep YAML: `python scripts/sweep_trial.py sweeps/cost_models.yaml [hydra overrides]`."""

import sys

from embshard.sweeps import run_trial

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: sweep_trial.py SWEEP.yaml [extra hydra overrides ...]")
    proc = run_trial(sys.argv[1], extra=sys.argv[2:])
    print(" ".join(proc.args))
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    sys.exit(proc.returncode)
