#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the tests (CPU only, no cgroups, no accounting database).
#
#   bash tests/slurm/cluster.sh install   # Debian's slurm-wlm, munge and shellcheck (needs root and apt-get)
#   bash tests/slurm/cluster.sh start     # write the config, start munged, slurmctld and slurmd (idempotent)
#   bash tests/slurm/cluster.sh stop
#
# Everything lives in $SLURM_TEST_DIR (default /tmp/collab-vit-slurm); clients find the cluster through
# SLURM_CONF=$SLURM_TEST_DIR/slurm.conf, which the tests set. Nothing under /etc is changed.
set -euo pipefail

dir=${SLURM_TEST_DIR:-/tmp/collab-vit-slurm}
conf=$dir/slurm.conf
packages=(slurm-wlm munge shellcheck)

install() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    command -v shellcheck >/dev/null || missing+=(shellcheck)
    [[ ${#missing[@]} -eq 0 ]] && { echo "slurm test cluster: ${packages[*]} already installed"; return 0; }
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "slurm test cluster: cannot install ${missing[*]} (needs root and apt-get)" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
    echo "slurm test cluster: installed ${missing[*]}"
}

write_config() {
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
    cat >"$conf" <<CONF
ClusterName=collabvit-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SchedulerParameters=sched_interval=2
AuthInfo=cred_expire=10
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

start() {
    command -v slurmctld >/dev/null || { echo "slurm test cluster: slurm-wlm is not installed (run: $0 install)" >&2; exit 1; }
    write_config
    export SLURM_CONF=$conf
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge /var/lib/munge /var/log/munge
        [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
        chmod 0400 /etc/munge/munge.key
        munged --force
    fi
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    for _ in $(seq 60); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "slurm test cluster: up ($conf)"
            return 0
        fi
        scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
        sleep 1
    done
    echo "slurm test cluster: the node did not become idle; see $dir/log/" >&2
    sinfo >&2 || true
    exit 1
}

stop() {
    pkill -x slurmd || true
    pkill -x slurmctld || true
}

case ${1:-start} in
    install) install ;;
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
