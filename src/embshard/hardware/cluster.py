"""An emulated two-host cluster on one machine: network namespaces joined by a shaped veth pair.

Each emulated host is a network namespace the run creates (`embshard-<pid>-<n>-h<k>`); the two
are joined by a veth pair with link-local addresses (169.254.100.1 and .2), and each end's
egress is shaped by tc (`tbf`: the inter-host bandwidth of the host's link; `netem` delay for
latency where the kernel has it). Processes of one host talk over that namespace's own
loopback path (unshaped: the fast intra-host link); processes of different hosts over the
shaped pair. The namespaces have no route anywhere else, so no traffic leaves them.

Scaled to this machine: the task's figures are per device (TorchRec's: 600 GiB/s inside a
host, 12.5 GiB/s between hosts, one NIC per device). `intra_host_mbit` times what the run's
processes get inside a host here: the host's P processes in one namespace, each sending to
every other in a gloo all-to-all (CPU-bound on this machine, several times below one TCP
stream, which `timed_transfer_mbit` gives); `auto_rate_mbit` sets the host link to that per
device x inter / intra x P: the task's ratio of the two tiers as the processes see them, every
device of the host sharing the emulated link.

Everything is torn down when the context exits, on failure and on SIGINT / SIGTERM too
(`teardown_on_signals`); namespaces left by runs that died (their creator's pid is gone) are
removed first. Where namespaces cannot be made (not root, no `ip`, no netns support),
`ClusterUnavailable` says so in one line and callers fall back to loopback.

    python -m embshard.hardware.cluster check --rate-mbit 200   # up, timed transfer, down
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from embshard.errors import InputError

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
ADDRESSES = ("169.254.100.1", "169.254.100.2")
PREFIX_LEN = 30
MTU = 9000
#: environment of processes started inside a host: its index and the cluster's description (JSON)
ENV_HOST = "EMBSHARD_CLUSTER_HOST"
ENV_CLUSTER = "EMBSHARD_CLUSTER"
_counter = itertools.count()


class ClusterUnavailable(InputError):
    """Network namespaces (or the shaping) cannot be made here; the message says why, in one line."""


@dataclass(frozen=True)
class LinkShape:
    """The inter-host link, each direction: bandwidth (Mbit/s) and one-way latency (µs)."""

    rate_mbit: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate_mbit, (int, float)) and 0 < self.rate_mbit < 1e6):
            raise InputError(f"cluster: the inter-host rate must be in (0, 1e6) Mbit/s, got {self.rate_mbit!r}")
        if not (isinstance(self.latency_us, (int, float)) and 0 <= self.latency_us <= 1e6):
            raise InputError(f"cluster: latency_us must be in [0, 1e6], got {self.latency_us!r}")


def _run(argv: Sequence[str], what: str) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterUnavailable(f"cluster: {what} failed ({e})") from None
    if done.returncode:
        msg = (done.stderr or done.stdout).strip().splitlines()
        raise ClusterUnavailable(f"cluster: {what} failed: {msg[0] if msg else f'exit {done.returncode}'}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces named by this module whose creating process is gone; returns them."""
    if shutil.which("ip") is None:
        return []
    try:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    removed = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"embshard-(\d+)-\d+-h\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            removed.append(name)
    return removed


