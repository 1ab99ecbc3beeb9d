"""The rules of the fleet file's `routers:` that span fields (issue 26, docs/router.md).

Each router fronts existing cells, each once, of its own region unless `cross_region` is
set; its weights name only those cells and leave at least one above 0; its listener is
HTTPS with a certificate of its region or plain HTTP on purpose (as for cells); one router
per region.

The router stack (stacks/router_stack.py) adds what its path to the cells needs: it reads each
cell's PrivateLink endpoint service from an SSM parameter in its own account and region, so
every cell it fronts is of one account and of the router's region; its AZs (default: those the
cells' load balancers share) are load balancer AZs of every cell, at least two; an HTTPS cell
has the DNS name its certificate covers in `tls_names`.
"""

from __future__ import annotations

from collections.abc import Iterable

from inference_fleet.config import CellConfig, ConfigIssue, FleetConfig, RouterConfig, ecr_region


def check_routers(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    seen: dict[str, int] = {}
    for i, router in enumerate(fleet.routers):
        path = f"routers[{i}]"
        if router.region in seen:
            yield ConfigIssue(f"{path}.region", router.region,
                              f"routers[{seen[router.region]}] already fronts {router.region}: one router per region")
        seen.setdefault(router.region, i)
        yield from _cell_issues(fleet, path, router)
        yield from _listener_issues(path, router)
        yield from _stack_issues(fleet, path, router)
        yield from _image_issues(fleet, router)


def _image_issues(fleet: FleetConfig, router: RouterConfig) -> Iterable[ConfigIssue]:
    """The router's tasks run the first fronted cell's pinned proxy image (stacks/router_stack.py `_image`) in
    isolated subnets with no NAT: they reach only their own region's ECR, through its interface endpoints
    (cell_constructs/router_network.py). An image from another region's ECR or from any other registry cannot
    be pulled there. Unpinned, the image is a CDK asset, published to the bootstrap repository of the router
    stack's own account and region: reachable."""
    index = {cell.name: i for i, cell in enumerate(fleet.cells)}
    name = next((n for n in router.cells if n in index and fleet.cells[index[n]].images.proxy), None)
    if name is None:
        return
    i, cell = index[name], fleet.cells[index[name]]
    region = ecr_region(cell.images.proxy or "")
    if region != router.region:
        where = f"ECR in {region}" if region else "not a private ECR repository"
        yield ConfigIssue(
            f"cells[{i}].images.proxy", cell.images.proxy or "",
            f"the router in {router.region} runs this cell's proxy image ({where}) in subnets without a route "
            f"out, which reach only {router.region}'s ECR: push the image to an ECR repository in {router.region} "
            "(<account>.dkr.ecr.<region>.amazonaws.com/<repo>@sha256:<digest>), or leave images.proxy of the "
            "fronted cells unset to build it")


def _cell_issues(fleet: FleetConfig, path: str, router: RouterConfig) -> Iterable[ConfigIssue]:
    regions = {cell.name: cell.region for cell in fleet.cells}
    listed: set[str] = set()
    for j, name in enumerate(router.cells):
        where = f"{path}.cells[{j}]"
        if name in listed:
            yield ConfigIssue(where, name, "listed twice; each cell once")
        listed.add(name)
        if name not in regions:
            yield ConfigIssue(where, name, f"no such cell; cells: {sorted(regions)}")
        elif regions[name] != router.region and not router.cross_region:
            local = sorted(n for n, r in regions.items() if r == router.region)
            yield ConfigIssue(
                where, name,
                f"cell {name} is in {regions[name]}, the router in {router.region}: a router fronts cells of its "
                f"region ({local or 'none here'}); set {path}.cross_region: true to accept the inter-region round "
                "trip on every request",
            )
    weights = router.weights or {}
    for name in sorted(set(weights) - set(router.cells)):
        yield ConfigIssue(f"{path}.weights.{name}", weights[name],
                          f"not a cell of this router; weights name cells of {path}.cells: {list(router.cells)}")
    if router.cells and all(router.weight(name) == 0 for name in router.cells):
        yield ConfigIssue(f"{path}.weights", weights, "every cell has weight 0: at least one needs a weight above 0")


def _listener_issues(path: str, router: RouterConfig) -> Iterable[ConfigIssue]:
    if not router.certificate_arn and not router.plain_http:
        yield ConfigIssue(f"{path}.certificate_arn", None,
                          "required: the listener serves HTTPS; set an ACM certificate ARN of the router's region, "
                          f"or {path}.plain_http: true to serve plain HTTP on purpose")
    if router.certificate_arn and router.plain_http:
        yield ConfigIssue(f"{path}.plain_http", True, "set either certificate_arn or plain_http, not both")
    if router.certificate_arn and f":acm:{router.region}:" not in router.certificate_arn:
        yield ConfigIssue(f"{path}.certificate_arn", router.certificate_arn,
                          f"certificate must be in {router.region}")


def _stack_issues(fleet: FleetConfig, path: str, router: RouterConfig) -> Iterable[ConfigIssue]:
    """What the router stack's path to the cells needs (PrivateLink in one account and region, shared AZs, TLS)."""
    cells = {cell.name: cell for cell in fleet.cells}
    fronted = [cells[name] for name in dict.fromkeys(router.cells) if name in cells]
    if not fronted:
        return
    account = fronted[0].account
    for j, name in enumerate(router.cells):
        cell = cells.get(name)
        if cell is None:
            continue
        if cell.account != account:
            yield ConfigIssue(f"{path}.cells[{j}]", name,
                              f"cell {name} is in account {cell.account}, {fronted[0].name} in {account}: the router "
                              "stack reads each cell's endpoint service from SSM in its own account, so a router "
                              "fronts cells of one account (a cross-account path is not built)")
        elif cell.region != router.region and router.cross_region:
            yield ConfigIssue(f"{path}.cells[{j}]", name,
                              f"cell {name} is in {cell.region}: the router stack reaches cells through PrivateLink "
                              f"endpoints in {router.region} and builds no path to another region (not built); front "
                              f"it from a router in {cell.region}")
    yield from _az_issues(fleet, path, router, [cell for cell in fronted if cell.region == router.region])
    yield from _tls_name_issues(path, router, cells)


def _az_issues(fleet: FleetConfig, path: str, router: RouterConfig, fronted: list[CellConfig]) -> Iterable[ConfigIssue]:
    if not fronted:
        return
    azs = fleet.router_azs(router)
    allowed = {cell.name: cell.resolved_alb_azs for cell in fronted}
    if router.azs:
        for k, az in enumerate(router.azs):
            missing = sorted(name for name, zones in allowed.items() if az not in zones)
            if missing:
                zones = {n: list(allowed[n]) for n in missing}
                yield ConfigIssue(f"{path}.azs[{k}]", az,
                                  f"not a load balancer AZ of cell(s) {missing} ({zones}): the router's endpoints "
                                  "reach a cell only in AZs of its endpoint service")
        if len(set(router.azs)) != len(router.azs):
            yield ConfigIssue(f"{path}.azs", list(router.azs), "each AZ once")
    elif len(azs) < 2:
        yield ConfigIssue(f"{path}.azs", None,
                          f"the cells' load balancer AZs ({ {n: list(z) for n, z in allowed.items()} }) share "
                          f"{list(azs) or 'none'}; the router needs 2: give the cells common alb_azs")


def _tls_name_issues(path: str, router: RouterConfig, cells: dict[str, CellConfig]) -> Iterable[ConfigIssue]:
    names = router.tls_names or {}
    for name in router.cells:
        cell = cells.get(name)
        if cell is not None and cell.certificate_arn and name not in names:
            yield ConfigIssue(f"{path}.tls_names.{name}", None,
                              f"required: cell {name} serves HTTPS; give the DNS name its certificate covers (the "
                              "router verifies the certificate against it)")
    first: dict[str, str] = {}
    for name in sorted(names):
        cell = cells.get(name)
        if names[name] in first:
            yield ConfigIssue(f"{path}.tls_names.{name}", names[name],
                              f"also the name of cell {first[names[name]]}: each HTTPS cell is reached under its own "
                              "name (one private hosted zone each in the router's VPC)")
        first.setdefault(names[name], name)
        if name not in router.cells:
            yield ConfigIssue(f"{path}.tls_names.{name}", names[name],
                              f"not a cell of this router; tls_names name HTTPS cells of {path}.cells")
        elif cell is not None and not cell.certificate_arn:
            yield ConfigIssue(f"{path}.tls_names.{name}", names[name],
                              f"cell {name} serves plain HTTP (no certificate_arn): the router reaches it without TLS; "
                              "remove this name")


def _candidates(fleet: FleetConfig) -> list[CellConfig]:
    """The fronted cells `pipeline.evacuate` names, before the rule that a router keeps a cell in service."""
    if fleet.pipeline is None or fleet.pipeline.evacuate == "none":
        return []
    fronted = {name for router in fleet.routers for name in router.cells}
    return [c for c in fleet.cells if c.name in fronted
            and (fleet.pipeline.evacuate == "all" or c.resolved_min_units == 1)]


def _strands(fleet: FleetConfig, cell: CellConfig, candidates: list[CellConfig]) -> RouterConfig | None:
    """A router of the cell whose every cell would be out during the cell's wave, if there is one."""
    out = {c.name for c in candidates if c.wave == cell.wave}
    # A weight-0 cell takes no request even when it is the router's only one (HAProxy configuration manual 2.6,
    # 5.2 "weight"): it is no cell left.
    return next((r for r in fleet.routers
                 if cell.name in r.cells and {c for c in r.cells if r.weight(c) > 0} <= out), None)


def pipeline_evacuations(fleet: FleetConfig) -> list[CellConfig]:
    """The cells the pipeline evacuates before their update (stacks/evacuation.py): `pipeline.evacuate`'s
    fronted cells, leaving out in one-unit mode those whose router would have no cell left in their wave
    (in all mode such a fleet is refused by check_pipeline_evacuation)."""
    candidates = _candidates(fleet)
    return [c for c in candidates if _strands(fleet, c, candidates) is None]


def check_pipeline_evacuation(fleet: FleetConfig) -> Iterable[ConfigIssue]:
    """What the pipeline's evacuation needs: routers to evacuate at, a cell left at each router in each wave
    (all mode), and the evacuated cells in the pipeline's account: the action writes the routers' SSM
    parameters with the pipeline's own role, and a router's stack is in its cells' account."""
    pipeline = fleet.pipeline
    if pipeline is None or pipeline.evacuate == "none":
        return
    if pipeline.evacuate == "all" and not fleet.routers:
        yield ConfigIssue("pipeline.evacuate", "all", "no router fronts any cell (routers:), so there is nothing to "
                          "evacuate at; add a router, or set pipeline.evacuate: none")
    candidates, stranded = _candidates(fleet), set()
    for cell in candidates:
        router = _strands(fleet, cell, candidates)
        if router is not None and pipeline.evacuate == "all" and (router.region, cell.wave) not in stranded:
            stranded.add((router.region, cell.wave))
            yield ConfigIssue(
                "pipeline.evacuate", "all",
                f"the router in {router.region} fronts {list(router.cells)}, all in wave {cell.wave}: evacuating them "
                "all would leave it no cell; put one of them in another wave, or set pipeline.evacuate: one-unit")
    for cell in pipeline_evacuations(fleet):
        if cell.account != pipeline.account:
            yield ConfigIssue(
                "pipeline.evacuate", pipeline.evacuate,
                f"cell {cell.name} is in account {cell.account}, the pipeline in {pipeline.account}: the pipeline "
                "evacuates it by writing its routers' SSM parameters (in the cells' account) with its own role; "
                "put the cell in the pipeline's account, or set pipeline.evacuate: none")
