"""The emulated cluster's stand-in for ``ssh``: a program of its own, standard library only.

MPICH hydra, started with ``-launcher ssh -launcher-exec <wrapper>``, calls it as it would
call ssh::

    launch_agent.py CONFIG [ssh options] [user@]HOST WORD...

CONFIG is the JSON file the cluster wrote for this run (see :func:`write_config`).  The agent
looks HOST up there, then runs the words joined by spaces through ``sh -c``, as sshd would,
inside that node's network namespace and with the node's hostname set in a private UTS
namespace.  The environment and working directory are inherited.
"""
import json
import os
import sys
from typing import Dict, List, Tuple

# ssh(1) options followed by a value; every other option is a flag.
_SSH_OPTIONS_WITH_VALUE = frozenset("BbcDEeFIiJLlmOoPpQRSWw")
# Runs in the fresh UTS namespace: set the hostname ($2 is the hostname tool, $1 the name),
# then run the remote command as sshd would.
_SET_HOSTNAME_THEN_RUN = '"$2" "$1" || exit 255; exec sh -c "$3"'


def write_config(path: str, nodes: Dict[str, Tuple[str, str]], ip: str, unshare: str,
                 hostname: str) -> None:
    """Write the agent's CONFIG: host (address or node name) -> (namespace, node name), and
    the absolute paths of the tools it execs."""
    with open(path, "w") as f:
        json.dump({"nodes": nodes, "ip": ip, "unshare": unshare, "hostname": hostname}, f,
                  indent=1, sort_keys=True)


def _host_position(argv: List[str]) -> int:
    """Index of the destination in ssh-style arguments (len(argv) when there is none)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return i + 1
        if not word.startswith("-") or word == "-":
            return i
        for j, flag in enumerate(word[1:], 1):
            if flag in _SSH_OPTIONS_WITH_VALUE:
                if j == len(word) - 1:  # "-p 22": the value is the next word
                    i += 1
                break
        i += 1
    return i


def main(argv: List[str]) -> int:
    if not argv:
        sys.stderr.write("aiak cluster agent: no configuration file given\n")
        return 255
    with open(argv[0]) as f:
        config = json.load(f)
    args = argv[1:]
    log = os.environ.get("AIAK_CLUSTER_AGENT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(repr(args) + "\n")
    at = _host_position(args)
    if at >= len(args):
        sys.stderr.write("aiak cluster agent: no host given\n")
        return 255
    host = args[at].rsplit("@", 1)[-1]
    command = args[at + 1:]
    nodes = config["nodes"]
    if host not in nodes:
        sys.stderr.write(f"aiak cluster agent: unknown host {host!r} "
                         f"(known: {', '.join(sorted(nodes))})\n")
        return 255
    if not command:
        sys.stderr.write(f"aiak cluster agent: no command for {host}\n")
        return 255
    netns, name = nodes[host]
    ip = config["ip"]
    os.execv(ip, [ip, "netns", "exec", netns, config["unshare"], "--uts", "sh", "-c",
                  _SET_HOSTNAME_THEN_RUN, "aiak-agent", name, config["hostname"],
                  " ".join(command)])
    return 255  # not reached: execv replaces the process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
