"""The compile job on AWS Batch: an EC2 compute environment of large-memory CPU instances, a job queue
and a job definition that runs `python -m unit_launcher compile` in the inference image.

Why Batch on EC2: the compile of a 405B layout needs about 1.2 TB of host memory and 2 TB of disk
for hours (inference_fleet.compile_job.host_needs); Fargate tasks stop at 120 GiB of memory
(16 vCPUs, https://docs.aws.amazon.com/AmazonECS/latest/developerguide/fargate-tasks-services.html) and
200 GiB of ephemeral storage (https://docs.aws.amazon.com/batch/latest/APIReference/API_EphemeralStorage.html),
and a managed EC2 compute environment with `minv_cpus` 0 keeps no instance between compiles
(https://docs.aws.amazon.com/batch/latest/userguide/compute_environment_parameters.html, minvCpus).
The job gets one instance of the types whose memory holds the need; the launch template gives its
root volume (where Docker keeps the container's writes and the job's volume) the disk need as
encrypted gp3 at full throughput, and requires IMDSv2 with a hop limit of 1 (no bridge-network container
reaches IMDS); its user data refuses IMDS to the job's own container, which is in host network mode
(compile_host_setup.sh, compile_host_user_data).
Instances have no public address, in isolated subnets that reach AWS through VPC endpoints only.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from aws_cdk import Duration, RemovalPolicy, Size, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct
from unit_launcher.artifacts import split_uri

from cell_constructs.compile_start_watch import CompileStartWatch
from cell_constructs.encryption import allow_cloudwatch_logs, artifacts_key_statement
from cell_constructs.nag import acknowledge
from cell_constructs.network import ECS_NODE_ENDPOINTS
from cell_constructs.trainium_capacity import ECS_TASKS_CGROUP, IMDS_ADDRESS, TASKS_SLICE_UNIT, heredoc
from inference_fleet import compile_job
from inference_fleet.config import FleetConfig, is_az_id
from inference_fleet.unit_spec import layout_key

# What the instances and the job reach, all through endpoints (no NAT, no internet): the image
# (ECR and its S3 layers, the S3 gateway endpoint), the ECS agent Batch runs on each instance,
# the job's logs: the ECS node set of a cell's network.
_INTERFACE_ENDPOINTS = ECS_NODE_ENDPOINTS
VPC_CIDR = "10.250.0.0/16"
# AWS Batch UpdatePolicy.jobExecutionTimeoutMinutes' maximum: botocore 1.44.18's Batch model (batch/2016-08-10,
# shape JobExecutionTimeoutMinutes: min 1, max 7200), as API_UpdatePolicy.html's current text.
UPDATE_TIMEOUT_MAX_MINUTES = 7200
ROOT_DEVICE = "/dev/xvda"  # the root device of the ECS-optimized Amazon Linux 2023 AMI

# The instance's boot script: user data installs and runs it, compile-host-setup.service runs it at every boot.
COMPILE_HOST_SETUP_SCRIPT = Path(__file__).with_name("compile_host_setup.sh")
COMPILE_HOST_READY = "/run/compile-host-setup/ready"
# Task cgroups on (the agent's default), set explicitly so that the agent refuses to start rather than run
# the job outside ecstasks.slice, where the IMDS rule would not match it (compile_host_setup.sh, ecs_config).
ECS_CGROUP_SETTING = "ECS_ENABLE_TASK_CPU_MEM_LIMIT=true"
# The setup before the ECS agent at every boot; the drop-in keeps the agent off unless this boot's setup
# succeeded (Requires + After for later boots; on the first boot ecs.service's start job is queued before
# user data writes the drop-in, and its condition is read when that job runs: after cloud-final, which runs
# user data, amazon-ecs-agent packaging/amazon-linux-ami-integrated/ecs.service at
# 8dfceca6cf380a83c3007349317566f2862f0673, "After=cloud-final.service").
_COMPILE_HOST_UNITS = {
    "/etc/systemd/system/compile-host-setup.service": """[Unit]
Description=Compile host setup (IMDS refused to ECS task containers) before the ECS agent
Before=ecs.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/compile-host-setup
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
""",
    "/etc/systemd/system/ecs.service.d/50-compile-host-setup.conf": f"""[Unit]
