"""The cluster's guard: removes a cluster whose maker died without removing it.

``python -m netagg.sim.cluster_guard NAME`` runs in a session of its own (a terminal's Ctrl-C
does not reach it) with its standard input the read end of a pipe only the cluster's maker
(`sim.cluster.Cluster`) writes. When the pipe closes, whether the maker closed it after
removing the cluster or died (a crash, SIGKILL), it ends every process in cluster NAME's
namespaces and removes them (`sim.cluster.remove`), which finds nothing in the first case.
"""

import signal
import sys

from netagg.sim.cluster import remove


def main(name: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    removed = remove(name)
    if removed:
        print(f"netagg cluster: its maker is gone; removed {', '.join(removed)}",
              file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
