#!/usr/bin/env bash
# Install what a fresh Debian 12 machine lacks for the local Slurm clusters (launchers/slurm/cluster.py,
# and launchers/multihost/cluster.py, which also needs iproute2's ip and tc).
# Idempotent: returns at once when everything is installed. Needs root (or sudo).
set -euo pipefail
packages=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server iproute2)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "slurm packages already installed"
    exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends "${missing[@]}"