Requires=compile-host-setup.service
After=compile-host-setup.service
ConditionPathExists={COMPILE_HOST_READY}
""",
    f"/etc/systemd/system/{ECS_TASKS_CGROUP}": TASKS_SLICE_UNIT,
}


def compile_host_user_data() -> ec2.MultipartUserData:
    """The compute environment's user data: one bash part that installs compile_host_setup.sh, its
    configuration and units, then runs it (a failure is the part's exit status and message).

    MIME multi-part: "If you are creating the launch template for use with Batch, the user data must be
    provided in the MIME multi-part archive format" (EC2 API RequestLaunchTemplateData, UserData,
    https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RequestLaunchTemplateData.html; Batch merges it
    with its own, https://docs.aws.amazon.com/batch/latest/userguide/launch-templates.html). cloud-init runs a
    text/x-shellscript part as an executable, by its shebang: bash.
    """
    config = {"IMDS_ADDRESS": IMDS_ADDRESS, "TASK_SLICE": ECS_TASKS_CGROUP, "ECS_CGROUP_SETTING": ECS_CGROUP_SETTING}
    commands = [
        "set -euo pipefail",
        "mkdir -p /usr/local/sbin /etc/systemd/system/ecs.service.d",
        # The drop-in first: from then on the agent waits for this boot's setup to succeed.
        *[line for path, body in reversed(_COMPILE_HOST_UNITS.items()) for line in heredoc(path, body)],
        *heredoc("/etc/compile-host-setup.conf", "".join(f"{k}={shlex.quote(v)}\n" for k, v in config.items())),
        *heredoc("/usr/local/sbin/compile-host-setup", COMPILE_HOST_SETUP_SCRIPT.read_text(), mode="0755"),
        "systemctl daemon-reload",
        "systemctl enable compile-host-setup.service",
        "/usr/local/sbin/compile-host-setup",
    ]
    shell = ec2.UserData.for_linux()
    shell.add_commands(*commands)
    user_data = ec2.MultipartUserData()
    user_data.add_part(ec2.MultipartBody.from_raw_body(content_type='text/x-shellscript; charset="utf-8"',
                                                       body=shell.render()))
    return user_data


# A job that never gets an instance stays RUNNABLE: the job definition's attempt timeout counts from startedAt
# (https://docs.aws.amazon.com/batch/latest/userguide/job_timeouts.html). Batch cancels a job that has stayed
# RUNNABLE at the head of the queue for one of these reasons this long ("Jobs stuck in a RUNNABLE status",
# https://docs.aws.amazon.com/batch/latest/userguide/job_stuck_in_runnable.html; the reasons and limits, 600 to
# 86,400 s, state RUNNABLE, action CANCEL:
# https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-properties-batch-jobqueue-jobstatetimelimitaction.html).
# No capacity may come back: the fleet's start limit (compile_job.start_limit_hours), the bound the start watch
# (compile_start_watch.py) puts on every other reason, so a job Batch can explain is cancelled with Batch's reason.
# A compute environment too small for the job, or no instance type that fits it, never heals: the minimum, 10
# minutes. Unverified: that an instance quota (VcpuLimitExceeded) is reported as INSUFFICIENT_INSTANCE_CAPACITY;
# the guide says Batch infers it from the Auto Scaling group's scaling activities. A host whose setup failed
# matches none of the three: the start watch cancels it.
def runnable_time_limits(start_limit: Duration) -> list[batch.JobStateTimeLimitAction]:
    limits = (
        (batch.JobStateTimeLimitActionsReason.INSUFFICIENT_INSTANCE_CAPACITY, start_limit),
        (batch.JobStateTimeLimitActionsReason.COMPUTE_ENVIRONMENT_MAX_RESOURCE, Duration.minutes(10)),
        (batch.JobStateTimeLimitActionsReason.JOB_RESOURCE_REQUIREMENT, Duration.minutes(10)),
    )
    return [batch.JobStateTimeLimitAction(action=batch.JobStateTimeLimitActionsAction.CANCEL, max_time=limit,
                                          reason=reason, state=batch.JobStateTimeLimitActionsState.RUNNABLE)
            for reason, limit in limits]


class CompileBatch(Construct):
    """VPC, compute environment, job queue and job definition of the fleet's compile job."""

    def __init__(self, scope: Construct, construct_id: str, *, fleet: FleetConfig, image: ecs.ContainerImage,
                 availability_zones: list[str]) -> None:
        super().__init__(scope, construct_id)
        self.fleet = fleet
        self.needs = compile_job.host_needs(fleet)
        if not self.needs.instance_types:
            raise ValueError(f"fleet {fleet.name}: no compile instance type holds {self.needs.memory_gb:,.0f} GB; "
                             "see inference_fleet.compile_job.COMPILE_INSTANCE_TYPES")
        self.key = kms.Key(self, "Key", enable_key_rotation=True, removal_policy=RemovalPolicy.RETAIN,
                           description=f"{fleet.name} compile job: its log groups")
        allow_cloudwatch_logs(self.key)
        self.vpc = self._vpc(availability_zones)
        self.security_group = ec2.SecurityGroup(
            self, "InstanceSecurityGroup", vpc=self.vpc, allow_all_outbound=False,
            description="Compile instances: HTTPS out to the VPC endpoints and S3 only")
        # HTTPS to the interface endpoints and to S3's addresses: the isolated subnets route nothing
        # but the VPC and the S3 gateway endpoint's prefix list, so nothing else is reachable.
        self.security_group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443),
                                            "HTTPS: VPC interface endpoints, S3 through its gateway endpoint")
        self.compute_environment = self._compute_environment()
        self.job_queue = batch.JobQueue(
            self, "JobQueue", job_queue_name=compile_job.batch_name(fleet), priority=1,
            compute_environments=[batch.OrderedComputeEnvironment(
                compute_environment=self.compute_environment, order=1)],
            job_state_time_limit_actions=runnable_time_limits(Duration.hours(compile_job.start_limit_hours(fleet))))
        # Every other reason a job waits, a host whose setup failed among them: cancelled after the same limit.
        self.start_watch = CompileStartWatch(self, "StartWatch", queue_arn=self.job_queue.job_queue_arn,
                                             hours=compile_job.start_limit_hours(fleet), key=self.key)
        self.job_role = self._job_role()
        self.log_group = logs.LogGroup(self, "JobLogs", encryption_key=self.key,
                                       retention=logs.RetentionDays.THREE_MONTHS, removal_policy=RemovalPolicy.RETAIN)
        self.job_definition = self._job_definition(image)

    def _vpc(self, availability_zones: list[str]) -> ec2.Vpc:
        vpc = ec2.Vpc(
            self, "Vpc", ip_addresses=ec2.IpAddresses.cidr(VPC_CIDR), availability_zones=availability_zones,
            nat_gateways=0, subnet_configuration=[ec2.SubnetConfiguration(
                name="compile", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=20)])
        # AZ IDs (use2-az1) name the same physical zone in every account; subnets take them as
        # AvailabilityZoneId (https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-resource-ec2-subnet.html).
        for subnet in vpc.isolated_subnets:
            if is_az_id(subnet.availability_zone):
                cfn_subnet = subnet.node.default_child
                cfn_subnet.add_property_deletion_override("AvailabilityZone")
                cfn_subnet.add_property_override("AvailabilityZoneId", subnet.availability_zone)
        vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        endpoints = ec2.SecurityGroup(self, "EndpointSecurityGroup", vpc=vpc, allow_all_outbound=False,
                                      description="Interface endpoints: HTTPS from the compile VPC")
        endpoints.add_ingress_rule(ec2.Peer.ipv4(VPC_CIDR), ec2.Port.tcp(443), "HTTPS from the compile VPC")
        for name, service in _INTERFACE_ENDPOINTS.items():
            vpc.add_interface_endpoint(name, service=service, private_dns_enabled=True, security_groups=[endpoints],
                                       open=False)
        flow_logs = logs.LogGroup(self, "FlowLogs", encryption_key=self.key,
                                  retention=logs.RetentionDays.THREE_MONTHS, removal_policy=RemovalPolicy.RETAIN)
        flow_log = vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs),
                                    traffic_type=ec2.FlowLogTrafficType.ALL)
        acknowledge(flow_log, ("NIST.800.53.R5-IAMNoInlinePolicy",
                               "CDK-generated delivery policy of the flow log role, scoped to its one log group"))
        return vpc

    def _compute_environment(self) -> batch.ManagedEc2EcsComputeEnvironment:
        needs = self.needs
        launch_template = ec2.LaunchTemplate(
            self, "LaunchTemplate",
            # IMDSv2 only, and its token one hop: the ECS-optimized AL2023 AMI defaults to 2
            # (https://docs.aws.amazon.com/linux/al2023/ug/imdsv2.html), one more than a container behind the docker
            # bridge needs to take the instance role's credentials. It does not keep the job's own container from
            # IMDS: Batch runs ECS-EC2 single-node jobs in host network mode, the only mode it offers them
            # (https://docs.aws.amazon.com/batch/latest/userguide/networking-modes-jobs.html), where IMDS is no hop
            # away. The user data does: an iptables REJECT of IMDS for sockets of the ECS task cgroup, which holds
            # the job's container and not the ECS agent's (compile_host_setup.sh, docs/compiled-artifacts.md).
            # IMDS's IPv6 address (fd00:ec2::254) is off, the default ("By default, the IPv6 endpoint is disabled",
            # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-IMDS-existing-instances.html) written
            # down, and serves only instances with IPv6 addresses (https://docs.aws.amazon.com/whitepapers/latest/
            # ipv6-on-aws/supporting-amazon-vpc-services.html), which these subnets do not give: no ip6tables rule.
            # The job does not use IMDS: its one AWS client, boto3.client("s3")
            # (containers/inference/unit_launcher/compile_run.py main), takes the job role
            # from AWS_CONTAINER_CREDENTIALS_RELATIVE_URI, which the ECS agent sets in a container whose task has a
            # role (https://docs.aws.amazon.com/AmazonECS/latest/bestpracticesguide/security-iam-roles.html), and
            # botocore tries that provider before IMDS (botocore 1.44.8, the image's lock, credentials.py
            # create_credential_resolver: post_profile = [..., container_provider, instance_metadata_provider]);
            # its region is AWS_REGION (the job definition's environment).
            require_imdsv2=True,
            http_put_response_hop_limit=1,
            http_protocol_ipv6=False,
            user_data=compile_host_user_data(),
            # Batch's own example resizes and encrypts this device of its default AMI
            # (https://docs.aws.amazon.com/batch/latest/userguide/launch-templates.html). Encrypted with the
            # account's EBS key: Batch launches through an Auto Scaling group, whose service-linked role a
            # customer key would have to admit in its policy, and that role may not exist yet in a fresh account
            # (https://docs.aws.amazon.com/autoscaling/ec2/userguide/key-policy-requirements-EBS-encryption.html).
            block_devices=[ec2.BlockDevice(device_name=ROOT_DEVICE, volume=ec2.BlockDeviceVolume.ebs(
                needs.disk_gib, volume_type=ec2.EbsDeviceVolumeType.GP3, encrypted=True,
                iops=compile_job.GP3_IOPS, throughput=compile_job.GP3_THROUGHPUT_MIBPS, delete_on_termination=True))],
        )
        vcpus = min(compile_job.COMPILE_INSTANCE_TYPES[t][0] for t in needs.instance_types)
        environment = batch.ManagedEc2EcsComputeEnvironment(
            self, "ComputeEnvironment",
            vpc=self.vpc, vpc_subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_ISOLATED),
            instance_types=[ec2.InstanceType(t) for t in needs.instance_types], use_optimal_instance_classes=False,
            minv_cpus=0, maxv_cpus=max(compile_job.COMPILE_INSTANCE_TYPES[t][0] for t in needs.instance_types),
            images=[batch.EcsMachineImage(image_type=batch.EcsMachineImageType.ECS_AL2023)],
            launch_template=launch_template, security_groups=[self.security_group],
            allocation_strategy=batch.AllocationStrategy.BEST_FIT_PROGRESSIVE,
            # An infrastructure update (the pinned template version below, instance types, subnets, security group)
            # gives the jobs running on the old instances this long before it replaces them, 30 min unless set
            # (https://docs.aws.amazon.com/batch/latest/APIReference/API_UpdatePolicy.html). A compile runs for
            # hours: the job's own timeout, so a `<Fleet>-Compile` deploy during a compile no longer cuts it (a
            # defect hunt, thirty-fourth session). 1-7200 minutes (UPDATE_TIMEOUT_MAX_MINUTES; copies of the page
            # from before say 360). Unverified on AWS (docs/compiled-artifacts.md): whether CloudFormation's update
            # waits while the environment is UPDATING (then a deploy waits for a running compile: the trade chosen),
            # and whether the policy reaches Batch on the stack's create (CreateComputeEnvironment has no
            # updatePolicy member in botocore's model; UpdateComputeEnvironment has).
            update_timeout=Duration.minutes(min(needs.timeout_hours * 60, UPDATE_TIMEOUT_MAX_MINUTES)),
            terminate_on_update=False,
        )
        # Pin the template's version: Batch re-reads a launch template only on an infrastructure update, which a
        # change of the environment's LaunchTemplate starts (https://docs.aws.amazon.com/batch/latest/APIReference/
        # API_LaunchTemplateSpecification.html, "version"; https://docs.aws.amazon.com/AWSCloudFormation/latest/
        # UserGuide/aws-properties-batch-computeenvironment-launchtemplatespecification.html). With no version
        # (what the L2 construct renders, aws-cdk-lib 2.275 aws-batch/lib/managed-compute-environment.ts), a new
        # template version (a bigger disk) changes no property of the environment and is never used.
        environment.node.default_child.add_property_override("ComputeResources.LaunchTemplate.Version",
                                                               launch_template.latest_version_number)
        self.vcpus = vcpus
        acknowledge(environment.instance_role, (
            "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
            "AmazonEC2ContainerServiceforEC2Role]",
            "The ECS container instance role AWS Batch documents for EC2 compute environments "
            "(https://docs.aws.amazon.com/batch/latest/userguide/instance_IAM_role.html): the ECS agent's own calls; "
            "the job's S3 access is the job role's"))
        return environment

    def _job_role(self) -> iam.Role:
        """Read the checkpoint (the artifacts prefix), write only this layout's folder under it."""
        model = self.fleet.model
        s3 = f"arn:{Stack.of(self).partition}:s3:::"
        bucket, prefix = split_uri(model.artifacts_s3_uri)
        layout = f"{prefix}neuron/{layout_key(self.fleet)}/"
        role = iam.Role(self, "JobRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
                        description=f"{self.fleet.name} compile job: read the checkpoint, write the layout {layout}")
        role.add_to_policy(iam.PolicyStatement(actions=["s3:ListBucket"], resources=[f"{s3}{bucket}"],
                                               conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}}))
        # GetObjectAttributes: the parts of a multipart checkpoint file, whose checksums the fetch compares
        # (unit_launcher/artifacts.py `_verify`); without a version ID it needs s3:GetObject and this.
        role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject", "s3:GetObjectAttributes"],
                                               resources=[f"{s3}{bucket}/{prefix}*"]))
        # Shards are uploaded in parts (boto3's transfer manager), which it aborts when an upload fails.
        role.add_to_policy(iam.PolicyStatement(actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                                               resources=[f"{s3}{bucket}/{layout}*"]))
        # An SSE-KMS bucket's customer key: read the checkpoint, write (in parts) the layout.
        key = artifacts_key_statement(model, ["kms:Decrypt", "kms:GenerateDataKey"])
        if key is not None:
            role.add_to_policy(key)
        acknowledge(
            role,
            (f"AwsSolutions-IAM5[Resource::{s3}{bucket}/{prefix}*]",
             "The job reads every checkpoint file under the model's artifacts prefix (names vary by model)"),
            (f"AwsSolutions-IAM5[Resource::{s3}{bucket}/{layout}*]",
             "The job writes the files of its one layout folder (model.pt, one shard per rank, the manifest)"),
            ("NIST.800.53.R5-IAMNoInlinePolicy", "Policy of this role only, versioned with this stack"),
        )
        return role

    def _job_definition(self, image: ecs.ContainerImage) -> batch.EcsJobDefinition:
        needs = self.needs
        container = batch.EcsEc2ContainerDefinition(
            self, "Container", image=image, cpu=self.vcpus, memory=Size.mebibytes(needs.memory_mib),
            # The image's entry point is `python -m unit_launcher`; the job is in COMPILE_JOB.
            command=["compile"], job_role=self.job_role,
            # S3 calls go to this region's endpoint, the one the VPC's gateway endpoint serves: the
            # subnets have no other way out, so the artifacts bucket must be in this region.
            environment={"AWS_REGION": Stack.of(self).region, "AWS_DEFAULT_REGION": Stack.of(self).region},
            logging=ecs.LogDriver.aws_logs(stream_prefix="compile", log_group=self.log_group),
            volumes=[batch.EcsVolume.host(name="work", host_path=compile_job.WORK_DIR,
                                          container_path=compile_job.WORK_DIR, readonly=False)],
        )
        acknowledge(
            container.execution_role,
            ("NIST.800.53.R5-IAMNoInlinePolicy", "CDK-generated execution policy scoped to this job's image and logs"),
            ("AwsSolutions-IAM5[Resource::*]", "ecr:GetAuthorizationToken has no resource-level scope; the image pull "
             "and log writes are scoped to this job's repository and log group"))
        return batch.EcsJobDefinition(
            self, "JobDefinition", job_definition_name=compile_job.batch_name(self.fleet), container=container,
            timeout=Duration.hours(needs.timeout_hours), retry_attempts=1, propagate_tags=True,
        )
