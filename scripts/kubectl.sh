#!/usr/bin/env bash
# kubectl for the Kubernetes manifests' test (tests/unit/test_kubernetes_manifests.py
# runs `kubectl kustomize`), installed from Debian's packages when missing:
# `kubernetes-client`. The manifests use only what its kustomize (v2, in
# Debian 12's kubectl 1.20) builds, and newer ones build the same objects.
# Prints nothing when kubectl is there.
set -euo pipefail

if command -v kubectl >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "kubectl: missing; run as root or install it yourself" >&2
  exit 1
fi
echo "kubectl: installing kubernetes-client from Debian packages" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  kubernetes-client >/dev/null
