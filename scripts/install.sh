#!/usr/bin/env bash
# Installs kvfs on Debian 12 (as root): system packages, a virtual environment in
# $KVFS_PREFIX (default /opt/kvfs) and the `kvfs` command in /usr/local/bin.
#   scripts/install.sh          kvfs only
#   scripts/install.sh --test   kvfs and what its test suite needs
#   scripts/install.sh --rdma   kvfs with the RDMA transport: Debian's python3-pyverbs (the PyPI
#                               sdist does not build), visible in the virtual environment
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${KVFS_PREFIX:-/opt/kvfs}
extras=""
rdma=""
for arg in "$@"; do
    case $arg in
        --test) extras="[test]" ;;
        --rdma) rdma=1 ;;
        *) echo "install.sh: unknown argument $arg (--test, --rdma)" >&2; exit 1 ;;
    esac
done

if [[ $(id -u) -ne 0 ]]; then
    echo "install.sh: run as root (it installs packages and mounts file systems)" >&2
    exit 1
fi

echo "kvfs: installing system packages (fuse3, libfuse3 headers, compiler, python3-venv)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
packages=(fuse3 libfuse3-dev pkg-config gcc libc6-dev python3 python3-dev python3-venv attr util-linux)
# The tests verify the units with systemd-analyze, boot a soft-RoCE VM for the RDMA transport,
# check the alert rules with promtool (Debian's prometheus package), partition nodes in network
# namespaces (iproute2, iptables), and start 3-member etcd clusters on loopback for the masters'
# failover (etcd-server, etcd-client; no etcd is started or enabled system-wide).
[[ -n $extras ]] && packages+=(systemd qemu-system-x86 debootstrap e2fsprogs prometheus iproute2 iptables
                               etcd-server etcd-client)
[[ -n $rdma ]] && packages+=(rdma-core ibverbs-providers python3-pyverbs)
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
# Debian's etcd-server enables a single-member etcd on 2379 at install; the tests start their own.
if [[ -n $extras ]] && systemctl is-enabled --quiet etcd 2>/dev/null; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
fi

if [[ ! -x $prefix/bin/python ]]; then
    echo "kvfs: creating virtual environment in $prefix" >&2
    /usr/bin/python3 -m venv "$prefix"
fi
if [[ -n $rdma ]]; then  # pyverbs lives in the system's dist-packages
    sed -i 's/^include-system-site-packages = false/include-system-site-packages = true/' "$prefix/pyvenv.cfg"
fi
echo "kvfs: installing kvfs$extras into $prefix (pyfuse3 compiles against libfuse3)" >&2
"$prefix/bin/pip" install -q --disable-pip-version-check --upgrade pip setuptools wheel
# liburing is compiled here for this CPU's baseline (a prebuilt wheel may need AVX-512: docs/ssd-tier.md);
# pip keeps the wheel it built, so only the first install pays the ~2 minutes.
"$prefix/bin/pip" install -q --disable-pip-version-check --no-binary liburing "$repo$extras"
# liburing keeps an import cache in its package directory: write it now, while that is writable.
"$prefix/bin/python" -c "import liburing" || echo "kvfs: liburing does not import; the SSD tier will use threads" >&2
ln -sf "$prefix/bin/kvfs" /usr/local/bin/kvfs
# Units (not enabled: see docs/operations.md), the documentation they point at, and an
# example configuration next to where kvfs looks for one.
install -d /etc/systemd/system /usr/share/doc/kvfs /etc/kvfs
install -m 644 "$repo"/scripts/systemd/*.service /etc/systemd/system/
install -m 644 "$repo"/docs/*.md "$repo"/docs/grafana-dashboard.json "$repo"/docs/prometheus.yml \
    "$repo"/docs/alerts.yml /usr/share/doc/kvfs/
install -m 644 "$repo"/scripts/kvfs.toml.example /etc/kvfs/kvfs.toml.example
# Bash completion, generated from the command's own parser.
install -d /usr/share/bash-completion/completions
"$prefix/bin/kvfs" completion bash > /usr/share/bash-completion/completions/kvfs
if [[ -d /run/systemd/system ]]; then systemctl daemon-reload; fi
echo "kvfs: installed $("$prefix/bin/kvfs" --version) as /usr/local/bin/kvfs" >&2
