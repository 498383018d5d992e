#!/usr/bin/env bash
# Install Azurite (the Azure Storage emulator the Azure backend tests run on 127.0.0.1)
# from the npm registry into .servers/azurite (git-ignored). Idempotent: does nothing when
# the pinned version is there already. Needs node >= 18 and npm.
#   backends/azure/install-azurite.sh            # from the repository root (or anywhere)
#   AZURITE_VERSION=3.35.0 backends/azure/install-azurite.sh
set -euo pipefail
version="${AZURITE_VERSION:-3.35.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="$root/.servers/azurite"
installed="$dir/node_modules/azurite/package.json"
if [ -x "$dir/node_modules/.bin/azurite-blob" ] && [ -f "$installed" ] \
        && grep -q "\"version\": \"$version\"" "$installed"; then
    echo "azurite $version already in $dir"
    exit 0
fi
command -v npm >/dev/null || { echo "install-azurite: npm not found (install Node.js >= 18)" >&2; exit 1; }
mkdir -p "$dir"
[ -f "$dir/package.json" ] || echo '{"name": "dcpstore-test-servers", "private": true}' > "$dir/package.json"
npm install --prefix "$dir" --no-audit --no-fund --loglevel=error --save-exact "azurite@$version"
"$dir/node_modules/.bin/azurite-blob" --version >/dev/null
echo "azurite $version installed in $dir"
