#!/bin/bash
# compile-host-setup: keeps the compile job's container from the instance metadata service (IMDS),
# on the compile instance's first boot (from user data) and every later boot (compile-host-setup.service,
# ordered before ecs.service). Idempotent.
#
# Batch runs the job's container in host network mode, where the launch template's hop limit of 1
# stops nothing (IMDS is no hop away), and the ECS agent, also a root container in host network mode,
# needs IMDS: neither the network nor the user (uid 0 both) tells them apart; the cgroup does. The agent
# puts every task container under ecstasks.slice (TASK_SLICE); its own container is in Docker's
# system.slice scope. So: REJECT IMDS for sockets of that slice only (docs/compiled-artifacts.md).
#
# A failure exits 1 naming the step, and the ECS agent is not started (ecs.service's drop-in needs
# compile-host-setup.service and the ready file only a successful run writes): the instance never takes
# the job, which stays RUNNABLE; the reason is on the console (EC2 GetConsoleOutput) and in the journal.
set -uo pipefail

CONF=/etc/compile-host-setup.conf
# shellcheck source=/dev/null
. "$CONF" || { echo "compile-host-setup: FAILED: cannot read $CONF" >&2; exit 1; }

READY_DIR=/run/compile-host-setup
READY="$READY_DIR/ready"

fail() {
  rm -f "$READY"
  echo "compile-host-setup: FAILED: $*; the ECS agent stays off, so no job runs on this instance" >&2
  exit 1
}

# The agent degrades to no task cgroup when the setting is only defaulted and it finds an old Docker or
# tasks of an old state file (amazon-ecs-agent agent/app/agent_capability.go, agent_compatibility_linux.go);
# set explicitly, it refuses to start instead. Without the task cgroup the rule below matches nothing.
ecs_config() {
  mkdir -p /etc/ecs || fail 'cannot create /etc/ecs'
  grep -qxF "$ECS_CGROUP_SETTING" /etc/ecs/ecs.config 2>/dev/null \
    || echo "$ECS_CGROUP_SETTING" >>/etc/ecs/ecs.config || fail 'cannot write /etc/ecs/ecs.config'
}

# The cgroup match binds the cgroup when the rule is inserted (xt_cgroup), so the slice must exist first
# and must never be removed: a unit of its own, started here and never stopped.
block_imds() {
  systemctl start "$TASK_SLICE" || fail "cannot start $TASK_SLICE (the cgroup of the ECS task containers)"
  local rule=(OUTPUT -d "$IMDS_ADDRESS/32" -m cgroup --path "$TASK_SLICE" -j REJECT)
  iptables -C "${rule[@]}" 2>/dev/null || iptables -I "${rule[@]}" \
    || fail "cannot block IMDS for ECS task containers (iptables -I ${rule[*]})"
}

rm -f "$READY"
ecs_config
block_imds
{ mkdir -p "$READY_DIR" && touch "$READY"; } || fail "cannot write $READY"
echo "compile-host-setup: IMDS ($IMDS_ADDRESS) refused to the ECS task cgroup $TASK_SLICE"
