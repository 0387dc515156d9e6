#!/bin/sh
# The one-shot job of docker-compose.cluster.yml that forms the Redis Cluster out of the nodes
# REDIS_CLUSTER_NODES names (host:port,host:port,...: the app's own setting, so the job and the
# app cannot disagree): `redis-cli --cluster create` with one replica per master (six nodes:
# 3 masters, 3 replicas).
#
# It runs at every `up` and exits 0 once every node says cluster_state:ok, whether it formed the
# cluster now or found it formed; the app services wait for that exit. It exits 1 when a node
# never answers, or when the nodes already belong to a cluster that does not come back to ok
# (`docker compose ... down` gives the next `up` fresh nodes).
set -eu

WAIT_SECONDS=${REDIS_CLUSTER_WAIT_SECONDS:-60}
nodes=$(printf '%s' "${REDIS_CLUSTER_NODES:?REDIS_CLUSTER_NODES names no node}" | tr ',' ' ')

cli() {
    address=$1
    shift
    redis-cli -h "${address%:*}" -p "${address##*:}" "$@"
}

known_nodes() {
    cli "$1" cluster info 2>/dev/null | sed -n 's/^cluster_known_nodes:\([0-9]*\).*/\1/p'
}

cluster_ok() {
    for node in $nodes; do
        cli "$node" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
    done
}

wait_until_ok() {
    waited=0
    until cluster_ok; do
        if [ "$waited" -ge "$WAIT_SECONDS" ]; then
            echo "redis-cluster: not ok after ${WAIT_SECONDS}s: $1" >&2
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

# A container runs before its server answers: wait for every node.
for node in $nodes; do
    waited=0
    until [ "$(cli "$node" ping 2>/dev/null)" = PONG ]; do
        if [ "$waited" -ge "$WAIT_SECONDS" ]; then
            echo "redis-cluster: $node did not answer within ${WAIT_SECONDS}s" >&2
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
done

if cluster_ok; then
    echo "redis-cluster: formed already"
    exit 0
fi

fresh=yes
for node in $nodes; do
    known=$(known_nodes "$node")
    if [ -z "$known" ]; then
        echo "redis-cluster: $node is not cluster-enabled" >&2
        exit 1
    fi
    [ "$known" = 1 ] || fresh=no
done

if [ "$fresh" = no ]; then
    # Restarted nodes rejoin from their nodes.conf: give the cluster time to agree again.
    wait_until_ok "the nodes belong to a cluster already; docker compose down, then up, starts over"
    echo "redis-cluster: formed already"
    exit 0
fi

# CLUSTER MEET takes an IP address, not a name: resolve each node's (Docker's DNS) first.
addresses=""
for node in $nodes; do
    host=${node%:*}
    ip=$(getent hosts "$host" 2>/dev/null | awk '{ print $1; exit }')
    addresses="$addresses ${ip:-$host}:${node##*:}"
done
# shellcheck disable=SC2086 # one argument per node
redis-cli --cluster create $addresses --cluster-replicas 1 --cluster-yes
wait_until_ok "after redis-cli --cluster create"
echo "redis-cluster: formed"
