"""The emulated two-host cluster (embshard.hardware.cluster): real network namespaces, a real
veth pair shaped by tc, real TCP transfers timed through it; torn down after, on failure and
on SIGTERM; a clear one-line error (and the loopback fallback) where namespaces cannot be made.

Tests that create namespaces skip, saying why, where `ip netns` cannot be used (CI without
privileges); here (root) they run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from embshard.errors import InputError
from embshard.hardware import cluster as C

ROOT = Path(__file__).resolve().parents[1]


def _netns_unusable() -> str | None:
    if os.name != "posix" or not (C.shutil.which("ip") and C.shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"embshard-{os.getpid()}-99-h0"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add fails here: {made.stderr.strip()[:120]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


UNUSABLE = _netns_unusable()
needs_netns = pytest.mark.skipif(UNUSABLE is not None, reason=f"no network namespaces: {UNUSABLE}")


def _listed() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


@needs_netns
def test_cluster_comes_up_shapes_the_link_and_is_torn_down():
    with C.EmulatedCluster(C.LinkShape(200.0)) as c:
        assert set(c.namespaces) <= _listed()
        # the veth ends live inside the namespaces, nowhere else
        links = subprocess.run(["ip", "-n", c.namespaces[0], "-o", "link"], capture_output=True, text=True).stdout
        assert c.interface(0) in links and c.interface(0) not in subprocess.run(
            ["ip", "-o", "link"], capture_output=True, text=True).stdout
        mbit = C.timed_transfer_mbit(c, 0, 1, 20_000_000)  # 0.8 s at 200 Mbit/s
        assert 0.8 * 200 <= mbit <= 1.2 * 200, mbit
        back = C.timed_transfer_mbit(c, 1, 0, 10_000_000)  # both directions are shaped
        assert 0.8 * 200 <= back <= 1.2 * 200, back
        c.set_rate(100.0)
        assert 0.8 * 100 <= C.timed_transfer_mbit(c, 0, 1, 10_000_000) <= 1.2 * 100
        names = list(c.namespaces)
    assert not set(names) & _listed()
    assert not c.exists()


@needs_netns
def test_cluster_is_torn_down_on_failure_and_on_sigterm(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with C.EmulatedCluster(C.LinkShape(100.0)) as c:
            names = list(c.namespaces)
            raise RuntimeError("boom")
    assert not set(names) & _listed()
    script = textwrap.dedent(f"""
        import sys, time
        from embshard.hardware import cluster as C
        with C.teardown_on_signals(), C.EmulatedCluster(C.LinkShape(100.0)) as c:
            open({str(tmp_path / 'names')!r}, 'w').write(' '.join(c.namespaces))
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (tmp_path / "names").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the cluster did not come up"
        time.sleep(0.1)
    names = (tmp_path / "names").read_text().split()
    assert set(names) <= _listed()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert not set(names) & _listed()


@needs_netns
def test_stale_namespaces_of_dead_runs_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"embshard-{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in C.remove_stale_namespaces()
        assert name not in _listed()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    mine = f"embshard-{os.getpid()}-98-h0"  # a live creator's namespace stays
    subprocess.run(["ip", "netns", "add", mine], check=True)
    try:
        assert mine not in C.remove_stale_namespaces() and mine in _listed()
    finally:
        subprocess.run(["ip", "netns", "del", mine], capture_output=True)


def test_without_privileges_one_line_error(monkeypatch):
    monkeypatch.setattr(C.os, "geteuid", lambda: 1000)
    with pytest.raises(C.ClusterUnavailable, match="needs root") as e:
        C.EmulatedCluster(C.LinkShape(100.0)).up()
    assert "\n" not in str(e.value)


def test_bad_cluster_topology_and_link_are_one_line_errors():
    with pytest.raises(InputError, match="joins two hosts"):
        C.EmulatedCluster(C.LinkShape(100.0), hosts=3)
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(InputError, match="rate must be"):
            C.LinkShape(bad)


def test_measured_evaluation_on_the_cluster_refuses_what_it_cannot_run():
    from embshard.hardware.evaluator import HardwareEvaluator

    with pytest.raises(InputError, match="loopback or emulated"):
        HardwareEvaluator(cluster={"kind": "switched"})
    with pytest.raises(InputError, match="gloo all-to-alls"):
        HardwareEvaluator(step="dmp", cluster={"kind": "emulated"})


def test_auto_rate_keeps_the_tasks_ratio():
    # a 6,000 Mbit/s intra-host stream, TorchRec's 600 / 12.5 GiB/s, 2 devices sharing the host link
    assert C.auto_rate_mbit(6000.0, 600.0, 12.5, 2) == pytest.approx(6000.0 / 48 * 2)


def test_emulated_cluster_refuses_a_task_of_other_than_two_hosts(tmp_path, monkeypatch, refused_in_process):
    monkeypatch.delenv("RANK", raising=False)
    code, err = refused_in_process("stage=sequence_throughput", "experiment=flexshard_tiny", "cluster=emulated",
                                   "sequence.task.hosts=1", "sequence.task.devices_per_host=4",
                                   f"sequence.trace.path={tmp_path / 'trace.pt'}", f"out_dir={tmp_path / 'out'}")
    assert code == 2 and len(err) == 1 and "joins two hosts" in err[0], err
    assert not (tmp_path / "out").exists()


