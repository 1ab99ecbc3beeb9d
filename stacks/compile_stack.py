"""`<Fleet>-Compile`: the fleet's compile job on AWS Batch, in the pipeline's account and region.

One stack per deployable component: the pipeline deploys it in its Compile stage (so the job
definition follows the fleet's layout and inference image) before it runs the job; by hand,
`npx cdk deploy <Fleet>-Compile` then `python -m inference_fleet compile --config F --submit`.
The job runs the same inference image as the cells (built from containers/inference with the
fleet's base image, or the first cell's pinned one): the compiler is the one that serves.
"""

from __future__ import annotations

from aws_cdk import Environment, Stack, Tags
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from constructs import Construct

from cell_constructs.compile_batch import CompileBatch
from inference_fleet import compile_job
from inference_fleet.config import FleetConfig
from stacks.cell_stack import CONTAINERS_DIR, pinned_image


class CompileStack(Stack):
    def __init__(self, scope: Construct, construct_id: str, *, fleet: FleetConfig) -> None:
        account, region = compile_job.environment(fleet)
        super().__init__(scope, construct_id, env=Environment(account=account, region=region),
                         description=f"{fleet.name} compile job (AWS Batch): NxD Inference artifacts of layout "
                                     "for every cell")
        Tags.of(self).add("fleet", fleet.name)
        self.fleet = fleet
        self.batch = CompileBatch(self, "Compile", fleet=fleet, image=self._image(),
                                  availability_zones=self.availability_zones)

    @property
    def availability_zones(self) -> list[str]:
        """The fleet file's AZs (compile_job.availability_zones), so synth needs no AZ lookup (and no
        credentials), and no guessed `<region>a`: names map to other zones per account, and not every zone
        offers the compile instance types."""
        zones = compile_job.availability_zones(self.fleet)
        if zones is None:  # refused by the fleet checks (check_compile_azs) before any stack is built
            raise ValueError(f"{self.fleet.name}: no AZs for the compile VPC; set pipeline.compile_azs")
        return list(zones)

    def _image(self) -> ecs.ContainerImage:
        pinned = self.fleet.cells[0].images.inference
        if pinned:
            return pinned_image(self, "InferenceRepository", pinned)
        base = self.fleet.base_images
        args = {"NEURON_VLLM_TAG": base.neuron_vllm_tag}
        if base.neuron_vllm_digest:
            args["NEURON_VLLM_DIGEST"] = base.neuron_vllm_digest
        asset = ecr_assets.DockerImageAsset(self, "InferenceImage", directory=str(CONTAINERS_DIR / "inference"),
                                            platform=ecr_assets.Platform.LINUX_AMD64, build_args=args)
        return ecs.ContainerImage.from_docker_image_asset(asset)
