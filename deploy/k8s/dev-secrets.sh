#!/usr/bin/env bash
# Create the Secrets that overlays/dev expects, with throw-away values made on the spot:
#
#   shardd-db-shard-N        keys password (the dev PostgreSQL's) and dsn (what shard N's daemons use)
#   shardd-tls               tls.crt/tls.key/ca.crt: shardd's server certificate, also the relay's
#                            client certificate (CN shardd, DNS shardd and shardd-shard-N[...])
#   router-shard-client-tls  tls.crt/tls.key/ca.crt: the router's client certificate (CN router:
#                            the name shardd trusts to pass on callers' x-caller-id)
#
# All certificates come from a new CA that exists only in these Secrets (EC P-256, 30 days).
# Nothing is written outside a temporary directory, which is removed on exit.
#
#   deploy/k8s/dev-secrets.sh                       # apply to namespace shard-router-dev, 2 shards
#   deploy/k8s/dev-secrets.sh --namespace NS --shards 3
#   deploy/k8s/dev-secrets.sh --print               # print the Secret manifests instead
#
# Needs openssl (and kubectl, unless --print). Existing Secrets of these names are replaced (kubectl apply), so run
# it before the first `kubectl apply -k`, or restart the pods afterwards. Development only: in
# production use cert-manager (overlays/prod) and the database operator's Secrets.
set -euo pipefail

namespace=shard-router-dev
shards=2
mode=apply
while [ $# -gt 0 ]; do
  case "$1" in
    --namespace) namespace="$2"; shift 2 ;;
    --shards) shards="$2"; shift 2 ;;
    --print) mode=print; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "dev-secrets.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$shards" in
  ''|*[!0-9]*|0) echo "dev-secrets.sh: --shards must be a positive integer" >&2; exit 2 ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
umask 077
cd "$work"

# The CA.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days 30 \
  -subj "/CN=shard-router dev CA" -keyout ca.key -out ca.crt \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null

# issue NAME COMMON_NAME EXTENDED_KEY_USAGE [SUBJECT_ALT_NAMES]
issue() {
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$3"
    if [ -n "${4:-}" ]; then echo "subjectAltName=$4"; fi
  } > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 30 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}

# `shardd` is the probes' server name; shardd-shard-N is shard N's Service, what the router and
# the relay dial (every shard is named: gRPC does not match wildcards reliably).
sans="DNS:shardd"
for ((i = 0; i < shards; i++)); do
  sans="$sans,DNS:shardd-shard-$i,DNS:shardd-shard-$i.$namespace.svc"
  sans="$sans,DNS:shardd-shard-$i.$namespace.svc.cluster.local"
done
issue shardd shardd serverAuth,clientAuth "$sans"
issue router router clientAuth

# secret NAME KEY=FILE...: a Secret manifest with each file's content under its key.
secret() {
  local name="$1" pair
  shift
  printf 'apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' "$name" "$namespace"
  printf '  labels:\n    app.kubernetes.io/part-of: shard-router\ntype: Opaque\ndata:\n'
  for pair in "$@"; do
    printf '  %s: %s\n' "${pair%%=*}" "$(openssl base64 -A -in "${pair#*=}")"
  done
  echo "---"
}

manifests() {
  for ((i = 0; i < shards; i++)); do
    openssl rand -hex 24 | tr -d '\n' > "password-$i"
    printf 'postgresql://shardd:%s@postgres-shard-%s:5432/shardd' "$(cat "password-$i")" "$i" > "dsn-$i"
    secret "shardd-db-shard-$i" password="password-$i" dsn="dsn-$i"
  done
  secret shardd-tls tls.crt=shardd.crt tls.key=shardd.key ca.crt=ca.crt
  secret router-shard-client-tls tls.crt=router.crt tls.key=router.key ca.crt=ca.crt
}

if [ "$mode" = print ]; then
  manifests
else
  manifests | kubectl apply -f -
fi
