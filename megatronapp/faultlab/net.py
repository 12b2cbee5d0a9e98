"""Network faults: ranks (or nodes) in their own network namespaces, and real rate limits on a link.

Set-up (`LabNetwork.__enter__`, root only): a hub namespace `<prefix>hub` holding a bridge
`br0`; per node i a namespace `<prefix>n<i>` whose interface `lab0` (address 10.231.0.<i+1>/24,
loopback up) is one end of a veth pair whose other end `v<i>` is a port of the bridge. Addresses
exist only inside these namespaces and there is no route out. A directed link src -> dst is
slowed on src's `lab0` by `htb` with one limited class and a `u32` filter on dst's address
(everything else leaves unlimited), or, without htb, by `tbf` on the whole interface (every
link out of src). `netem` is absent from the kernels this runs on, so there is no pure delay;
`QdiscSupport` probes what exists. Tear-down (`__exit__`): deleting the namespaces deletes the
veth pairs and qdiscs with them; `cleanup_namespaces` removes any a killed run left behind.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

NS_PREFIX = "mapplab-"
SUBNET = "10.231.0"
IFNAME = "lab0"  # the same name in every node namespace, so GLOO_SOCKET_IFNAME is one value


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _u32_filter(dev: str, dst: str) -> tuple[str, ...]:
    """`tc` arguments of the filter that sends packets to `dst` into htb class 1:10 (the limited one)."""
    return (
        "filter",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "protocol",
        "ip",
        "u32",
        "match",
        "ip",
        "dst",
        dst,
        "flowid",
        "1:10",
    )


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, check=check, timeout=30
    )


def address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def namespace_support() -> str | None:
    """None where namespaces and veth pairs can be made here, else the one-line reason."""
    probe = f"{NS_PREFIX}probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        finally:
            _ip("netns", "del", probe, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    except subprocess.CalledProcessError as exc:
        return f"cannot make network namespaces / veth pairs here: {exc.stderr.strip()[:200]}"
    return None


@dataclass(frozen=True)
class QdiscSupport:
    tbf: bool
    htb_u32: bool


def probe_qdiscs() -> QdiscSupport:
    """Which rate-limiting qdiscs the kernel has (tried on a veth in a throw-away namespace)."""
    ns = f"{NS_PREFIX}qprobe"
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "add", "q0", "type", "veth", "peer", "name", "q1")
        tbf = (
            _tc(
                ns,
                "qdisc",
                "add",
                "dev",
                "q0",
                "root",
                "tbf",
                "rate",
                "10mbit",
                "burst",
                "16kb",
                "latency",
                "100ms",
                check=False,
            ).returncode
            == 0
        )
        _tc(ns, "qdisc", "del", "dev", "q0", "root", check=False)
        htb = _tc(ns, "qdisc", "add", "dev", "q0", "root", "handle", "1:", "htb", check=False).returncode == 0
        htb = htb and _tc(ns, *_u32_filter("q0", "10.0.0.1/32"), check=False).returncode == 0
        return QdiscSupport(tbf, htb)
    finally:
        _ip("netns", "del", ns, check=False)


class LabNetwork:
    """`nodes` namespaces on one bridge (module docstring); `ns(i)` names node i's namespace."""

    def __init__(self, tag: str, nodes: int) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"a lab network has 1..200 nodes, got {nodes}")
        if len(tag) > 20 or not tag.replace("-", "").isalnum():
            raise ValueError(f"a lab tag is <= 20 letters, digits or '-', got {tag!r}")
        self.prefix, self.nodes = f"{NS_PREFIX}{tag}-", nodes
        self.hub = f"{self.prefix}hub"

    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def __enter__(self) -> LabNetwork:
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.nodes):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{address(i)}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        cleanup_namespaces(self.prefix)

    def limit_link(self, src: int, dst: int, rate_mbit: float, support: QdiscSupport) -> str:
        """Limit src -> dst to rate_mbit (htb + u32 on dst's address; tbf on all of src's
        traffic without htb). Returns what was installed, in words."""
        ns, rate = self.ns(src), f"{rate_mbit}mbit"
        if support.htb_u32:
            _tc(ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "20")
            _tc(
                ns,
                "class",
                "add",
                "dev",
                IFNAME,
                "parent",
                "1:",
                "classid",
                "1:10",
                "htb",
                "rate",
                rate,
                "ceil",
                rate,
                "burst",
                "4kb",
            )
            _tc(ns, "class", "add", "dev", IFNAME, "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit")
            _tc(ns, *_u32_filter(IFNAME, f"{address(dst)}/32"))
            return f"htb {rate} on {address(src)} -> {address(dst)} only"
        if support.tbf:
            _tc(ns, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", rate, "burst", "4kb", "latency", "400ms")
            return f"tbf {rate} on everything {address(src)} sends"
        raise OSError("neither htb+u32 nor tbf is available: a link cannot be slowed here")


def cleanup_namespaces(prefix: str = NS_PREFIX) -> list[str]:
    """Delete every network namespace whose name starts with `prefix` (the lab's own); their names.
    A process still inside keeps its interface alive until it exits, but the name is gone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip().startswith(prefix)]
    for name in names:
        _ip("netns", "del", name, check=False)
    return names
