#!/bin/bash
# A node-local health gate in the style of a Slurm Prolog (or a cron health check): run
# ddpdoctor on this node's GPUs alone, and drain the node when it is not healthy. It cannot
# see other nodes (no job spans them yet), so multi-node checks stay in the job script.
# Install: Prolog=/etc/slurm/prolog.d/ddpdoctor.sh in slurm.conf (PrologFlags=Alloc), or run it
# from your health-check tool. A non-zero exit from a Prolog fails the launch and Slurm
# requeues the job elsewhere.
set -uo pipefail
NODE=$(hostname -s)
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
REPORT=${DDPDOCTOR_REPORT:-/var/log/ddpdoctor/$NODE-${SLURM_JOB_ID:-manual}.json}
mkdir -p "$(dirname "$REPORT")"

# ddpdoctor-preflight:
ddpdoctor check --nproc "${GPUS:-1}" --timeout 30 --no-live --json "$REPORT" >/dev/null
status=$?

if [ "$status" -ge 2 ]; then
    reason=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); f=[x for x in r["findings"] if x["severity"]=="critical"]; print(("ddpdoctor " + f[0]["code"] + ": " + f[0]["title"])[:120] if f else "ddpdoctor: exit %s" % r["exit_code"])' "$REPORT" 2>/dev/null || echo "ddpdoctor: exit $status")
    scontrol update nodename="$NODE" state=drain reason="$reason" 2>/dev/null || true
    exit 1
fi
exit 0
