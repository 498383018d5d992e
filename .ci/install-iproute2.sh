#!/usr/bin/env bash
# iproute2 (`ip`, `tc`): the multi-host tests make hosts of network namespaces
# (dcpstore/testing/hosts.py). Installed only where it is missing; needs root, as the
# namespaces themselves do.
set -euo pipefail
if command -v ip >/dev/null && command -v tc >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "iproute2 is missing and this is not root: the multi-host tests need both" >&2
  exit 0
fi
if command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null
elif command -v dnf >/dev/null; then
  dnf install -y -q iproute iproute-tc >/dev/null
else
  echo "cannot install iproute2 here (no apt-get or dnf): install it" >&2
  exit 1
fi
