#!/bin/sh
# Host discovery script for the elastic examples: prints the available hosts, one
# "hostname:slots" per line.  This one reads them from a file ($AIAK_DEMO_HOSTS, default
# examples/elastic/hosts.txt next to it), so hosts can be added or removed by editing that
# file while the job runs; a real one would ask the cloud or the scheduler instead.
exec cat "${AIAK_DEMO_HOSTS:-$(dirname "$0")/hosts.txt}"
