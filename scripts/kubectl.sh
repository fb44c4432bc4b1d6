#!/usr/bin/env bash
# kubectl for the Kubernetes manifests' test (tests/unit/test_kubernetes_manifests.py
# runs `kubectl kustomize`), installed from packages when missing. The
# manifests need kustomize v5, which kubectl carries from 1.27 on: Debian's
# `kubernetes-client` is used when its version is that new; Debian 12's is
# 1.20, whose kustomize (v2) cannot build them, so there kubectl comes from
# an apt source of the machine that has it, else the Kubernetes project's own
# apt repository (pkgs.k8s.io), signed by its key.
# Prints nothing when a new enough kubectl is there.
set -euo pipefail

MINOR=27
STABLE=${PAYHOOK_KUBECTL_STABLE:-v1.32}

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "kubectl: $1; run as root or install it yourself" >&2
    exit 1
  fi
}

client_minor() {
  kubectl version --client -o json 2>/dev/null |
    sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1
}

if command -v kubectl >/dev/null; then
  minor=$(client_minor)
  if [ -n "$minor" ] && [ "$minor" -ge "$MINOR" ]; then
    exit 0
  fi
  echo "kubectl: $(command -v kubectl) is 1.${minor:-?}; the manifests need 1.$MINOR or newer" \
    "(kustomize v5): remove it or put a newer kubectl first in PATH" >&2
  exit 1
fi

need_root "kubectl is missing"
apt-get update -qq
candidate=$(apt-cache policy kubernetes-client | sed -n 's/ *Candidate: *//p')
if [ -n "$candidate" ] && [ "$candidate" != "(none)" ] &&
  dpkg --compare-versions "$candidate" ge "1.$MINOR"; then
  echo "kubectl: installing kubernetes-client $candidate from Debian packages" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    kubernetes-client >/dev/null
elif [ -n "$(apt-cache policy kubectl | sed -n 's/ *Candidate: *//p' | grep -v '(none)')" ]; then
  echo "kubectl: installing kubectl from the machine's apt sources" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubectl >/dev/null
else
  echo "kubectl: Debian's kubernetes-client is ${candidate:-missing}, older than 1.$MINOR;" \
    "installing kubectl $STABLE from pkgs.k8s.io" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    ca-certificates curl gnupg >/dev/null
  install -d -m 0755 /etc/apt/keyrings
  curl -fsSL "https://pkgs.k8s.io/core:/stable:/$STABLE/deb/Release.key" |
    gpg --dearmor --yes -o /etc/apt/keyrings/kubernetes-apt-keyring.gpg
  echo "deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg]" \
    "https://pkgs.k8s.io/core:/stable:/$STABLE/deb/ /" >/etc/apt/sources.list.d/kubernetes.list
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubectl >/dev/null
fi