@dataclass
class EmulatedCluster:
    """Two emulated hosts (module docstring). Use as a context manager: `with
    EmulatedCluster(LinkShape(200)) as c: subprocess.run(c.command(0, [...]))`."""

    shape: LinkShape
    hosts: int = 2
    namespaces: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    netem: bool = False
    _up: bool = False

    def __post_init__(self) -> None:
        if self.hosts != 2:
            raise InputError(f"cluster: the emulated cluster joins two hosts (one veth pair), the task has {self.hosts}")
        n = next(_counter)
        pid = os.getpid()
        self.namespaces = [f"embshard-{pid}-{n}-h{k}" for k in range(self.hosts)]
        self.interfaces = [f"es{pid}{n % 36:x}h{k}"[:15] for k in range(self.hosts)]

    # ------------------------------------------------------------------ addresses
    def address(self, host: int) -> str:
        return ADDRESSES[host]

    def interface(self, host: int) -> str:
        return self.interfaces[host]

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def describe(self) -> dict:
        return {"hosts": self.hosts, "namespaces": list(self.namespaces), "interfaces": list(self.interfaces),
                "addresses": list(ADDRESSES[: self.hosts]), **asdict(self.shape), "latency_shaped": self.netem}

    # ------------------------------------------------------------------ life cycle
    def up(self) -> "EmulatedCluster":
        if os.name != "posix" or shutil.which("ip") is None or shutil.which("tc") is None:
            raise ClusterUnavailable("cluster: network namespaces need Linux with iproute2 (ip, tc); none here")
        if os.geteuid() != 0:
            raise ClusterUnavailable("cluster: creating network namespaces needs root (CAP_NET_ADMIN)")
        remove_stale_namespaces()
        self._up = True  # from here on, down() removes whatever exists
        try:
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns], f"ip netns add {ns}")
            a, b = self.interfaces
            _run(["ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth", "peer", "name", b, "netns",
                  self.namespaces[1]], "creating the veth pair")
            for k, ns in enumerate(self.namespaces):
                ex = ["ip", "-n", ns]
                _run([*ex, "link", "set", "lo", "up"], "loopback up")
                _run([*ex, "link", "set", self.interfaces[k], "mtu", str(MTU)], "veth mtu")
                _run([*ex, "addr", "add", f"{ADDRESSES[k]}/{PREFIX_LEN}", "dev", self.interfaces[k]], "veth address")
                _run([*ex, "link", "set", self.interfaces[k], "up"], "veth up")
                self._shape(k)
        except BaseException:
            self.down()
            raise
        return self

    def _shape(self, host: int) -> None:
        ns, dev = self.namespaces[host], self.interfaces[host]
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        rate_bytes = self.shape.rate_mbit * 1e6 / 8
        burst = int(max(64 * 1024, 2 * MTU, rate_bytes / 250))  # >= one timer tick of traffic
        tbf = ["tbf", "rate", f"{self.shape.rate_mbit:.3f}mbit", "burst", str(burst), "latency", "100ms"]
        if self.shape.latency_us > 0:
            try:
                _run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.shape.latency_us:.0f}us"], "tc netem")
            except ClusterUnavailable:
                raise ClusterUnavailable("cluster: tc netem is not available in this kernel, so the link's latency "
                                         "cannot be shaped (set cluster.latency_us=0)") from None
            self.netem = True
            _run([*tc, "parent", "1:", "handle", "2:", *tbf], "tc tbf")
        else:
            _run([*tc, "root", *tbf], "tc tbf")

    def set_rate(self, rate_mbit: float) -> None:
        """Re-shape both ends of the link to `rate_mbit` (e.g. once this machine has been timed)."""
        self.shape = LinkShape(rate_mbit, self.shape.latency_us)
        for k, ns in enumerate(self.namespaces):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", self.interfaces[k], "root"], "tc qdisc del")
            self._shape(k)

    def down(self) -> None:
        """Remove both namespaces (their veth ends go with them); safe to call twice."""
        if not self._up:
            return
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._up = False

    def exists(self) -> bool:
        """Whether any of this cluster's namespaces is still there."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        names = {line.split()[0] for line in listed.splitlines() if line.split()}
        return any(ns in names for ns in self.namespaces)

    def __enter__(self) -> "EmulatedCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


@contextlib.contextmanager
def teardown_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise (KeyboardInterrupt / SystemExit) while inside, so `with`
    blocks around it unwind and tear their clusters down; handlers restored after."""
    def _raise(signum, frame):  # noqa: ARG001
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    old = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, _raise)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def enter_namespace(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into network namespace `name`
    (setns; a spawned worker calls it first, before any socket or thread exists)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(str(NETNS_DIR / name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise ClusterUnavailable(f"cluster: cannot enter network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- timed transfers
def _receive(host: str, port: int, ready_file: str) -> None:
    """Accept one connection, read to EOF; print {"bytes", "ms"} of the transfer from its first byte."""
    from embshard.hardware.protocol import Stopwatch

    with socket.create_server((host, port)) as srv:
        Path(ready_file).write_text("ready")
        conn, _ = srv.accept()
        with conn:
            first = conn.recv(1 << 20)
            total = [len(first)]

            def drain() -> None:
                while True:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        return
                    total[0] += len(chunk)

            ms = Stopwatch("wall").time(drain)
    print(json.dumps({"bytes": total[0] - len(first), "ms": ms}))


def _send(host: str, port: int, nbytes: int) -> None:
    buf = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=60) as conn:
        left = nbytes
        while left > 0:
            conn.sendall(buf[: min(left, len(buf))])
            left -= len(buf)


def timed_transfer_mbit(cluster: EmulatedCluster, src: int, dst: int, nbytes: int, port: int = 40123) -> float:
    """Mbit/s of one TCP stream of `nbytes` from host `src` to host `dst` (the same host: over
    that namespace's loopback), timed at the receiver (protocol.Stopwatch, wall clock)."""
    import tempfile

    to = "127.0.0.1" if src == dst else cluster.address(dst)
    with tempfile.TemporaryDirectory(prefix="embshard-link-") as tmp:
        ready = os.path.join(tmp, "ready")
        py = [sys.executable, "-m", "embshard.hardware.cluster"]
        recv = subprocess.Popen(cluster.command(dst, [*py, "_receive", to, str(port), ready]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(ready):
                if recv.poll() is not None or time.monotonic() > deadline:
                    raise ClusterUnavailable(f"cluster: the link test's receiver did not start: "
                                             f"{(recv.stderr.read() if recv.stderr else '').strip()[:200]}")
                time.sleep(0.02)
            _run(cluster.command(src, [*py, "_send", to, str(port), str(int(nbytes))]), "the link test's sender")
            out, err = recv.communicate(timeout=120)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
    if recv.returncode:
        raise ClusterUnavailable(f"cluster: the link test's receiver failed: {err.strip()[:200]}")
    got = json.loads(out.strip().splitlines()[-1])
    return got["bytes"] * 8 / (got["ms"] / 1e3) / 1e6


def launch_torchrun(cluster: EmulatedCluster | None, hosts: int, nproc_per_node: int, script: str | os.PathLike,
                    args: Sequence[str], env: dict[str, str], master_port: int = 29500,
                    timeout_s: float | None = None) -> int:
    """Run `script args` under torchrun, one torchrun (`nproc_per_node` processes) per host:
    inside each emulated host's namespace (rendezvous at host 0's address, gloo bound to the
    host's veth: same-host pairs then meet over the namespace's loopback path, other pairs cross
    the shaped link), or with `cluster` None all on this machine's loopback (the same host
    layout, every link the same speed). Returns the first non-zero exit status (the other
    hosts' processes are then stopped), else 0."""
    if cluster is None:  # this machine's loopback is shared with other runs: a free port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            master_port = probe.getsockname()[1]
    procs = []
    try:
        for h in range(hosts):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc_per_node),
                    "--nnodes", str(hosts), "--node_rank", str(h),
                    "--master_addr", cluster.address(0) if cluster is not None else "127.0.0.1",
                    "--master_port", str(master_port), str(script), *args]
            host_env = {**os.environ, **env, ENV_HOST: str(h),
                        "GLOO_SOCKET_IFNAME": cluster.interface(h) if cluster is not None else "lo"}
            if cluster is not None:
                argv = cluster.command(h, argv)
            procs.append(subprocess.Popen(argv, env=host_env, start_new_session=True))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the run on the emulated cluster took longer than {timeout_s:.0f} s")
            time.sleep(0.2)
    finally:
        for p in procs:  # stop what still runs (a failed host's peers wait in a collective)
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _intra_worker(rank: int, world: int, namespace: str, interface: str, store: str, nbytes: int, reps: int,
                  results, host: int) -> None:
    try:
        enter_namespace(namespace)
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from embshard.hardware.protocol import Stopwatch

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        per_peer = nbytes // 4
        splits = [0 if p == rank else per_peer for p in range(world)]
        send, recv = torch.ones(sum(splits)), torch.empty(sum(splits))
        timer, times = Stopwatch("wall"), []
        for rep in range(reps + 1):  # the first is a warm-up
            dist.barrier()
            ms = timer.time(lambda: dist.all_to_all_single(recv, send, splits, splits))
            if rep:
                times.append(ms)
        dist.barrier()
        dist.destroy_process_group()
        results.put((host, rank, times))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        results.put((host, rank, f"{type(e).__name__}: {e}"))


def intra_host_mbit(cluster: EmulatedCluster, processes: int, nbytes: int = 100_000_000, reps: int = 7) -> float:
    """Mbit/s each of a host's `processes` gloo processes sends to the others in an all-to-all
    (`nbytes` to each peer), every host at once as in a run (they share this machine's cores):
    the median over `reps` of the slowest rank, the slowest host. This machine's intra-host link
    per device as a run's processes get it."""
    import queue
    import statistics
    import tempfile

    import torch.multiprocessing as mp

    if processes < 2:
        raise InputError("cluster: the intra-host link needs at least 2 processes per host to time")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="embshard-intra-") as tmp:
        procs = [ctx.Process(target=_intra_worker,
                             args=(r, processes, cluster.namespaces[h], cluster.interface(h),
                                   os.path.join(tmp, f"store{h}"), nbytes, reps, results, h))
                 for h in range(cluster.hosts) for r in range(processes)]
        for p in procs:
            p.start()
        got: dict[tuple[int, int], list[float]] = {}
        try:
            while len(got) < len(procs):
                try:
                    host, rank, times = results.get(timeout=300)
                except queue.Empty:
                    raise ClusterUnavailable("cluster: timing the intra-host link took over 300 s") from None
                if isinstance(times, str):
                    raise ClusterUnavailable(f"cluster: timing the intra-host link failed: {times}")
                got[(host, rank)] = times
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    worst = max(statistics.median(max(got[(h, r)][i] for r in range(processes)) for i in range(reps))
                for h in range(cluster.hosts))
    return nbytes * (processes - 1) * 8 / (worst / 1e3) / 1e6


def network_info() -> dict:
    """What this process's run communicates over: the emulated cluster's description (set by
    the launcher in its processes' environment), else loopback."""
    return json.loads(os.environ.get(ENV_CLUSTER) or '{"kind": "loopback"}')


def auto_rate_mbit(loopback_mbit: float, intra_host_gbps: float, inter_host_gbps: float, devices_per_host: int) -> float:
    """The host link's rate that keeps the task's inter / intra ratio on this machine (module docstring)."""
    return loopback_mbit * inter_host_gbps / intra_host_gbps * devices_per_host


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_receive":
        _receive(argv[1], int(argv[2]), argv[3])
        return 0
    if argv and argv[0] == "_send":
        _send(argv[1], int(argv[2]), int(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description="bring an emulated two-host cluster up, time its link, tear it down")
    ap.add_argument("command", choices=["check"])
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--megabytes", type=float, default=50.0)
    args = ap.parse_args(argv)
    try:
        with teardown_on_signals(), EmulatedCluster(LinkShape(args.rate_mbit)) as c:
            inter = timed_transfer_mbit(c, 0, 1, int(args.megabytes * 1e6))
            intra = timed_transfer_mbit(c, 0, 0, int(args.megabytes * 1e6))
            print(json.dumps({**c.describe(), "measured_inter_host_mbit": inter, "measured_loopback_mbit": intra}))
    except ClusterUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
