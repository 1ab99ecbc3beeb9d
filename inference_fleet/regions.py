"""The AWS regions a fleet file may name, and the nearest known name for a typo.

A region name that matches the shape `xx-name-N` but is no region (`us-esat-2`) passed
validation and then crashed the synthesis deep inside CDK (jsii `KeyMustResolveToString`
in the cell stack, `KeyError: 'Token'` in the pipeline stack's cross-region support), so
every region is checked against this list before any construct is built.

Source: the AWS Regions list, https://docs.aws.amazon.com/global-infrastructure/latest/regions/aws-regions.html
(commercial and AWS GovCloud (US) regions, checked 2026-12-01). The AWS China regions are
left out: their ARNs use the aws-cn partition, which the fleet's ARN patterns do not take.
tests/test_fleet_strictness.py checks that CDK's own region facts (aws_cdk.region_info)
know every region listed here, so a region accepted here never fails a CDK region lookup.

Trainium is offered in a few of these regions only, and which ones changes; no page that
lists Trainium by region could be checked (the EC2 console's instance-type offerings,
`aws ec2 describe-instance-type-offerings --location-type region`, is the authority).
A cell in a region without the instance type fails at deploy time when its Auto Scaling
group launches, not here: see docs/deploying.md.
"""

from __future__ import annotations

import difflib

AWS_REGIONS: tuple[str, ...] = (
    "af-south-1",
    "ap-east-1", "ap-east-2",
    "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
    "ap-south-1", "ap-south-2",
    "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4", "ap-southeast-5", "ap-southeast-6",
    "ap-southeast-7",
    "ca-central-1", "ca-west-1",
    "eu-central-1", "eu-central-2",
    "eu-north-1",
    "eu-south-1", "eu-south-2",
    "eu-west-1", "eu-west-2", "eu-west-3",
    "il-central-1",
    "me-central-1", "me-south-1",
    "mx-central-1",
    "sa-east-1",
    "us-east-1", "us-east-2",
    "us-gov-east-1", "us-gov-west-1",
    "us-west-1", "us-west-2",
)


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and swaps of neighbours count 1."""
    rows = [list(range(len(b) + 1))] + [[i] + [0] * len(b) for i in range(1, len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[len(a)][len(b)]


def nearest(name: str, known: tuple[str, ...] | list[str]) -> str | None:
    """The closest known name to a misspelt one (us-esat-2 -> us-east-2), or None when nothing is close.

    Closest by edit distance (a swap of two letters is one typo), ties broken by difflib's similarity.
    """
    if not known:
        return None
    name = name.lower()
    best = min(known, key=lambda k: (edit_distance(name, k), -difflib.SequenceMatcher(None, name, k).ratio()))
    return best if edit_distance(name, best) <= max(2, len(best) // 3) else None


def region_problem(region: str) -> str | None:
    """Why `region` is not an AWS region (with the nearest match), or None when it is one."""
    if region in AWS_REGIONS:
        return None
    if region.startswith("cn-"):
        return "the AWS China regions (partition aws-cn) are not supported by this package"
    guess = nearest(region, AWS_REGIONS)
    hint = f"did you mean {guess}? " if guess else ""
    return f"not an AWS region; {hint}allowed: the AWS regions listed in inference_fleet/regions.py"
