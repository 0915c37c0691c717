"""aiakrun's command line: flags and their errors, hosts, the ranks' environment and command,
``--check-build`` and a program read from standard input.  Import-free, as the runner's root."""
