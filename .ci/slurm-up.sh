#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/test_export_job.py: munged, slurmctld and slurmd on localhost,
# the node's CPUs (at most 2), no cgroups, state and logs under /tmp/nbtrain-slurm. Waits until sinfo shows the
# node idle. Run as root (or with sudo); safe to run again (daemons already up are left running).
#
#     .ci/slurm-up.sh            # installs Debian's slurmctld, slurmd, slurm-client and munge first when missing
#     .ci/slurm-up.sh --down     # stops the daemons it started
#
# It never touches a Slurm it did not configure: if /etc/slurm/slurm.conf exists and was not written by this script,
# this machine already belongs to a cluster, and the script stops with a line saying so.
set -euo pipefail

HERE=/tmp/nbtrain-slurm
CONF=/etc/slurm/slurm.conf
MARK="# written by nbtrain's .ci/slurm-up.sh"
sudo=$([ "$(id -u)" = 0 ] || echo sudo)

stop() {  # only the daemons whose pid files this script's configuration names
    for pidfile in "$HERE/slurmd.pid" "$HERE/slurmctld.pid"; do
        [ -f "$pidfile" ] && $sudo kill "$(cat "$pidfile")" 2>/dev/null || true
    done
}
if [ "${1:-}" = "--down" ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    echo "slurm-up: installing slurmctld, slurmd, slurm-client and munge (Debian's slurm-wlm 22.05)"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "slurm-up: $CONF exists and was not written by this script: this machine has a Slurm of its own; use it" >&2
    exit 1
fi

cpus=$(nproc); [ "$cpus" -gt 2 ] && cpus=2
$sudo mkdir -p "$HERE/state" "$HERE/spool" /etc/slurm
$sudo tee "$CONF" >/dev/null <<EOF
$MARK: a one-node cluster for tests
ClusterName=nbtrain
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits one credential lifetime before it starts again (120 s by default): tests requeue one
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$HERE/state
SlurmdSpoolDir=$HERE/spool
SlurmctldPidFile=$HERE/slurmctld.pid
SlurmdPidFile=$HERE/slurmd.pid
SlurmctldLogFile=$HERE/slurmctld.log
SlurmdLogFile=$HERE/slurmd.log
# no cgroups: processes are tracked by their parent pids, and nothing is confined
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# look at pending jobs every 2 s (60 by default): a requeued job becomes eligible on a timer, not an event
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
KillWait=10
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

# munge: the key Debian's package made, a socket folder its user owns; munged runs as that user
if ! pgrep -u munge -x munged >/dev/null; then
    $sudo mkdir -p /run/munge /var/log/munge /var/lib/munge
    $sudo chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [ -f /etc/munge/munge.key ] || $sudo /usr/sbin/mungekey --create
    $sudo chown munge:munge /etc/munge/munge.key && $sudo chmod 400 /etc/munge/munge.key
    $sudo runuser -u munge -- /usr/sbin/munged
fi

running() { [ -f "$1" ] && $sudo kill -0 "$(cat "$1")" 2>/dev/null; }
running "$HERE/slurmctld.pid" || $sudo /usr/sbin/slurmctld -i
running "$HERE/slurmd.pid" || $sudo /usr/sbin/slurmd -N localhost

for _ in $(seq 60); do
    state=$(sinfo -h -N -n localhost -o %t 2>/dev/null || true)
    case "$state" in
        idle*|mix*|alloc*) echo "slurm-up: node localhost is $state ($cpus CPUs); logs in $HERE"; exit 0 ;;
        drain*|down*) $sudo scontrol update nodename=localhost state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "slurm-up: the node did not come up within 60 s; see $HERE/slurmctld.log and $HERE/slurmd.log" >&2
sinfo -N >&2 || true
exit 1
