#!/usr/bin/env bash
# Debian's packages for the local SLURM cluster the launcher tests bring up
# (munge, slurmctld, slurmd, client tools). tests/slurm_fixtures.py runs this
# itself when they are missing; the linters come from PyPI (the test extra).
# Idempotent: installs only what is missing. Needs root (apt-get).
set -euo pipefail

packages=(munge slurmctld slurmd slurm-client procps iproute2)

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

echo "install-system.sh: slurm $(dpkg-query -W -f='${Version}' slurmctld)"
