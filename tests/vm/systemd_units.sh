#!/bin/sh
# Inside the VM under systemd (scripts/rdma_vm.py run --systemd tests/vm/systemd_units.sh): kvfs's
# units, as install.sh installs them, started and stopped by a real systemd with their hardening.
# Prints CHECK ok|FAIL lines and a last SYSTEMD-VM-SUMMARY line for tests/test_systemd.py.
export PYTHONDONTWRITEBYTECODE=1
passed=0; failed=0; failures=""
check() {  # check NAME COMMAND...
    name=$1; shift
    if "$@" > /tmp/check.out 2>&1; then
        passed=$((passed + 1)); echo "CHECK ok $name"
    else
        failed=$((failed + 1)); failures="$failures|$name"; echo "CHECK FAIL $name"; cat /tmp/check.out
    fi
}

# What install.sh puts in place: the command, the units, /etc/kvfs.
printf '#!/bin/sh\nPYTHONPATH=/share:/venv PYTHONDONTWRITEBYTECODE=1 exec python3 -m kvfs "$@"\n' > /usr/local/bin/kvfs
chmod 755 /usr/local/bin/kvfs
cp /share/scripts/systemd/*.service /etc/systemd/system/
mkdir -p /etc/kvfs
# The cluster's credentials, as docs/operations.md says: a CA, a bundle per identity. One
# machine runs all three here, so the master's and the admin's bundles live beside the node's.
kvfs ca init --dir /etc/kvfs/ca > /dev/null
kvfs ca issue master --role master --ca-dir /etc/kvfs/ca --out /etc/kvfs/tls-master > /dev/null
kvfs ca issue vm-node --role node --address 127.0.0.1 --ca-dir /etc/kvfs/ca --out /etc/kvfs/tls > /dev/null
kvfs ca issue operator --role admin --ca-dir /etc/kvfs/ca --out /etc/kvfs/tls-admin > /dev/null
cat > /etc/kvfs/kvfs.toml <<'TOML'
[mount]
dram = "64M"
metrics_listen = "127.0.0.1:9740"
[master]
listen = "127.0.0.1:7400"
metrics_listen = "127.0.0.1:9741"
tls_dir = "/etc/kvfs/tls-master"
[node]
master = "127.0.0.1:7400"
listen = "127.0.0.1:0"
dram = "64M"
metrics_listen = "127.0.0.1:9742"
[status]
tls_dir = "/etc/kvfs/tls-admin"
TOML
systemctl daemon-reload

# A single-node mount: "started" means the mount answers.
check "kvfs-mount@ starts (Type=notify) and the mount answers at once" sh -c '
    systemctl start kvfs-mount@mnt-kvfs && findmnt -n -o FSTYPE /mnt/kvfs | grep -qx fuse.kvfs &&
    echo block > /mnt/kvfs/b && [ "$(cat /mnt/kvfs/b)" = block ]'
check "its status text and journald priorities" sh -c '
    systemctl show -p StatusText --value kvfs-mount@mnt-kvfs | grep -q "serving /mnt/kvfs" &&
    journalctl -u kvfs-mount@mnt-kvfs -p info --no-pager | grep -q "is ready" &&
    ! journalctl -u kvfs-mount@mnt-kvfs -p info --no-pager | grep -q " INFO "'
check "its metrics endpoint" sh -c 'python3 -c "import urllib.request as u; t = u.urlopen(\"http://127.0.0.1:9740/metrics\").read().decode(); assert \"kvfs_files 1.0\" in t, t[:500]"'
check "a crashed daemon is restarted and its stale mount cleaned" sh -c '
    pid=$(systemctl show -p MainPID --value kvfs-mount@mnt-kvfs) && kill -9 "$pid" &&
    end=$(( $(date +%s) + 60 )) &&
    until [ "$(systemctl show -p NRestarts --value kvfs-mount@mnt-kvfs)" -ge 1 ] &&
          systemctl is-active -q kvfs-mount@mnt-kvfs && ls /mnt/kvfs > /dev/null 2>&1; do
        [ "$(date +%s)" -lt "$end" ] || exit 1; sleep 0.2
    done && findmnt -n -o FSTYPE /mnt/kvfs | grep -qx fuse.kvfs'
check "stop unmounts cleanly" sh -c '
    systemctl stop kvfs-mount@mnt-kvfs && ! findmnt /mnt/kvfs > /dev/null &&
    [ "$(systemctl show -p Result --value kvfs-mount@mnt-kvfs)" = success ]'

# A cluster: the master (fully sandboxed) and a node.
check "kvfs-master starts with its defaults and its certificate" sh -c '
    systemctl start kvfs-master && systemctl is-active -q kvfs-master && [ -d /var/lib/kvfs/master ]'
check "kvfs-node@ joins, mounts, serves" sh -c '
    systemctl start kvfs-node@mnt-node && findmnt -n -o FSTYPE /mnt/node | grep -qx fuse.kvfs &&
    mkdir -p /mnt/node/m && head -c 5000000 /dev/urandom > /tmp/f && cp /tmp/f /mnt/node/m/f &&
    cmp /tmp/f /mnt/node/m/f && kvfs status --master 127.0.0.1:7400 | grep -q " up "'
check "the master restarts and the node keeps its files" sh -c '
    systemctl restart kvfs-master && cmp /tmp/f /mnt/node/m/f && kvfs status --master 127.0.0.1:7400 > /dev/null'
check "stopping the node and the master" sh -c '
    systemctl stop kvfs-node@mnt-node && ! findmnt /mnt/node > /dev/null && systemctl stop kvfs-master &&
    [ "$(systemctl show -p Result --value kvfs-master)" = success ]'

echo "SYSTEMD-VM-SUMMARY passed=$passed failed=$failed failures=$failures"
[ "$failed" -eq 0 ]
