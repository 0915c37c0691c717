"""What aiakrun tells the user when a job ends badly: failure records, blame, rank tracebacks
and the launcher's output.  Import-free: every rank's wrapper imports it."""
