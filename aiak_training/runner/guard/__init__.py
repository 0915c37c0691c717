"""Watching a running job: supervision of the launcher, the per-rank task wrapper, process
trees, the liveness link and the start timeout.  Import-free: every rank imports it."""
