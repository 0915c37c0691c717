"""The ways aiakrun starts a job: under MPI, over Gloo, elastic, as a Ray or Spark cluster job,
and ``--advise``.  Import-free, so that a rank's child process starts fast."""
