"""The rules of the fleet file's `routers:` that span fields (issue 26, docs/router.md).

Each router fronts existing cells, each once, of its own region unless `cross_region` is
set; its weights name only those cells and leave at least one above 0; its listener is
HTTPS with a certificate of its region or plain HTTP on purpose (as for cells); one router
per region.
"""

from __future__ import annotations

from collections.abc import Iterable

from inference_fleet.config import ConfigIssue, FleetConfig, RouterConfig


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
