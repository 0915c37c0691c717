"""hvd.init(process_sets=...) as Horovod 0.28.1 behaves, run on every rank (2 or 4 ranks):
duplicate entries are refused with Horovod's ValueError naming the entry's number; a
second init while running gives the sets it is passed the ids of the registered sets with
the same ranks, and refuses a set that is not registered."""
import aiak_training.tensorflow as hvd
import tensorflow as tf
from mpi4py import MPI

n = MPI.COMM_WORLD.Get_size()
assert n >= 2, "needs two ranks"
DUPLICATE = "Horovod could not be initialized because process_sets entry number {} is a duplicate"

# A duplicate (entry 2 repeats entry 0), and a set of all ranks (the global set's twin).
for sets, index in (([hvd.ProcessSet([0]), hvd.ProcessSet([n - 1]), hvd.ProcessSet([0])], 2),
                    ([hvd.ProcessSet(list(range(n)))], 0)):
    try:
        hvd.init(process_sets=sets)
    except ValueError as exc:
        assert str(exc).startswith(DUPLICATE.format(index)), exc
        assert sets[index].process_set_id is None
    else:
        raise AssertionError(f"duplicate process sets were accepted: {sets}")
    assert not hvd.is_initialized()

tail, other = hvd.ProcessSet(list(range(1, n))), hvd.ProcessSet([0, 1])
sets = [tail] + ([other] if n > 2 else [])
hvd.init(process_sets=sets)
assert [ps.process_set_id for ps in sets] == list(range(1, len(sets) + 1))
me = hvd.rank()
if me > 0:
    got = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, process_set=tail)
    assert float(got.numpy()[0]) == sum(range(1, n)), got

# Second init: new objects with registered ranks take the registered ids, in any order.
again = [hvd.ProcessSet(ps.ranks) for ps in reversed(sets)]
hvd.init(process_sets=again)
assert [ps.process_set_id for ps in again] == [ps.process_set_id for ps in reversed(sets)]
if me > 0:
    got = hvd.allreduce(tf.constant([2.0]), op=hvd.Sum, process_set=again[-1])
    assert float(got.numpy()[0]) == 2.0 * (n - 1), got

# A duplicate in a second init is still Horovod's error; an unregistered set is refused.
try:
    hvd.init(process_sets=[hvd.ProcessSet(tail.ranks), hvd.ProcessSet(tail.ranks)])
except ValueError as exc:
    assert str(exc).startswith(DUPLICATE.format(1)), exc
else:
    raise AssertionError("duplicate accepted on re-init")
try:
    hvd.init(process_sets=[hvd.ProcessSet([0])])  # never registered
except ValueError as exc:
    assert "entry number 0" in str(exc) and "not a registered process set" in str(exc), exc
else:
    raise AssertionError("an unregistered set was accepted on re-init")
hvd.barrier()
print(f"rank {me}: process_sets init ok", flush=True)
