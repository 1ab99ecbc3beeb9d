#!/bin/bash
# node-setup: makes a Trainium node fit for ECS tasks, on its first boot (from user data) and on
# every later boot (node-setup.service, ordered before ecs.service). Each step is idempotent.
#
#   node-setup          the IMDS block rule, EFA, every device the unit tasks are given, the model cache
#                       on the instance store, ecs.config
#   node-setup report   put NodeSetupFailed (or NodeAgentUnregistered, `unregistered`) =1 to CloudWatch; once
#                       the agent registered, stop the report timer until the next boot
#
# A failed step keeps the node out of service instead of powering it off: the ECS agent is not
# started (ecs.service requires node-setup.service and /run/node-setup/ready), the reason goes to
# the serial console and the journal and stays in /var/lib/node-setup/failed, and a timer reports
# NodeSetupFailed every 3 minutes (the cell's node-setup alarm, part of the rollout gate). The
# instance keeps running with passing EC2 status checks, so Auto Scaling does not replace it
# (https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-health-checks.html):
# no launch-and-kill loop; an operator reads the reason and terminates or repairs it
# (docs/cell-lifecycle.md, "Failed node setup").
set -uo pipefail

CONF=/etc/node-setup/node-setup.conf
# shellcheck source=/dev/null
. "$CONF" || { echo "node-setup: cannot read $CONF" >&2; exit 1; }

STATE_DIR=/var/lib/node-setup
FAILED="$STATE_DIR/failed"
READY_DIR=/run/node-setup
READY="$READY_DIR/ready"
REGISTERED="$READY_DIR/registered"
IMDS=http://169.254.169.254/latest
# Network steps (the EFA installer's download and run, mdadm's install) try again every
# NETWORK_RETRY_SECONDS within one budget of waits for the whole setup: a late NAT route, security
# group rule or mirror must not fail a first boot for good (docs/cell-lifecycle.md).
NETWORK_RETRY_SECONDS=60
NETWORK_RETRY_BUDGET=540
TRIES=0

# To the serial console (EC2 GetConsoleOutput) and the journal; never fails the setup itself.
log() {
  echo "node-setup: $*" | tee -a /dev/console | systemd-cat -t node-setup
  return 0
}

# /proc/self/mounts rather than util-linux's mountpoint, one dependency fewer.
cache_mounted() {
  awk -v mp="$MODEL_CACHE" '$2 == mp {found = 1} END {exit !found}' /proc/self/mounts
}

fail() {
  mkdir -p "$STATE_DIR"
  printf '%s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >"$FAILED"
  rm -f "$READY"
  log "FAILED: $*; the node stays out of service (ECS agent not started) until an operator acts"
  # A later boot: the agent may run already (not on the first boot: ecs.service starts after cloud-final).
  systemctl stop ecs.service >/dev/null 2>&1
  systemctl enable --now node-setup-report.timer >/dev/null 2>&1 || log "cannot start node-setup-report.timer"
  exit 1
}

# retry <what> <command...>: until it succeeds or the budget is spent; TRIES: how many runs.
retry() {
  local what=$1
  shift
  TRIES=1
  until "$@"; do
    [ "$NETWORK_RETRY_BUDGET" -ge "$NETWORK_RETRY_SECONDS" ] || return 1
    NETWORK_RETRY_BUDGET=$((NETWORK_RETRY_BUDGET - NETWORK_RETRY_SECONDS))
    log "$what failed (try $TRIES); trying again in ${NETWORK_RETRY_SECONDS}s (${NETWORK_RETRY_BUDGET}s of retries left)"
    sleep "$NETWORK_RETRY_SECONDS"
    TRIES=$((TRIES + 1))
  done
}

after_tries() {
  echo "$TRIES tries, the setup's retry time spent"
}

# Containers share the host network (EFA), so the hop limit cannot keep them from IMDS and the
# instance role: refuse IMDS to every socket of an ECS task's cgroup. The slice is a unit of its
# own, started here and never stopped: the cgroup match binds the cgroup object when the rule is
# inserted (xt_cgroup), so a slice removed and made again would escape the rule.
block_imds() {
  systemctl start "$TASKS_SLICE" || fail "cannot start $TASKS_SLICE (the task cgroup)"
  local rule=(OUTPUT -d "$IMDS_ADDRESS/32" -m cgroup --path "$TASKS_SLICE" -j REJECT)
  iptables -C "${rule[@]}" 2>/dev/null || iptables -I "${rule[@]}" || fail 'cannot block IMDS for task containers'
}