def test_where_namespaces_cannot_be_made_one_line_error(tmp_path, monkeypatch, refused_in_process):
    """No `ip` on PATH and cluster.on_unavailable=error: one error line, exit 2, nothing written."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                if not (Path(p) / "ip").exists()))
    code, err = refused_in_process("stage=sequence_throughput", "experiment=flexshard_tiny", "cluster=emulated",
                                   f"sequence.trace.path={tmp_path / 'trace.pt'}", "cluster.on_unavailable=error",
                                   f"out_dir={tmp_path / 'refused'}")
    assert code == 2 and len(err) == 1 and "iproute2" in err[0], err
    assert not (tmp_path / "refused").exists()


def test_loopback_fallback_says_so_and_keeps_the_host_layout(tmp_path, monkeypatch, capsys):
    """Where the cluster cannot come up (mocked here: the namespaces' part is tested above), the
    launcher prints one error line and runs the same command as 2 hosts' torchruns on loopback."""
    import train
    from hydra import compose, initialize_config_dir

    def refuse(self):
        raise C.ClusterUnavailable("cluster: creating network namespaces needs root (CAP_NET_ADMIN)")

    launched = []
    monkeypatch.setattr(C.EmulatedCluster, "up", refuse)
    monkeypatch.setattr(C, "launch_torchrun", lambda *a, **kw: launched.append((a, kw)) or 0)
    monkeypatch.delenv("RANK", raising=False)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "stage=sequence_throughput", "experiment=flexshard_tiny", "cluster=emulated",
            f"sequence.trace.path={tmp_path / 'trace.pt'}", f"out_dir={tmp_path / 'out'}"])
    train.run(cfg)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["error: cluster: creating network namespaces needs root (CAP_NET_ADMIN); running on loopback "
                   "instead (every link the same speed)"]
    ((cluster, hosts, per_host, script, _, env), _), = launched
    assert cluster is None and (hosts, per_host) == (2, 2) and Path(script).name == "train.py"
    assert json.loads(env[C.ENV_CLUSTER]) == {"kind": "loopback", "reason": "cluster: creating network namespaces "
                                                                              "needs root (CAP_NET_ADMIN)"}


@pytest.mark.slow
def test_launch_on_loopback_runs_one_torchrun_per_host(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(textwrap.dedent(f"""
        import os, pathlib
        pathlib.Path({str(tmp_path)!r}, "rank" + os.environ["RANK"]).write_text(
            " ".join(os.environ[k] for k in ("GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME",
                                             "{C.ENV_HOST}", "X")))
    """))
    assert C.launch_torchrun(None, 2, 2, script, [], {"X": "x"}, timeout_s=300) == 0
    got = sorted((tmp_path / f"rank{r}").read_text() for r in range(4))
    assert got == sorted(f"{h} {lr} 4 lo {h} x" for h in range(2) for lr in range(2))
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys, time\nsys.exit(3) if os.environ['RANK'] == '3' else time.sleep(60)\n")
    t0 = time.monotonic()
    assert C.launch_torchrun(None, 2, 2, bad, [], {}, timeout_s=300) != 0  # a failed host stops the other
    assert time.monotonic() - t0 < 55


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("per_host", [1, pytest.param(2, marks=pytest.mark.e2e)])
def test_sequence_throughput_runs_on_the_emulated_cluster(tmp_path, per_host, monkeypatch):
    """The tiny sequence DLRM on 2 emulated hosts x `per_host` processes: runs, records the
    network, bytes sent equal the model's, and leaves no namespace behind. (2 x 2, the
    experiment's own layout, is in `make test-e2e`: 4 processes importing TorchRec on 2 cores.)
    The launching `python train.py` runs in this process (tests/_entry.py, with its command line
    as sys.argv: the hosts' torchruns run that same command); each host's ranks are train.py's
    own processes."""
    from _entry import run_entry

    before = _listed()
    overrides = ["stage=sequence_throughput", "experiment=flexshard_tiny", "cluster=emulated",
                 f"sequence.task.devices_per_host={per_host}",
                 "cluster.rate_mbit=400", "cluster.probe_megabytes=10", "sequence.replay_repetitions=1",
                 "sequence.plans=[flexshard,row_wise]",  # two of the five: the path, not the comparison
                 f"sequence.trace.path={tmp_path / 'trace.pt'}", f"out_dir={tmp_path / 'out'}", "progress=false"]
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *overrides])
    monkeypatch.delenv("RANK", raising=False)
    done = run_entry("train", *overrides, cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "out" / "throughput.json").read_text())
    net = result["network"]
    assert net["kind"] == "emulated" and net["rate_mbit"] == 400.0
    assert 0.8 * 400 <= net["measured_link_mbit"] <= 1.2 * 400
    assert all(c["bytes_match_model"] for c in result["communication"].values())
    assert _listed() == before
