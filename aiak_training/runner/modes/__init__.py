"""The ways aiakrun starts a job: under MPI, over Gloo, elastic, as a job placed by a scheduler (Ray, Spark),
and ``--advise``.  Import-free, so that a rank's child process starts fast."""