efa_ok() {
  /opt/amazon/efa/bin/fi_info -p efa >/dev/null 2>&1
}

# Retried as a whole (its dnf installs reach the network); it skips what an earlier try installed.
efa_installer() {
  (cd aws-efa-installer && ./efa_installer.sh -y)
}

# EFA: the AMI's own, or the pinned installer verified by its SHA-256 before it runs. A download
# that cannot connect in 10 s, stalls (under 10 KB/s for a minute) or takes 10 minutes is a failed try.
ensure_efa() {
  # fi_info opens every verbs device: wait for udev to make them
  udevadm settle --timeout=60 >/dev/null 2>&1
  efa_ok && return 0
  [ -n "$EFA_INSTALLER_SHA256" ] || fail 'the AMI has no EFA and node.efa_installer_sha256 is null'
  local tarball="aws-efa-installer-$EFA_INSTALLER_VERSION.tar.gz" work
  work=$(mktemp -d) || fail 'no temporary directory for the EFA installer'
  cd "$work" || fail "cannot enter $work"
  retry 'EFA installer download' curl -fsSL --connect-timeout 10 --speed-limit 10240 --speed-time 60 \
    --max-time 600 \
    -o "$tarball" "https://efa-installer.amazonaws.com/$tarball" \
    || fail "EFA installer download failed ($tarball; $(after_tries))"
  echo "$EFA_INSTALLER_SHA256  $tarball" | sha256sum -c - >/dev/null 2>&1 \
    || fail "EFA installer checksum mismatch ($tarball is not node.efa_installer_sha256)"
  tar -xf "$tarball" || fail 'EFA installer unpack failed'
  retry 'EFA install' efa_installer || fail "EFA install failed ($(after_tries))"
  cd / && rm -rf "$work"
  efa_ok || fail 'EFA installed but fi_info finds no efa provider'
}

# Every device the unit task definitions pass to Docker (TASK_DEVICES: each /dev/neuronN and
# /dev/infiniband/uverbsN of the instance type), as a character device. fi_info above needs one EFA
# device; Docker refuses to create a container when any --device host path is missing or is not a
# device ("error gathering device information while adding custom device ...": moby/moby
# oci/devices_linux.go DevicesFromPath at 65a289dc62cc572cfd1ae6c56ef5f8097fdd6a4c). A node short of
# one would register, take a unit and fail every task at container creation, before the launcher's
# own self check runs. udev makes the nodes after the drivers probe: wait for its queue, then up to
# DEVICE_WAIT_SECONDS more.
missing_devices() {
  local device
  for device in $TASK_DEVICES; do
    [ -c "$device" ] || printf '%s ' "$device"
  done
}

task_devices() {
  local missing waited=0
  udevadm settle --timeout=60 >/dev/null 2>&1
  missing=$(missing_devices)
  while [ -n "$missing" ] && [ "$waited" -lt "$DEVICE_WAIT_SECONDS" ]; do
    sleep 5
    waited=$((waited + 5))
    missing=$(missing_devices)
  done
  [ -z "$missing" ] && return 0
  fail "task device(s) missing: ${missing% } (the unit tasks pass all $(echo "$TASK_DEVICES" | wc -w)" \
    "to Docker, which creates no container whose device is missing)"
}

