"""The Trainium instance catalogue: the one place that knows what each instance type has.

Every other module (config validation, the planner, the launch template, the task
definition's device list, the launcher's Neuron settings) reads instance facts from
here. Sources are named per field; see also docs/fleet-reference.md "Instance catalogue".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceType:
    """Hardware facts of one Trainium instance type."""

    name: str
    chip: str
    chips: int
    physical_neuron_cores: int
    # Logical NeuronCore sizes the runtime accepts (NEURON_LOGICAL_NC_CONFIG); the
    # first entry is the default. trn1 has no LNC=2.
    logical_nc_configs: tuple[int, ...]
    hbm_gib_per_chip: int
    efa_interfaces: int
    efa_gbps: int
    vcpus: int
    memory_gib: int
    # Roofline figures per chip, for the planner's estimates (dense BF16; FP32 for float32 models, which NxD
    # Inference compiles with --auto-cast=none: models/model_wrapper.py:103 at c63afe02).
    hbm_tbps_per_chip: float
    bf16_tflops_per_chip: float
    fp32_tflops_per_chip: float
    sources: tuple[str, ...]
    # Chip-to-chip NeuronLink bandwidth inside one instance, GB/s per chip.
    neuronlink_gbytes_per_chip: float = 0.0
    # Latency of one step of a ring collective: between two chips over NeuronLink,
    # and between two nodes over EFA (microseconds). See docs/planner.md "Roofline estimate".
    link_hop_latency_us: float = 0.0
    efa_hop_latency_us: float = 0.0
    # Where each roofline figure comes from: (field name, source) pairs.
    figure_sources: tuple[tuple[str, str], ...] = ()
    # Local NVMe instance store: disks and decimal GB per disk (the instance type pages:
    # trn1/trn1n 4 x 1900 GB; trn2/trn2u 4 x 1.92 TB, unverified for trn2u). The model
    # cache is a RAID0 of these disks, assembled at boot (docs/cell-lifecycle.md).
    instance_store_disks: int = 4
    instance_store_gb_per_disk: int = 1900

    @property
    def platform_target(self) -> str:
        """The Neuron platform target of this chip (NEURON_PLATFORM_TARGET_OVERRIDE, neuronx-cc `--target`)."""
        return PLATFORM_TARGETS[self.chip]

    @property
    def instance_store_gib(self) -> float:
        return self.instance_store_disks * self.instance_store_gb_per_disk * 1e9 / 2**30

    @property
    def default_logical_nc_config(self) -> int:
        return self.logical_nc_configs[0]

    def logical_neuron_cores(self, logical_nc_config: int | None = None) -> int:
        """NeuronCores the runtime exposes at the given logical core size."""
        lnc = logical_nc_config or self.default_logical_nc_config
        return self.physical_neuron_cores // lnc

    @property
    def hbm_gib(self) -> int:
        return self.chips * self.hbm_gib_per_chip

    @property
    def efa_gbytes(self) -> float:
        """EFA bandwidth of the whole instance in GB/s (efa_gbps is in Gbit/s)."""
        return self.efa_gbps / 8

    def logical_cores_per_chip(self, logical_nc_config: int | None = None) -> int:
        return self.logical_neuron_cores(logical_nc_config) // self.chips

    def figure_source(self, field: str) -> str:
        """The source of one roofline figure (empty if none is recorded)."""
        return dict(self.figure_sources).get(field, "")

    @property
    def neuron_devices(self) -> list[str]:
        """Host device paths of the Neuron chips, passed into the task one by one."""
        return [f"/dev/neuron{i}" for i in range(self.chips)]

    @property
    def efa_devices(self) -> list[str]:
        """Host device paths of the EFA user verbs, one per EFA interface."""
        return [f"/dev/infiniband/uverbs{i}" for i in range(self.efa_interfaces)]

    @property
    def task_devices(self) -> list[str]:
        """Every host device a unit task is given (the task definition's devices), which the node's setup
        checks before the ECS agent starts: Docker refuses to create a container whose device is missing."""
        return self.neuron_devices + self.efa_devices


_TRN1_SOURCES = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn1-arch.html",
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html",
    "https://aws.amazon.com/ec2/instance-types/trn1/",
)
_TRN2_SOURCES = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn2-arch.html",
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium2.html",
    "https://aws.amazon.com/ec2/instance-types/trn2/",
)

_NEURON_DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest"
_TRAINIUM_PAGE = f"{_NEURON_DOCS}/general/arch/neuron-hardware/trainium.html"
_TRAINIUM2_PAGE = f"{_NEURON_DOCS}/about-neuron/arch/neuron-hardware/trainium2.html"
_NCCOM_TEST = (
    f"{_NEURON_DOCS}/tools/neuron-sys-tools/nccom-test.html "
    "(8-rank all-gather of 1 KiB: p50 10 us over 7 ring steps, about 1.4 us a step)"
)
# No public per-message EFA latency of the Neuron collectives was found: 20 us is an
# assumption. The nccom-test page bounds it from above (a 2-node 64-rank all-reduce of
# 8 B takes 520 us, NEFF launch included). Only layouts that cross nodes depend on it.
_EFA_HOP = "assumption (no public figure found); see docs/planner.md 'Roofline estimate'"
_TRN1_FIGURES = (
    ("hbm_tbps_per_chip", f"{_TRAINIUM_PAGE} (820 GB/s)"),
    ("bf16_tflops_per_chip", f"{_TRAINIUM_PAGE} (190 BF16 TFLOPS)"),
    ("fp32_tflops_per_chip", f"{_TRAINIUM_PAGE} (47.5 FP32 TFLOPS)"),
    ("neuronlink_gbytes_per_chip", f"{_TRAINIUM2_PAGE} (Trainium inter-chip interconnect 384 GB/s/chip)"),
    ("efa_gbps", "https://aws.amazon.com/ec2/instance-types/trn1/ (800 Gbps trn1, 1600 Gbps trn1n)"),
    ("link_hop_latency_us", _NCCOM_TEST),
    ("efa_hop_latency_us", _EFA_HOP),
)
_TRN2_FIGURES = (
    ("hbm_tbps_per_chip", f"{_TRAINIUM2_PAGE} (2.9 TB/s)"),
    ("bf16_tflops_per_chip", f"{_TRAINIUM2_PAGE} (667 BF16 TFLOPS dense)"),
    ("fp32_tflops_per_chip", f"{_TRAINIUM2_PAGE} (181 FP32 TFLOPS)"),
    ("neuronlink_gbytes_per_chip", f"{_TRAINIUM2_PAGE} (NeuronLink-v3 1.28 TB/s per chip)"),
    ("efa_gbps", "https://aws.amazon.com/ec2/instance-types/trn2/ (3200 Gbps EFAv3)"),
    ("link_hop_latency_us", _NCCOM_TEST),
    ("efa_hop_latency_us", _EFA_HOP),
)

# Neuron platform target of each chip: what the compile, run on a CPU host that has none, names as its
# target hardware (NEURON_PLATFORM_TARGET_OVERRIDE; docs/compiled-artifacts.md "Target hardware"). Values as
# NxD reads them (aws-neuron/neuronx-distributed@fbac349b src/neuronx_distributed/utils/utils.py:6-26, enum
# `hardware`: trn1, trn2, trn3; trn1n and inf2 are taken as trn1). trn1n instances get "trn1", not "trn1n":
# NxD Inference tests the string itself (aws-neuron/neuronx-distributed-inference@c63afe02
# modules/attention/attention_base.py:81 `platform_target != "trn1"`, models/config.py:1115 `== "trn2"`).
PLATFORM_TARGETS: dict[str, str] = {"Trainium": "trn1", "Trainium2": "trn2"}

CATALOGUE: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType(
            name="trn1.32xlarge", chip="Trainium", chips=16, physical_neuron_cores=32,
            logical_nc_configs=(1,), hbm_gib_per_chip=32, efa_interfaces=8, efa_gbps=800,
            vcpus=128, memory_gib=512, hbm_tbps_per_chip=0.82, bf16_tflops_per_chip=190.0, fp32_tflops_per_chip=47.5,
            sources=_TRN1_SOURCES, neuronlink_gbytes_per_chip=384.0, link_hop_latency_us=1.4,
            efa_hop_latency_us=20.0, figure_sources=_TRN1_FIGURES,
        ),
        InstanceType(
            name="trn1n.32xlarge", chip="Trainium", chips=16, physical_neuron_cores=32,
            logical_nc_configs=(1,), hbm_gib_per_chip=32, efa_interfaces=16, efa_gbps=1600,
            vcpus=128, memory_gib=512, hbm_tbps_per_chip=0.82, bf16_tflops_per_chip=190.0, fp32_tflops_per_chip=47.5,
            sources=_TRN1_SOURCES, neuronlink_gbytes_per_chip=384.0, link_hop_latency_us=1.4,
            efa_hop_latency_us=20.0, figure_sources=_TRN1_FIGURES,
        ),
        InstanceType(
            name="trn2.48xlarge", chip="Trainium2", chips=16, physical_neuron_cores=128,
            logical_nc_configs=(2, 1), hbm_gib_per_chip=96, efa_interfaces=16, efa_gbps=3200,
            vcpus=192, memory_gib=2048, hbm_tbps_per_chip=2.9, bf16_tflops_per_chip=667.0, fp32_tflops_per_chip=181.0,
            instance_store_gb_per_disk=1920,
            sources=_TRN2_SOURCES, neuronlink_gbytes_per_chip=1280.0, link_hop_latency_us=1.4,
            efa_hop_latency_us=20.0, figure_sources=_TRN2_FIGURES,
        ),
        # EFA interface count of trn2u is not in the public docs we checked; it is the
        # same chassis as trn2.48xlarge, so 16 is assumed (platform-facts.md).
        InstanceType(
            name="trn2u.48xlarge", chip="Trainium2", chips=16, physical_neuron_cores=128,
            logical_nc_configs=(2, 1), hbm_gib_per_chip=96, efa_interfaces=16, efa_gbps=3200,
            vcpus=192, memory_gib=2048, hbm_tbps_per_chip=2.9, bf16_tflops_per_chip=667.0, fp32_tflops_per_chip=181.0,
            instance_store_gb_per_disk=1920,
            sources=_TRN2_SOURCES, neuronlink_gbytes_per_chip=1280.0, link_hop_latency_us=1.4,
            efa_hop_latency_us=20.0, figure_sources=_TRN2_FIGURES,
        ),
    )
}


def instance_type(name: str) -> InstanceType:
    """Look up an instance type; the error lists what is allowed."""
    try:
        return CATALOGUE[name]
    except KeyError:
        allowed = ", ".join(sorted(CATALOGUE))
        raise KeyError(f"unknown instance type {name!r}; allowed: {allowed}") from None
