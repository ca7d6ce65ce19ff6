#!/bin/bash
# A node-local health gate in the style of a Slurm Prolog (or a cron health check): run
# ddpdoctor on this job's GPUs of this node alone, and drain the node when the check finds
# something critical. It cannot see other nodes (no job spans them yet), so multi-node checks
# stay in the job script. Install: Prolog=/etc/slurm/prolog.d/ddpdoctor.sh in slurm.conf
# (with PrologFlags=Alloc), or run it from your health-check tool. A non-zero exit from a
# Prolog fails the launch and Slurm requeues the job elsewhere.
set -uo pipefail
NODE=${SLURMD_NODENAME:-$(hostname -s)}  # the name scontrol knows the node by
# Only the GPUs Slurm gave this job (others on a shared node belong to other jobs).
if [ -n "${SLURM_JOB_GPUS:-}" ]; then
    export CUDA_VISIBLE_DEVICES=$SLURM_JOB_GPUS
    GPUS=$(echo "$SLURM_JOB_GPUS" | tr ',' '\n' | grep -c .)
else
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')  # MIG lines start with two spaces
fi
[ "${GPUS:-0}" -ge 1 ] || GPUS=2  # no GPU: two CPU ranks still check the host and gloo
REPORT=${DDPDOCTOR_REPORT:-/var/log/ddpdoctor/$NODE-${SLURM_JOB_ID:-manual}-$(date +%s).json}
mkdir -p "$(dirname "$REPORT")"

# ddpdoctor-preflight:
ddpdoctor check --nproc "$GPUS" --timeout 30 --no-live --json "$REPORT" >/dev/null
status=$?

case $status in
    0|1) exit 0 ;;
    2)  # critical: drain with the first critical finding as the reason
        reason=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); f=[x for x in r["findings"] if x["severity"]=="critical"]; print(("ddpdoctor " + f[0]["code"] + ": " + f[0]["title"])[:120] if f else "ddpdoctor: exit 2")' "$REPORT" 2>/dev/null || echo "ddpdoctor: exit 2")
        scontrol update nodename="$NODE" state=drain reason="$reason" \
            || echo "ddpdoctor prolog: could not drain $NODE: $reason" >&2
        exit 1 ;;
    *)  # 3 (could not tell), 127 (ddpdoctor not on the Prolog's PATH), ...: the tool, not the node
        echo "ddpdoctor prolog: check did not run properly on $NODE (exit $status); node left in service" >&2
        exit 0 ;;
esac
