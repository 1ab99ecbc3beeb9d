"""The cell's front door: an ALB whose one target group holds the proxy of every unit's leader.

Internal by default (the assistant's application tier calls it); HTTPS with a TLS 1.2+
policy when a certificate is configured. The target group routes by least outstanding
requests, so a long generation does not pile more streams onto a busy unit, and checks
each proxy's /health, which is 200 only while the whole unit is up.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import ArnFormat, Duration, RemovalPolicy, Stack
from aws_cdk import aws_certificatemanager as acm
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_wafv2 as wafv2
from constructs import Construct

from cell_constructs.deletion_protection import create_unprotected, protect_after
from cell_constructs.nag import acknowledge
from inference_fleet.config import (
    UNIT_HEALTH_CHECK_INTERVAL_SECONDS,
    UNIT_HEALTHY_THRESHOLD,
    UNIT_UNHEALTHY_THRESHOLD,
)

HEALTH_CHECK_PATH = "/health"


class UnitLoadBalancer(Construct):
    """ALB, listener and the unit target group, with access logs to an encrypted bucket."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        internet_facing: bool,
        client_cidrs: list[str],
        certificate_arn: str | None,
        target_port: int,
        idle_timeout: Duration,
        deregistration_delay: Duration,
        deletion_protection: bool,
        encryption_key: kms.IKey,
        log_retention: logs.RetentionDays,
        target_type: elbv2.TargetType = elbv2.TargetType.INSTANCE,
        health_check_path: str = HEALTH_CHECK_PATH,
        health_check_port: int | None = None,
        owner: str = "cell",
        privatelink_accounts: Sequence[str] = (),
    ) -> None:
        """`target_type`, `health_check_path`, `health_check_port` (default: the target port) and `owner`
        (named in acknowledgements) default to the cell's ALB; the cell router's stack passes its own (IP
        targets: Fargate tasks, `/router/health` on its health listener). `privatelink_accounts`: the accounts
        whose interface endpoints reach this ALB through a router endpoint (cell_constructs/router_endpoint.py),
        named in the acknowledgements that say who reaches it; empty for an ALB no router fronts."""
        super().__init__(scope, construct_id)
        self._encryption_key, self._log_retention = encryption_key, log_retention
        self._target_type, self._health_check_path, self._owner = target_type, health_check_path, owner
        self._health_check_port = health_check_port
        self._reach = self._who_reaches(sorted(set(privatelink_accounts)))
        self._deletion_protection = deletion_protection
        self.web_acl: wafv2.CfnWebACL | None = None
        self.waf_logs: logs.LogGroup | None = None
        self.access_logs = self._access_logs_bucket()
        self.listener_port = listener_port = 443 if certificate_arn else 80
        self.security_group = self._security_group(vpc, client_cidrs, listener_port)
        self.load_balancer = self._load_balancer(vpc, subnets, internet_facing, idle_timeout, deletion_protection)
        self.target_group = self._target_group(vpc, target_port, deregistration_delay)
        self.listener = self._listener(certificate_arn)
        self._guard(internet_facing, client_cidrs)

    def _access_logs_bucket(self) -> s3.Bucket:
        """The ALB's access logs: SSE-S3 (the only encryption ALB logging takes), SSL only, kept 90 days."""
        bucket = s3.Bucket(
            self,
            "AccessLogs",
            # ALB access logs support SSE-S3 only, not SSE-KMS.
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=True,
            lifecycle_rules=[
                s3.LifecycleRule(expiration=Duration.days(90), noncurrent_version_expiration=Duration.days(7))
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )
        acknowledge(
            bucket,
            ("AwsSolutions-S1", "This bucket is itself the access-log destination of the ALB"),
            ("NIST.800.53.R5-S3BucketLoggingEnabled", "This bucket is itself the access-log destination of the ALB"),
            (
                "NIST.800.53.R5-S3BucketReplicationEnabled",
                "Access logs are kept in the cell's region; a cell shares nothing with other regions",
            ),
            ("NIST.800.53.R5-S3DefaultEncryptionKMS", "ALB access logging supports only SSE-S3 encryption"),
        )
        return bucket

    def _security_group(self, vpc: ec2.IVpc, client_cidrs: list[str], listener_port: int) -> ec2.SecurityGroup:
        """Clients in on the listener port, from the configured CIDRs only; no outbound rule of its own."""
        group = ec2.SecurityGroup(
            self,
            "SecurityGroup",
            vpc=vpc,
            allow_all_outbound=False,
            description="Unit load balancer: clients in, proxies out" if self._owner == "cell"
            else f"{self._owner.capitalize()} load balancer: clients in, {self._owner} tasks out",
        )
        for cidr in client_cidrs:
            group.add_ingress_rule(ec2.Peer.ipv4(cidr), ec2.Port.tcp(listener_port), "clients")
        return group

    def _load_balancer(
        self,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        internet_facing: bool,
        idle_timeout: Duration,
        deletion_protection: bool,
    ) -> elbv2.ApplicationLoadBalancer:
        """The ALB: invalid headers dropped, HTTP/2, access logs; deletion protection later (`protect_after`)."""
        alb = elbv2.ApplicationLoadBalancer(
            self,
            "Alb",
            vpc=vpc,
            vpc_subnets=subnets,
            internet_facing=internet_facing,
            security_group=self.security_group,
            idle_timeout=idle_timeout,
            drop_invalid_header_fields=True,
            deletion_protection=deletion_protection,
            http2_enabled=True,
        )
        alb.log_access_logs(self.access_logs, prefix="alb")
        if deletion_protection:
            create_unprotected(alb, self._owner)
        else:
            acknowledge(
                alb,
                (
                    "NIST.800.53.R5-ELBDeletionProtectionEnabled",
                    f"deletion_protection is switched off for this {self._owner} in the fleet file",
                ),
            )
        return alb

    def protect_after(self, services: list[Construct]) -> Construct | None:
        """Switch deletion protection on once `services` have stabilised (cell_constructs/deletion_protection.py);
        nothing when the fleet file switches it off. Returns the custom resource, for what must follow it."""
        if not self._deletion_protection:
            return None
        return protect_after(self, "DeletionProtection", self.load_balancer, services,
                             encryption_key=self._encryption_key, log_retention=self._log_retention)

    def _target_group(
        self, vpc: ec2.IVpc, target_port: int, deregistration_delay: Duration
    ) -> elbv2.ApplicationTargetGroup:
        """The units' proxies: least outstanding requests, health from each proxy's /health."""
        return elbv2.ApplicationTargetGroup(
            self,
            "Units",
            vpc=vpc,
            port=target_port,
            protocol=elbv2.ApplicationProtocol.HTTP,
            target_type=self._target_type,
            load_balancing_algorithm_type=elbv2.TargetGroupLoadBalancingAlgorithmType.LEAST_OUTSTANDING_REQUESTS,
            deregistration_delay=deregistration_delay,
            health_check=elbv2.HealthCheck(
                path=self._health_check_path,
                port=str(self._health_check_port or target_port),
                interval=Duration.seconds(UNIT_HEALTH_CHECK_INTERVAL_SECONDS),
                timeout=Duration.seconds(5),
                healthy_threshold_count=UNIT_HEALTHY_THRESHOLD,
                # The proxy's admission window follows these (ServingConfig.admission_window_seconds).
                unhealthy_threshold_count=UNIT_UNHEALTHY_THRESHOLD,
                healthy_http_codes="200",
            ),
        )

    def _listener(self, certificate_arn: str | None) -> elbv2.ApplicationListener:
        """HTTPS with a TLS 1.2+ policy when the cell has a certificate, otherwise plain HTTP."""
        if certificate_arn:
            listener = self.load_balancer.add_listener(
                "Https",
                port=443,
                protocol=elbv2.ApplicationProtocol.HTTPS,
                certificates=[
                    elbv2.ListenerCertificate.from_certificate_manager(
                        acm.Certificate.from_certificate_arn(self, "Certificate", certificate_arn)
                    )
                ],
                ssl_policy=elbv2.SslPolicy.RECOMMENDED_TLS,
                default_target_groups=[self.target_group],
                open=False,
            )
        else:
            listener = self.load_balancer.add_listener(
                "Http",
                port=80,
                protocol=elbv2.ApplicationProtocol.HTTP,
                default_target_groups=[self.target_group],
                open=False,
            )
            no_tls = (
                f"No certificate_arn is configured for this {self._owner}: plain HTTP, {self._reach}; "
                "set certificate_arn to serve HTTPS"
            )
            acknowledge(self.load_balancer, ("NIST.800.53.R5-ALBHttpToHttpsRedirection", no_tls))
            acknowledge(listener, ("NIST.800.53.R5-ELBv2ACMCertificateRequired", no_tls))
        return listener

    @staticmethod
    def _who_reaches(privatelink_accounts: list[str]) -> str:
        """Who reaches the ALB, for the acknowledgements: the client CIDRs, and any router endpoint's callers."""
        if not privatelink_accounts:
            return "reachable only from the configured client CIDRs"
        # The router endpoint's ingress rule admits the NLB's subnets whatever client_cidrs says, and its
        # endpoint service (acceptance not required) admits these accounts' roots: any VPC of theirs with an
        # interface endpoint of the service reaches this ALB (docs/router.md, "Cross-VPC path").
        accounts = ", ".join(privatelink_accounts)
        return (
            "reachable from the configured client CIDRs and, through the router endpoint's PrivateLink "
            f"endpoint service (acceptance not required), from an interface endpoint in any VPC of account "
            f"{accounts}, which the service admits: the cell routers' account, this cell's own (a router "
            "fronts cells of one account), where creating an endpoint takes that account's IAM permission "
            "(ec2:CreateVpcEndpoint); the routers' internal ALBs admit only their own client CIDRs"
        )

    def _guard(self, internet_facing: bool, client_cidrs: list[str]) -> None:
        """Internet-facing: a web ACL of AWS managed rules; internal: reachable from the client CIDRs only."""
        if internet_facing:
            acknowledge(
                self.security_group, ("AwsSolutions-EC23", "internet_facing is set for this cell in the fleet file")
            )
            self._attach_web_acl()
        else:
            if any(cidr.endswith("/0") for cidr in client_cidrs):
                # An internal ALB open to 0.0.0.0/0 is still reachable only over routes into the VPC.
                acknowledge(self.security_group, (
                    "AwsSolutions-EC23",
                    f"{self._owner}s[].client_cidrs includes 0.0.0.0/0 in the fleet file: an internal ALB, reachable "
                    "from whatever routes into the VPC (peering, VPN, Transit Gateway)",
                ))
            acknowledge(
                self.load_balancer,
                (
                    "NIST.800.53.R5-ALBWAFEnabled",
                    f"Internal ALB {self._reach} (the application tier); "
                    "AWS managed body-size rules would reject long prompts",
                ),
            )

    def _attach_web_acl(self) -> None:
        """Internet-facing cells: AWS managed rules for known bad inputs and IP reputation, with logging.

        The common rule set is left out on purpose: its SizeRestrictions_BODY rule blocks
        request bodies over 8 KB, and prompts are often longer.
        """
        rules = [
            wafv2.CfnWebACL.RuleProperty(
                name=name,
                priority=priority,
                statement=wafv2.CfnWebACL.StatementProperty(
                    managed_rule_group_statement=wafv2.CfnWebACL.ManagedRuleGroupStatementProperty(
                        vendor_name="AWS", name=name
                    )
                ),
                override_action=wafv2.CfnWebACL.OverrideActionProperty(none={}),
                visibility_config=wafv2.CfnWebACL.VisibilityConfigProperty(
                    cloud_watch_metrics_enabled=True, metric_name=name, sampled_requests_enabled=True
                ),
            )
            for priority, name in enumerate(
                ("AWSManagedRulesKnownBadInputsRuleSet", "AWSManagedRulesAmazonIpReputationList")
            )
        ]
        web_acl = wafv2.CfnWebACL(
            self,
            "WebAcl",
            scope="REGIONAL",
            default_action=wafv2.CfnWebACL.DefaultActionProperty(allow={}),
            rules=rules,
            visibility_config=wafv2.CfnWebACL.VisibilityConfigProperty(
                cloud_watch_metrics_enabled=True, metric_name="UnitLoadBalancer", sampled_requests_enabled=True
            ),
        )
        wafv2.CfnWebACLAssociation(
            self,
            "WebAclAssociation",
            resource_arn=self.load_balancer.load_balancer_arn,
            web_acl_arn=web_acl.attr_arn,
        )
        self.web_acl = web_acl
        self._log_web_acl(web_acl)

    def _log_web_acl(self, web_acl: wafv2.CfnWebACL) -> None:
        """The web ACL's request log, in a KMS-encrypted log group of the cell.

        AWS WAF logs to CloudWatch Logs only into a log group whose name starts with
        aws-waf-logs-, in the web ACL's account and region, named by its ARN without the
        trailing `:*`; when logging is enabled AWS WAF adds the log group's resource policy
        itself (https://docs.aws.amazon.com/waf/latest/developerguide/logging-cw-logs.html,
        https://docs.aws.amazon.com/waf/latest/APIReference/API_LoggingConfiguration.html).
        The cell's key already lets CloudWatch Logs encrypt the account's log groups
        (cell_constructs/encryption.py). Logs hold request headers, not bodies; the
        Authorization header is redacted.
        """
        stack = Stack.of(self)
        name = f"aws-waf-logs-{stack.stack_name}"
        self.waf_logs = logs.LogGroup(
            self, "WafLogs",
            log_group_name=name,
            encryption_key=self._encryption_key,
            retention=self._log_retention,
            # Fixed name: kept on update and delete, but deleted when the create that made it rolls
            # back (DeletionPolicy RetainExceptOnCreate,
            # https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-deletionpolicy.html),
            # or the next create would fail on the name ("already exists").
            removal_policy=RemovalPolicy.RETAIN_ON_UPDATE_OR_DELETE,
        )
        arn = stack.format_arn(
            service="logs", resource="log-group", resource_name=name, arn_format=ArnFormat.COLON_RESOURCE_NAME
        )
        logging = wafv2.CfnLoggingConfiguration(
            self, "WafLogging",
            resource_arn=web_acl.attr_arn,
            log_destination_configs=[arn],
            redacted_fields=[wafv2.CfnLoggingConfiguration.FieldToMatchProperty(
                single_header={"Name": "authorization"}
            )],
        )
        logging.node.add_dependency(self.waf_logs)
