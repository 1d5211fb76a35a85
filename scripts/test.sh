#!/usr/bin/env bash
# Sets everything up (scripts/install.sh --test) and runs the test suite against
# this checkout. Arguments go to pytest. Needs root: the tests mount FUSE.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
prefix=${KVFS_PREFIX:-/opt/kvfs}
# Run from the checkout so that tests and the daemons they start import this tree.
exec "$prefix/bin/python" -m pytest "$@"
