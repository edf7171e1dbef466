"""`netagg cluster up|down`: the emulated rack (`sim.cluster`) from the command line.

``netagg cluster up --hosts 4 --rate 100mbit`` makes the cluster, starts netagg's switch on the
rack's own port (`--switch`, the fast switch by default), prints how to reach it, and holds
it until Ctrl-C or SIGTERM, or until its switch exits; then it removes everything it made.
``--topology 2x2 --hosts-per-leaf 2 --oversubscription 2 [--spray]`` makes a leaf and spine
fabric instead (`sim.cluster_fabric`), the switch reached through the spines.
``netagg cluster down --name NAME`` removes a cluster left behind (processes, namespaces,
links and queues).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from netagg.sim import cluster as C
from netagg.sim.cluster_fabric import FabricCluster, Topology
from netagg.sim.cluster_links import rate_text


def down(args) -> int:
    """`netagg cluster down`: remove what cluster `args.name` left."""
    try:
        removed = C.remove(args.name)
    except PermissionError:
        print("netagg cluster down needs root", file=sys.stderr)
        return 1
    print(f"removed {', '.join(removed)}" if removed else f"no cluster {args.name!r} here")
    return 0


def up(args) -> int:
    """`netagg cluster up`: make the cluster, serve its switch, hold it until told to stop."""
    owner = os.getpid()

    def stop(signum, frame):
        """Ctrl-C and SIGTERM leave the cluster's `with` in this process; a process forked
        from it for netlink work (pyroute2 makes each namespace in a child it then ends
        with SIGTERM) exits at once, without unwinding this process's stack, whose
        clean-up would remove the cluster being made."""
        if os.getpid() != owner:
            os._exit(1)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        if args.topology:
            made = FabricCluster(Topology.parse(args.topology, args.hosts_per_leaf), args.rate,
                                 args.queue, args.name, args.oversubscription, args.spray)
        else:
            made = C.Cluster(args.hosts, args.rate, args.queue, args.name)
        with made as cluster:
            url = cluster.serve(args.switch) if args.switch != "none" else None
            _describe(cluster, url)
            while url is None or cluster.switch.poll() is None:
                time.sleep(0.2)
            print(f"the {args.switch} switch exited (status {cluster.switch.returncode}); "
                  "removing the cluster", file=sys.stderr)
            return 1
    except (C.NeedsRoot, C.ClusterError, ValueError) as e:
        print(f"netagg cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("removed", file=sys.stderr)
        return 0


def _describe(cluster: C.Cluster, url: str | None) -> None:
    shape = cluster.shape
    print(f"cluster {cluster.name}: {len(cluster.hosts)} hosts, links {rate_text(shape.rate)} "
          f"each way, {shape.queue} bytes of queue at each end")
    if isinstance(cluster, FabricCluster):
        t = cluster.topology
        print(f"fabric: {t.leaves} leaves ({cluster.leaf(0)}..), {t.spines} spines "
              f"({cluster.spine(0)}..), uplinks {rate_text(cluster.uplink_shape.rate)}, "
              + ("netagg's packets sprayed over the spines" if cluster.spraying else
                 "flows hashed onto a spine (ECMP)"))
    if url:
        print(f"switch  {url}  (namespace {cluster.rack})")
    for h in cluster.hosts:
        print(f"host {h.index}  {h.ip}  ip netns exec {h.namespace} COMMAND")
    print("Ctrl-C removes it all", flush=True)

