#!/bin/sh
# etcd-1's entrypoint in compose.yaml (kvroute-etcd has the build machine's /bin/sh): etcd, and
# once the cluster has a leader, etcd's users and roles (scripts/compose-secrets' etcd-rbac.sh,
# from scripts/gen-auth) and `auth enable`, unless authentication is on already. Then it
# creates /tmp/kvroute-etcd-init-done, which etcd-1's health check requires, so kvroute's
# processes start only once their etcd users exist (the marker outlives a restart of the
# container, as authentication does in the member's volume). Without etcd-rbac.sh (KVROUTE_SECURE=0)
# there is nothing to do. etcdctl's settings (ETCDCTL_ENDPOINTS: this member; ETCDCTL_CACERT;
# ETCDCTL_USER: root) come from the member's env file.
set -u
done_marker=/tmp/kvroute-etcd-init-done
rbac=/etc/kvroute/secrets/etcd-rbac.sh

/usr/local/bin/etcd &
etcd=$!
trap 'kill -TERM "$etcd" 2>/dev/null' TERM INT

# As nobody: etcd's own view, whether or not authentication is on.
anonymous() { (unset ETCDCTL_USER; etcdctl --dial-timeout=2s "$@"); }

init() {
  if [ ! -e "$rbac" ]; then
    echo "etcd-first-member: no $rbac (KVROUTE_SECURE=0): authentication stays off"
    touch_done
    return 0
  fi
  # A leader: /health on the metrics listener answers 200 (no `sleep` in the image: until
  # then a read as nobody waits up to 1 s).
  until kvroute-probe http://127.0.0.1:2381/health >/dev/null 2>&1; do
    kill -0 "$etcd" 2>/dev/null || return 1
    anonymous --command-timeout=1s get /kvroute >/dev/null 2>&1
  done
  if etcdctl user get root >/dev/null 2>&1; then
    echo "etcd-first-member: authentication is on"
  elif anonymous user get root >/dev/null 2>&1; then
    # An earlier run stopped before `auth enable`: every line again (existing ones fail).
    echo "etcd-first-member: finishing an earlier run of etcd-rbac.sh"
    sed 's/^set -eu$/set -u/' "$rbac" | (unset ETCDCTL_USER; /bin/sh)
  else
    (unset ETCDCTL_USER; /bin/sh "$rbac") || { echo "etcd-first-member: etcd-rbac.sh failed" >&2; return 1; }
    echo "etcd-first-member: users and roles written, authentication on"
  fi
  if etcdctl user get root >/dev/null; then
    touch_done
  else
    echo "etcd-first-member: root cannot log in: authentication is not on" >&2
    return 1
  fi
}

# No `touch` in the image: the shell creates the file.
touch_done() { : >"$done_marker"; }

init &
wait "$etcd"
status=$?
# Interrupted by a signal (the trap passed it on): etcd's own exit status.
if [ "$status" -gt 128 ]; then
  wait "$etcd"
  status=$?
fi
exit "$status"
