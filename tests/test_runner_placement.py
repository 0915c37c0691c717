"""A rank's placement (common/job/ranks.py): Horovod's local/cross numbering, computed once
for every launcher, checked against hand-written tables and against what launched ranks
see."""
import re
import subprocess
import sys

import pytest

from aiak_training.common.job.ranks import RankIdentity, place_ranks
from launch import REPO, clean_env

# Each row: the host of every rank, then the expected (local_rank, local_size, cross_rank,
# cross_size) of every rank, worked out by hand from Horovod's rules: hosts in order of first
# appearance, local rank = position among the host's ranks, cross rank = index of the host
# among the hosts that have that local rank, cross size = how many hosts have it.
PLACEMENTS = {
    "one rank": (["x"], [(0, 1, 0, 1)]),
    "one host": (["a", "a", "a"], [(0, 3, 0, 1), (1, 3, 0, 1), (2, 3, 0, 1)]),
    "even hosts": (["a", "a", "b", "b"], [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2),
                                          (1, 2, 1, 2)]),
    # a:3 b:1 c:2 -- local rank 0 on three hosts, 1 on two (a, c), 2 on one (a).
    "uneven, biggest first": (["a", "a", "a", "b", "c", "c"],
                              [(0, 3, 0, 3), (1, 3, 0, 2), (2, 3, 0, 1), (0, 1, 1, 3),
                               (0, 2, 2, 3), (1, 2, 1, 2)]),
    # a:1 b:3 -- b's local ranks 1 and 2 are on no other host.
    "uneven, smallest first": (["a", "b", "b", "b"],
                               [(0, 1, 0, 2), (0, 3, 1, 2), (1, 3, 0, 1), (2, 3, 0, 1)]),
    # A host's ranks need not be adjacent: b comes first because rank 0 is there.
    "hosts repeated": (["b", "a", "b", "a", "c"],
                       [(0, 2, 0, 3), (0, 2, 1, 3), (1, 2, 0, 2), (1, 2, 1, 2), (0, 1, 2, 3)]),
}


@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_place_ranks_follows_horovod_numbering(case):
    hosts, expected = PLACEMENTS[case]
    assert place_ranks(hosts) == [
        RankIdentity(rank=r, size=len(hosts), local_rank=lr, local_size=ls, cross_rank=cr,
                     cross_size=cs, hostname=hosts[r])
        for r, (lr, ls, cr, cs) in enumerate(expected)]


@pytest.mark.parametrize("hosts,message", [
    ([], "no ranks to place"),
    (["a", ""], "rank 1 has no host name"),
    (["a", None], "rank 1 has no host name"),
    ("ab", "one host name per rank"),
])
def test_place_ranks_rejects_bad_host_lists(hosts, message):
    with pytest.raises(ValueError, match=message):
        place_ranks(hosts)


def test_horovod_env_names_every_field():
    env = RankIdentity(5, 8, 1, 3, 2, 4, "node7").horovod_env()
    assert env == {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1",
                   "HOROVOD_LOCAL_SIZE": "3", "HOROVOD_CROSS_RANK": "2",
                   "HOROVOD_CROSS_SIZE": "4", "HOROVOD_HOSTNAME": "node7"}


# What the runtime of each launched rank reports after hvd.init(), in one write per rank.
REPORT = ("import sys, aiak_training.torch as hvd; hvd.init(); "
          "sys.stdout.write('placed %d %d %d %d %d %d\\n' % (hvd.rank(), hvd.size(), "
          "hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())); "
          "hvd.shutdown()")


@pytest.mark.parametrize("mode", [[], ["--gloo"]], ids=["mpi", "gloo"])
def test_launched_ranks_see_the_placement(mode):
    # a:2 b:1 on virtual hosts: (rank, size, local_rank, local_size, cross_rank, cross_size).
    cmd = [sys.executable, "-m", "aiak_training.runner.launch", *mode, "--virtual-hosts",
           "-H", "a:2,b:1", "-np", "3", sys.executable, "-c", REPORT]
    proc = subprocess.run(cmd, env=clean_env(OMP_NUM_THREADS="1"), cwd=REPO,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    seen = sorted(tuple(int(x) for x in m)
                  for m in re.findall(r"placed (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)", proc.stdout))
    assert seen == [(0, 3, 0, 2, 0, 2), (1, 3, 1, 2, 0, 1), (2, 3, 0, 1, 1, 2)], \
        proc.stdout[-3000:]