# The model cache: every NVMe instance-store disk (attached automatically on Nitro instances), as
# one RAID0 when there are several, XFS labelled $CACHE_LABEL, in fstab and mdadm.conf so a reboot
# brings it back: node-setup assembles and mounts it itself on every boot. The fstab line is
# `noauto`: without it systemd makes its own mount unit of it, which waits for the label (its device
# timeout, systemd.mount(5) "x-systemd.device-timeout=", DefaultDeviceTimeoutSec 90 s by default)
# while `nofail` keeps local-fs.target, and so node-setup, from waiting for it (systemd.mount(5),
# "nofail"); after a stop and start node-setup made the file system anew and systemd's job
# mounted it under node-setup's own mount, which failed "already mounted". After a stop and
# start the disks are blank: the cache is made anew (it is only a cache).
model_cache() {
  if ! cache_mounted; then
    [ -e /etc/mdadm.conf ] && mdadm --assemble --scan >/dev/null 2>&1
    if ! { grep -q "^LABEL=$CACHE_LABEL " /etc/fstab 2>/dev/null && { mount "$MODEL_CACHE" 2>/dev/null || cache_mounted; }; }; then
      build_cache
    fi
  fi
  [ -e "$MODEL_CACHE/$CACHE_MARKER" ] || build_cache
  log "model cache $MODEL_CACHE: $(cat "$MODEL_CACHE/$CACHE_MARKER")"
}

build_cache() {
  local disks count cache_dev
  cache_mounted && { umount "$MODEL_CACHE" || fail "cannot unmount $MODEL_CACHE"; }
  disks=$(lsblk -dnpo NAME,MODEL | awk '/Amazon EC2 NVMe Instance Storage/ {print $1}')
  count=$(echo "$disks" | wc -w)
  [ "$count" -ge 1 ] || fail 'no NVMe instance-store disk for the model cache'
  if [ "$count" -gt 1 ]; then
    # mdadm is not in the Neuron ECS AMI: installed from the AMI's release-locked repository.
    command -v mdadm >/dev/null || retry 'mdadm install' dnf install -y mdadm >/dev/null \
      || fail "mdadm install failed ($(after_tries))"
    mdadm --stop "/dev/md/$CACHE_LABEL" >/dev/null 2>&1
    # shellcheck disable=SC2086 # one word per disk
    mdadm --create "/dev/md/$CACHE_LABEL" --name="$CACHE_LABEL" --run --level=0 --raid-devices="$count" $disks \
      || fail 'RAID0 assembly failed'
    mdadm --detail --brief "/dev/md/$CACHE_LABEL" >/etc/mdadm.conf || fail 'cannot write /etc/mdadm.conf'
    cache_dev="/dev/md/$CACHE_LABEL"
  else
    cache_dev=$disks
  fi
  mkfs.xfs -f -L "$CACHE_LABEL" "$cache_dev" >/dev/null || fail 'mkfs of the model cache failed'
  sed -i "\\|^LABEL=$CACHE_LABEL |d" /etc/fstab || fail 'cannot edit /etc/fstab'
  echo "LABEL=$CACHE_LABEL $MODEL_CACHE xfs noatime,noauto,nofail 0 2" >>/etc/fstab || fail 'cannot edit /etc/fstab'
  { mkdir -p "$MODEL_CACHE" && { mount "$MODEL_CACHE" || cache_mounted; }; } || fail 'mounting the model cache failed'
  chmod 0775 "$MODEL_CACHE"
  # The launcher fetches only into a cache that has this file (unit_launcher/cache_check.py).
  echo "instance store, $count NVMe disk(s) on $cache_dev" >"$MODEL_CACHE/$CACHE_MARKER" \
    || fail 'cannot write the model cache marker'
}

# Host network mode: give tasks their task role, not the instance role; the awslogs driver their
# execution role's credentials (ecs-init's default, written down: the instance role may write only
# to the cell's log groups, TrainiumCapacity.allow_awslogs). Task cgroups set: else the agent may
# run tasks outside ecstasks.slice (docs). The capacity provider's user data appends ECS_CLUSTER.
ecs_config() {
  local line
  mkdir -p /etc/ecs || fail 'cannot create /etc/ecs'
  for line in ECS_ENABLE_TASK_IAM_ROLE=true ECS_ENABLE_TASK_IAM_ROLE_NETWORK_HOST=true \
    ECS_ENABLE_AWSLOGS_EXECUTIONROLE_OVERRIDE=true ECS_IMAGE_PULL_BEHAVIOR=prefer-cached \
    ECS_ENABLE_TASK_CPU_MEM_LIMIT=true; do
    grep -qxF "$line" /etc/ecs/ecs.config 2>/dev/null || echo "$line" >>/etc/ecs/ecs.config \
      || fail 'cannot write /etc/ecs/ecs.config'
  done
}

