#!/bin/sh
# A discovery script in Horovod's format: one `host:slots` line per host where workers may run.
#
# It prints the pool kept in hosts.txt beside it (or in the file $RAY_ELASTIC_HOSTS names), so growing or
# shrinking the pool while a run goes on is an edit of that file. A host is a Ray node ID, or an IP address
# that belongs to exactly one Ray node; a line without `:slots` gets one slot. Without a pool file it prints
# the address of the machine it runs on, with one slot per CPU (a one-node Ray cluster).
#
#   ray-elastic run examples/digits.py:train_fn --min-workers 2 --max-workers 8 \
#       --discovery-script examples/discover.sh
set -eu
hosts="${RAY_ELASTIC_HOSTS:-$(dirname "$0")/hosts.txt}"
if [ -f "$hosts" ]; then
    grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$hosts" || true   # an empty pool: no host, not an error
else
    echo "$(hostname -I | awk '{print $1}'):$(nproc)"
fi
