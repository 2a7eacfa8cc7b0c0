#!/bin/bash
# A two-node Slurm cluster on this host, for trying the sbatch scripts and for
# the tests (tests/deploy/test_slurm_cluster.py). Needs root and Linux namespaces.
#
#   slurm/local-cluster.sh up                  # installs slurm-wlm and munge if missing
#   slurm/local-cluster.sh exec -- sinfo       # any command, inside the emulated cluster
#   slurm/local-cluster.sh exec -- sbatch --wait slurm/train_multiworker.sbatch
#   slurm/local-cluster.sh down                # stops everything, removes the namespaces
#
# State (config, munge key, spool, logs): $SLURM_LOCAL_DIR, default
# /tmp/slurm-local. `up` starts from a clean state directory; `down` leaves its
# logs for reading.
#
# Layout: one private mount + network namespace (the "cluster") holds a bridge
# with the controller's address, a hosts file bind-mounted over /etc/hosts
# (the node names resolve in there only; the machine's /etc/hosts is never
# touched) and munged. Each of node9 and node10 is its own network + UTS
# namespace inside it (host name = node name, a veth on the bridge) running
# one slurmd; slurmctld has its own UTS namespace because it refuses to start
# unless its host name is SlurmctldHost. Every namespace shares the cluster's
# mount namespace, so the nodes see this machine's files at the same paths:
# the shared filesystem a real cluster has.
set -euo pipefail

STATE="${SLURM_LOCAL_DIR:-/tmp/slurm-local}"
NODES=(node9 node10)
SUBNET=10.217.9          # private: it exists only inside the cluster namespace
CTL_HOST=slurmctl
CTL_ADDR=$SUBNET.1
CONF="$STATE/etc/slurm.conf"

die() { echo "error: $*" >&2; exit 2; }
log() { echo "local-cluster: $*" >&2; }

# The address of node N is $SUBNET.<the number in its name> (node9 -> .9).
node_addr() { echo "$SUBNET.${1#node}"; }

holder_pid() { cat "$STATE/run/$1.holder" 2>/dev/null || true; }

alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }

in_cluster() {  # run a command in the cluster's mount + network namespace
    # --wd: entering a mount namespace otherwise drops the working directory.
    nsenter -t "$(holder_pid cluster)" -m -n --wd="$PWD" -- env SLURM_CONF="$CONF" "$@"
}

