"""One rank of ``aiak_training.spark.run``:
``python -m aiak_training.runner.modes.scheduler_child IN OUT``.

It lives outside ``aiak_training.spark`` so that starting a rank does not import pyspark.

The Spark task starts this process with the rank's Horovod environment already set, so user
code runs in a fresh interpreter (as in Horovod, and so that a reused Spark Python worker
never carries one job's engine or environment into the next).  IN holds the pickled
``(fn, args, kwargs)``; OUT receives ``("ok", result)`` or ``("error", type name, text)``.
"""
import sys
import traceback

import cloudpickle


def main(argv) -> int:
    payload_path, result_path = argv
    with open(payload_path, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    try:
        outcome = ("ok", fn(*args, **kwargs))
        data = cloudpickle.dumps(outcome)
    except BaseException as exc:  # reported to the driver with this rank's traceback
        data = cloudpickle.dumps(("error", type(exc).__name__, traceback.format_exc()))
        code = 1
    else:
        code = 0
    with open(result_path, "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