setup() {
  # A re-run (an operator's, after a repair) judges the agent anew: an old record would keep one that never comes
  # back from being reported.
  rm -f "$READY" "$REGISTERED"
  if [ -e "$FAILED" ]; then
    # Stay out of service across reboots: an operator clears the record to try again.
    log "an earlier setup failed ($(cat "$FAILED")); remove $FAILED and start node-setup.service to retry"
    systemctl enable --now node-setup-report.timer >/dev/null 2>&1
    exit 1
  fi
  block_imds
  ensure_efa
  task_devices
  model_cache
  ecs_config
  { mkdir -p "$READY_DIR" && touch "$READY"; } || fail "cannot write $READY"
  systemctl enable --now node-setup-report.timer >/dev/null 2>&1
  log "done"
}

# Set up AGENT_GRACE_SECONDS ago, the ECS agent not seen registered since (its introspection API: its ARN).
unregistered() {
  [ -e "$READY" ] && [ ! -e "$REGISTERED" ] || return 1
  if grep -q '"ContainerInstanceArn": *"arn:' <<<"$(curl -fs -m 5 http://localhost:51678/v1/metadata)"; then
    touch "$REGISTERED"
    return 1
  fi
  [ $(($(date +%s) - $(stat -c %Y "$READY"))) -ge "$AGENT_GRACE_SECONDS" ] || return 1
  log "ECS agent not registered: $(systemctl show -p ActiveState,ExecMainStatus,NRestarts ecs | tr '\n' ' ')"
}

# The agent registered this boot and the setup has not failed: nothing is left to report until the next boot, so the
# timer stops rather than run this every 3 minutes for good. Stopped, not disabled: it stays enabled, so the next
# boot starts it (timers.target) with /run, and so the record, empty: that boot's agent is judged anew. --no-block:
# the stop job is queued, not waited for, from the very service the timer started; stopping a timer leaves the
# service it started running (Triggers= propagates no stop), so this run ends as it would have.
quiet_until_next_boot() {
  [ -e "$REGISTERED" ] || return 0
  if systemctl --no-block stop node-setup-report.timer; then
    log "ECS agent registered; node-setup-report.timer stopped until the next boot"
  else
    log "ECS agent registered; cannot stop node-setup-report.timer"
  fi
}

# CloudWatch PutMetricData (query API) signed by curl with the instance role's credentials.
report() {
  local metric=NodeSetupFailed token region domain role creds key secret session
  [ -e "$FAILED" ] || { unregistered || { quiet_until_next_boot; return 0; }; metric=NodeAgentUnregistered; }
  token=$(curl -fsS -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' "$IMDS/api/token") || return 1
  imds() { curl -fsS -H "X-aws-ec2-metadata-token: $token" "$IMDS/meta-data/$1"; }
  region=$(imds placement/region) && domain=$(imds services/domain) \
    && role=$(imds iam/security-credentials/) && creds=$(imds "iam/security-credentials/$role") || return 1
  field() { echo "$creds" | sed -n "s/.*\"$1\" *: *\"\\([^\"]*\\)\".*/\\1/p"; }
  key=$(field AccessKeyId) && secret=$(field SecretAccessKey) && session=$(field Token)
  curl -fsS --aws-sigv4 "aws:amz:$region:monitoring" --user "$key:$secret" \
    -H "x-amz-security-token: $session" \
    --data-urlencode Action=PutMetricData --data-urlencode Version=2010-08-01 \
    --data-urlencode "Namespace=$METRIC_NAMESPACE" \
    --data-urlencode "MetricData.member.1.MetricName=$metric" \
    --data-urlencode MetricData.member.1.Value=1 \
    --data-urlencode MetricData.member.1.Dimensions.member.1.Name=Cell \
    --data-urlencode "MetricData.member.1.Dimensions.member.1.Value=$CELL" \
    "https://monitoring.$region.$domain/" >/dev/null
}

case "${1:-setup}" in
  setup) setup ;;
  report) report ;;
  *) echo "usage: node-setup [setup|report]" >&2; exit 2 ;;
esac