install_slurm() {
    local missing=()
    for tool in slurmctld slurmd munged sbatch; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [[ ${#missing[@]} -eq 0 ]] && return
    [[ $(id -u) -eq 0 ]] || die "slurm-wlm and munge are missing (${missing[*]}) and installing them needs root"
    log "installing slurm-wlm and munge (about a minute)"
    export DEBIAN_FRONTEND=noninteractive
    # The packages would start system-wide munged/slurmd; ours run privately.
    # Debian's policy-rc.d convention (exit 101) stops that during the install.
    local policy=/usr/sbin/policy-rc.d added=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && added=1
    fi
    local rc=0 log="${TMPDIR:-/tmp}/local-cluster-apt.log"
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } \
        >"$log" 2>&1 || rc=$?
    [[ $added -eq 1 ]] && rm -f "$policy"
    [[ $rc -eq 0 ]] || die "apt-get install slurm-wlm munge failed (exit $rc); see $log"
    rm -f "$log"  # kept only to explain a failure
}

write_config() {
    local nodes_csv
    nodes_csv=$(IFS=,; echo "${NODES[*]}")
    {
        echo "127.0.0.1 localhost"
        echo "$CTL_ADDR $CTL_HOST"
        for n in "${NODES[@]}"; do echo "$(node_addr "$n") $n"; done
    } > "$STATE/etc/hosts"
    cat > "$CONF" <<EOF
# Written by slurm/local-cluster.sh; see there.
ClusterName=local
SlurmctldHost=$CTL_HOST($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/run/munge.socket
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No cgroups and no accounting daemon in a namespace sandbox.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Nodes as a GPU cluster declares them (the sbatch scripts ask for GPUs and
# 8 CPUs a task), although this host has 2 CPUs and no GPU: config_overrides
# makes slurmd report the configured hardware instead of the real one.
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
# Het jobs (train_ps.sbatch) start only from the backfill scheduler: every second, not 30.
SchedulerParameters=bf_interval=1,sched_interval=2
# Short timers: jobs start and end within seconds here.
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
JobRequeue=1
EOF
    for n in "${NODES[@]}"; do
        echo "NodeName=$n NodeAddr=$(node_addr "$n") CPUs=32 Boards=1 SocketsPerBoard=1 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=16000 Gres=gpu:4 State=UNKNOWN" >> "$CONF"
    done
    echo "PartitionName=debug Nodes=$nodes_csv Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$CONF"
    # Four "GPUs" a node that Slurm counts and allocates: slurmd wants a
    # character device per GPU, and copies of /dev/null (1,3) are harmless.
    mkdir -p "$STATE/dev"
    for i in 0 1 2 3; do mknod "$STATE/dev/gpu$i" c 1 3; done
    echo "NodeName=$nodes_csv Name=gpu File=$STATE/dev/gpu[0-3]" > "$STATE/etc/gres.conf"
}

start_daemon() {  # name, then the command; output to $STATE/log/<name>.out
    local name=$1; shift
    setsid "$@" </dev/null >"$STATE/log/$name.out" 2>&1 &
    echo $! > "$STATE/run/$name.pid"
}

up() {
    [[ $(id -u) -eq 0 ]] || die "local-cluster.sh needs root (namespaces, bridge, slurmd)"
    if alive "$(holder_pid cluster)"; then
        die "a local cluster is already up in $STATE; run '$0 down' first"
    fi
    # One clear line where the OS forbids what follows (tests skip on it).
    unshare --mount --net --uts true 2>/dev/null \
        || die "cannot create mount/network/UTS namespaces here (unshare failed)"
    install_slurm
    rm -rf "$STATE"
    mkdir -p "$STATE"/{etc,run,log,ctld,spool}
    chmod 711 "$STATE" "$STATE/run"
    write_config

    # The cluster namespace, kept alive by a holder process.
    setsid unshare --mount --net --propagation private -- sleep infinity </dev/null >/dev/null 2>&1 &
    echo $! > "$STATE/run/cluster.holder"
    for _ in $(seq 50); do
        [[ "$(readlink /proc/$!/ns/net)" != "$(readlink /proc/self/ns/net)" ]] && break
        sleep 0.1
    done
    in_cluster mount --bind "$STATE/etc/hosts" /etc/hosts
    in_cluster ip link set lo up
    in_cluster ip link add br0 type bridge
    in_cluster ip addr add "$CTL_ADDR/24" dev br0
    in_cluster ip link set br0 up

    for n in "${NODES[@]}"; do
        # The node's namespaces, created from inside the cluster's, so it
        # shares the cluster's mount namespace (same files, same /etc/hosts).
        setsid nsenter -t "$(holder_pid cluster)" -m -n -- \
            unshare --net --uts -- sh -c "hostname $n; exec sleep infinity" </dev/null >/dev/null 2>&1 &
        echo $! > "$STATE/run/$n.holder"
        for _ in $(seq 50); do
            [[ "$(cat /proc/$!/comm 2>/dev/null)" == sleep ]] && break
            sleep 0.1
        done
        in_cluster ip link add "v-$n" type veth peer name eth0 netns "$(holder_pid "$n")"
        in_cluster ip link set "v-$n" master br0 up
        nsenter -t "$(holder_pid "$n")" -n -- ip addr add "$(node_addr "$n")/24" dev eth0
        nsenter -t "$(holder_pid "$n")" -n -- ip link set eth0 up
        nsenter -t "$(holder_pid "$n")" -n -- ip link set lo up
    done

    # munge: our own key and socket, nothing shared with a system munged.
    dd if=/dev/urandom of="$STATE/etc/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/etc/munge.key"
    start_daemon munged nsenter -t "$(holder_pid cluster)" -m -n -- munged --foreground --force \
        --key-file="$STATE/etc/munge.key" --socket="$STATE/run/munge.socket" \
        --pid-file="$STATE/run/munged.pid.file" --log-file="$STATE/log/munged.log" \
        --seed-file="$STATE/run/munge.seed"
    for _ in $(seq 50); do [[ -S "$STATE/run/munge.socket" ]] && break; sleep 0.1; done
    [[ -S "$STATE/run/munge.socket" ]] || die "munged did not start; see $STATE/log/munged.out"

    start_daemon slurmctld nsenter -t "$(holder_pid cluster)" -m -n -- \
        env SLURM_CONF="$CONF" unshare --uts -- \
        sh -c "hostname $CTL_HOST; exec slurmctld -D -i -f '$CONF'"
    for n in "${NODES[@]}"; do
        start_daemon "slurmd-$n" nsenter -t "$(holder_pid "$n")" -m -n -u -- \
            env SLURM_CONF="$CONF" slurmd -D -N "$n" -f "$CONF"
    done
    for _ in $(seq 150); do
        local idle
        idle=$(in_cluster sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)
        [[ "$idle" -eq ${#NODES[@]} ]] && { log "up: ${NODES[*]} idle (state: $STATE)"; return; }
        sleep 0.2
    done
    in_cluster sinfo -N >&2 || true
    die "the nodes did not become idle within 30 s; logs in $STATE/log"
}

# Every process inside one of our namespaces: the daemons, the jobs' tasks.
our_pids() {
    local ns_ids=() pid
    for name in cluster "${NODES[@]}"; do
        pid=$(holder_pid "$name")
        alive "$pid" && ns_ids+=("$(readlink "/proc/$pid/ns/net")")
    done
    [[ ${#ns_ids[@]} -eq 0 ]] && return 0
    for dir in /proc/[0-9]*; do
        local ns
        ns=$(readlink "$dir/ns/net" 2>/dev/null) || continue
        for id in "${ns_ids[@]}"; do
            if [[ "$ns" == "$id" ]]; then echo "${dir#/proc/}"; break; fi
        done
    done
}

down() {
    [[ -d "$STATE/run" ]] || { log "nothing to stop in $STATE"; return; }
    # Daemons first, politely, so slurmd can reap its job steps.
    for name in slurmd-node9 slurmd-node10 slurmctld munged; do
        local pid
        pid=$(cat "$STATE/run/$name.pid" 2>/dev/null || true)
        alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
    done
    for _ in $(seq 50); do
        local left=0
        for name in slurmd-node9 slurmd-node10 slurmctld munged; do
            alive "$(cat "$STATE/run/$name.pid" 2>/dev/null || true)" && left=1
        done
        [[ $left -eq 0 ]] && break
        sleep 0.1
    done
    # Then whatever is left in the namespaces (job tasks, holders); the
    # namespaces, the bridge, the veths and the hosts bind mount go with them.
    for _ in 1 2 3; do
        local pids
        pids=$(our_pids)
        [[ -z "$pids" ]] && break
        kill -KILL $pids 2>/dev/null || true
        sleep 0.2
    done
    for name in cluster "${NODES[@]}"; do
        local pid
        pid=$(holder_pid "$name")
        alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
        rm -f "$STATE/run/$name.holder"
    done
    log "down (logs kept in $STATE/log)"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    exec)
        shift
        [[ "${1:-}" == "--" ]] && shift
        [[ $# -gt 0 ]] || die "usage: $0 exec -- COMMAND [ARGS...]"
        alive "$(holder_pid cluster)" || die "no local cluster is up in $STATE; run '$0 up' first"
        in_cluster "$@"
        ;;
    install) install_slurm ;;
    *) die "usage: $0 up|down|exec -- COMMAND...|install  (state: \$SLURM_LOCAL_DIR, default /tmp/slurm-local)" ;;
esac
