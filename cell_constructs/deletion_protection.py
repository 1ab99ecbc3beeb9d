"""Deletion protection of a load balancer, switched on only once the stack's services have stabilised.

A load balancer created with `deletion_protection.enabled: true` blocks the rollback of a
first create that fails after it (service-linked-role race, no Trainium quota or capacity,
the ECS deployment circuit breaker): ELB refuses DeleteLoadBalancer with
"OperationNotPermitted ... deletion protection is enabled" and the stack ends in
ROLLBACK_FAILED (aws-cloudformation/rain#187). So the load balancer is created without the
attribute, and a custom resource that depends on the services sets it with
ModifyLoadBalancerAttributes
(https://docs.aws.amazon.com/elasticloadbalancing/latest/APIReference/API_ModifyLoadBalancerAttributes.html)
on create (and again only when the load balancer is replaced: its ARN is the call's one changing
property, so an ordinary deploy sends no update; protection switched off by hand stays off); on a
failed create it never ran, and the rollback deletes the load balancer. On delete it does nothing:
the operator switches protection off first, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Stack
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import custom_resources as cr
from constructs import Construct, IConstruct

from cell_constructs.nag import acknowledge

ATTRIBUTE = "deletion_protection.enabled"
ACTION = "elasticloadbalancing:ModifyLoadBalancerAttributes"


def create_unprotected(load_balancer: elbv2.BaseLoadBalancer, owner: str) -> None:
    """Drop the attribute CDK always writes ("true" or "false"): CloudFormation must not set it at all,
    or an update of the load balancer's attributes would switch off what the custom resource switched on.

    A stack deployed with the attribute keeps protection when the key leaves the list: CloudFormation
    does not reset a removed LoadBalancerAttributes key (reported, not documented:
    aws-cloudformation/cloudformation-coverage-roadmap#554, aws/aws-cdk#9975, the reason CDK writes
    "false"); the custom resource sets it true on that update anyway."""
    load_balancer.remove_attribute(ATTRIBUTE)
    acknowledge(load_balancer, (
        "NIST.800.53.R5-ELBDeletionProtectionEnabled",
        f"Deletion protection of this {owner}'s load balancer is switched on by its DeletionProtection custom "
        "resource once the services have stabilised, so that a failed first create can roll back",
    ))


def protect_after(
    scope: Construct, construct_id: str, load_balancer: elbv2.BaseLoadBalancer, after: Sequence[IConstruct], *,
    encryption_key: kms.IKey, log_retention: logs.RetentionDays,
) -> cr.AwsCustomResource:
    """ModifyLoadBalancerAttributes(deletion_protection.enabled=true) once every construct of `after` exists.

    The provider function's log group is the stack's own (encrypted with the stack key, kept as
    its other logs): the stack's first AwsCustomResource creates the one provider function."""
    call = cr.AwsSdkCall(
        service="ElasticLoadBalancingV2",
        action="modifyLoadBalancerAttributes",
        parameters={
            "LoadBalancerArn": load_balancer.load_balancer_arn,
            "Attributes": [{"Key": ATTRIBUTE, "Value": "true"}],
        },
        # One resource per load balancer; the response (the whole attribute list) is not read.
        physical_resource_id=cr.PhysicalResourceId.of(f"{construct_id}-{ATTRIBUTE}"),
        output_paths=["Attributes.0.Key"],
    )
    resource = cr.AwsCustomResource(
        scope, construct_id,
        on_create=call, on_update=call,
        policy=cr.AwsCustomResourcePolicy.from_statements([
            iam.PolicyStatement(actions=[ACTION], resources=[load_balancer.load_balancer_arn]),
        ]),
        install_latest_aws_sdk=False,
        # Only the stack's first AwsCustomResource creates the provider and takes its log group.
        log_group=None if _provider(Stack.of(scope)) else logs.LogGroup(
            scope, f"{construct_id}Logs", encryption_key=encryption_key, retention=log_retention),
    )
    acknowledge(resource.node.find_child("CustomResourcePolicy"), (
        "NIST.800.53.R5-IAMNoInlinePolicy",
        f"CDK-generated policy of the AwsCustomResource provider: {ACTION} on this one load balancer only",
    ))
    # On the custom resource itself, not the whole construct: its inline policy (a child) is then created
    # with the stack's other resources, long before the call, instead of seconds before it (IAM applies a
    # new policy with a delay: an AccessDenied there would fail the create after the services were up).
    call_resource = resource.node.find_child("Resource")
    for construct in after:
        call_resource.node.add_dependency(construct)
    _acknowledge_provider(Stack.of(scope))
    return resource


def _acknowledge_provider(stack: Stack) -> None:
    """The findings on the stack's one AwsCustomResource function and its role (shared by every call of it)."""
    provider = _provider(stack)
    if provider is None:
        raise RuntimeError("the AwsCustomResource provider function was not created")
    once = "Runs once per stack create or update, a single ModifyLoadBalancerAttributes call"
    acknowledge(
        provider,
        ("AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole]",
         "CDK's AwsCustomResource provider writes its own logs with the AWS managed basic execution policy"),
        ("NIST.800.53.R5-LambdaConcurrency", once),
        ("NIST.800.53.R5-LambdaDLQ", f"{once}, invoked synchronously by CloudFormation, which reports its failure"),
        ("NIST.800.53.R5-LambdaInsideVPC",
         "Calls only the Elastic Load Balancing API (ModifyLoadBalancerAttributes); nothing in the VPC"),
    )


def _provider(stack: Stack) -> IConstruct | None:
    """The stack's AwsCustomResource provider function (a singleton: CDK names it by its fixed UUID)."""
    return stack.node.try_find_child(f"AWS{cr.AwsCustomResource.PROVIDER_FUNCTION_UUID.replace('-', '')}")
