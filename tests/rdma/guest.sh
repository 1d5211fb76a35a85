#!/bin/sh
# Runs inside the soft-RoCE VM (scripts/rdma_vm.py run tests/rdma/guest.sh ARGS): an rxe
# device on a dummy network device, then `python3 ARGS` with this checkout and the host's
# kvfs dependencies on the path (Debian's python3-pyverbs comes from the image).
set -e
modprobe rdma_rxe
ip link add kvfs0 type dummy
ip addr add 10.77.0.1/24 dev kvfs0
ip link set kvfs0 up
rdma link add rxe0 type rxe netdev kvfs0
ibv_devices
# The host's site-packages is read-only here, at another path than it was built at: liburing's
# import cache (kept by its dynamic_import helper) is rebuilt, and must be written elsewhere.
export PYTHONPYCACHEPREFIX=/tmp/pycache
export PYTHONPATH=/share:/venv PYTHONDONTWRITEBYTECODE=1 KVFS_RDMA_HOST=10.77.0.1
cd /tmp
python3 "$@"
